"""Nothing is lost unsaid (#26): ``close()`` waits at most ``close_timeout``, says how many reports were
delivered, keeps the rest on disk, and ``nanwatch push`` delivers them later, idempotently. Real parts: a
socket that accepts and never answers, a port nobody listens on, a real collector killed and restarted."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch
from support import TOKEN, CollectorProcess, TinyNet, free_port, scrape, step_report

import nanwatch
from nanwatch.hooks.report import spool as spool_mod
from nanwatch.hooks.report.spool import Spool, run_folder_name, undelivered_root
from nanwatch.hooks.report.transport import ReportSender
from nanwatch.wire import StepReport

_ACCOUNT = re.compile(r"reports to (\S+): (\d+) of (\d+) delivered, (\d+) not"
                      r"(?:; (\d+) kept \(steps [^)]*\) in (\S+):)?(?:.*; (\d+) lost)?")


@contextlib.contextmanager
def hung_collector():
    """A TCP server that accepts every connection and never answers (nor closes)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    held = []

    def accept():
        while True:
            try:
                held.append(srv.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.getsockname()[1]}"
    finally:
        srv.close()
        for c in held:
            c.close()


def _returns(close) -> None:
    """``close()`` returns at all (a generous two minutes; its bound is a few seconds): no wall-time claim."""
    t = threading.Thread(target=close, daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive(), "close() did not return"


def _account(caplog) -> dict:
    """The one account line the close logged, parsed."""
    lines = [r.getMessage() for r in caplog.records if "delivered," in r.getMessage()]
    assert len(lines) == 1, lines
    m = _ACCOUNT.search(lines[0])
    assert m, lines[0]
    url, delivered, submitted, undelivered, kept, path, lost = m.groups()
    return {"delivered": int(delivered), "submitted": int(submitted), "undelivered": int(undelivered),
            "kept": int(kept or 0), "path": path, "lost": int(lost or 0), "line": lines[0]}


def _train(mon, model, steps: range) -> None:
    for n in steps:
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(n))
        with mon.step(n):
            model(ids).float().square().mean().backward()


def _monitor(model, url: str, log_dir: Path, produced: list, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TinyNet's attention class is not named *Attention
        return nanwatch.attach(model, run_id="undelivered-1", collector=url, log_dir=str(log_dir),
                               on_report=produced.append, directive_source="off", capsule=False, **kw)


def _push(url: str, *paths, token: str | None = None) -> subprocess.CompletedProcess:
    """``nanwatch push`` in a fresh process in which importing torch fails: the CLI stays light."""
    code = ("import sys\n"
            "class Block:\n"
            "    def find_spec(self, name, path=None, target=None):\n"
            "        if name.split('.')[0] in ('torch', 'fastapi', 'uvicorn'):\n"
            "            raise ImportError('blocked: ' + name)\n"
            "sys.meta_path.insert(0, Block())\n"
            "from nanwatch.cli import main\n"
            "sys.exit(main(sys.argv[1:]))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("NANWATCH_")}
    if token:
        env["NANWATCH_TOKEN"] = token
    return subprocess.run([sys.executable, "-c", code, "push", "--collector", url, *map(str, paths)],
                          capture_output=True, text=True, timeout=120, env=env)


def _sdpa_calls(url: str, run_id: str) -> float:
    """Attention calls the collector holds for the run: every training report adds its step's calls."""
    return sum(v for (name, labels), v in scrape(url).items()
               if name == "nanwatch_sdpa_calls_total" and ("run_id", run_id) in labels)


# ---- the sender alone ------------------------------------------------------------------------------------

def test_a_hung_collector_is_cut_off_at_close_and_every_report_is_kept_in_order(tmp_path, caplog):
    spool = Spool(tmp_path, run_id="hung", rank=0, incarnation="inc1")
    with hung_collector() as url, caplog.at_level(logging.INFO, logger="nanwatch.transport"):
        sender = ReportSender(url, timeout_s=60, spool=spool)  # a request would wait a minute unless cut off
        for i in range(41):
            assert sender.submit(step_report(run_id="hung", seq=i, incarnation="inc1"))
        _returns(lambda: sender.close(timeout_s=0.5))  # the request in flight is cut off
    acc = _account(caplog)
    assert (acc["delivered"], acc["submitted"], acc["kept"], acc["lost"]) == (0, 41, 41, 0), acc["line"]
    assert acc["path"] == str(spool.path) and "nanwatch push --collector " + url in acc["line"]
    kept = [line for line in spool.path.read_text().splitlines() if line]
    assert [StepReport.model_validate_json(line).seq for line in kept] == list(range(41))


def test_nothing_listening_every_report_is_accounted_for(tmp_path, caplog):
    spool = Spool(tmp_path, run_id="deaf", rank=0, incarnation="inc1")
    with caplog.at_level(logging.INFO, logger="nanwatch.transport"):
        sender = ReportSender(f"http://127.0.0.1:{free_port()}", spool=spool, backoff_base_s=0.05)
        for i in range(41):
            sender.submit(step_report(run_id="deaf", seq=i, incarnation="inc1"))
        sender.close(timeout_s=0.5)
    acc = _account(caplog)
    assert (acc["delivered"], acc["submitted"], acc["undelivered"], acc["kept"]) == (0, 41, 41, 41), acc["line"]
    assert sender.account.kept == 41 and sender.account.lost == 0 and sender.dropped == 0


def test_what_cannot_be_kept_is_counted_lost_with_its_steps(tmp_path, caplog, monkeypatch):
    line = len(step_report(run_id="full", seq=0, incarnation="i").model_dump_json()) + 1
    monkeypatch.setattr(spool_mod, "MAX_FILE_BYTES", 10 * line + line // 2)  # room for ten
    spool = Spool(tmp_path, run_id="full", rank=0, incarnation="i")
    with caplog.at_level(logging.INFO, logger="nanwatch.transport"):
        sender = ReportSender(f"http://127.0.0.1:{free_port()}", spool=spool)
        for i in range(15):
            sender.submit(step_report(run_id="full", seq=i, step=100 + i, incarnation="i"))
        sender.close(timeout_s=0.3)
    acc = _account(caplog)
    assert (acc["submitted"], acc["kept"], acc["lost"]) == (15, 10, 5), acc["line"]
    assert "steps 110-114" in acc["line"] and "full" in acc["line"]
    assert sender.dropped == 5


# ---- where they are kept ---------------------------------------------------------------------------------

def test_run_folders_stay_inside_and_never_collide(tmp_path, monkeypatch):
    ids = ["a", "A", "..", ".", "a.b", "a:b", "a%3Ab", "run-x", "x/../../etc", "a" * 128, "a" * 127 + "b",
           ":" * 128, ":" * 127 + ".", "\x00", "é"]
    names = [run_folder_name(i) for i in ids]
    assert len(set(names)) == len(ids), names
    for name in names:
        assert "/" not in name and "\\" not in name and "\x00" not in name and name.startswith("run-")
        assert len(name) <= 200
        assert (tmp_path / name).resolve().parent == tmp_path.resolve()
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    assert undelivered_root(None) == tmp_path / "state" / "nanwatch" / "undelivered"
    assert undelivered_root(str(tmp_path / "logs")) == tmp_path / "logs" / "undelivered"
    monkeypatch.setenv("XDG_STATE_HOME", "relative/not/allowed")
    assert undelivered_root(None) == Path.home() / ".local" / "state" / "nanwatch" / "undelivered"


# ---- the Monitor, end to end -----------------------------------------------------------------------------

def test_monitor_against_a_hung_collector_then_push_delivers_all_once(tmp_path, caplog):
    model, produced = TinyNet(), []
    with hung_collector() as url, caplog.at_level(logging.INFO, logger="nanwatch.transport"):
        mon = _monitor(model, url, tmp_path / "logs", produced, close_timeout=1.0)
        _train(mon, model, range(40))
        _returns(mon.close)  # bounded by close_timeout
    acc = _account(caplog)
    assert acc["submitted"] == len(produced) == 41  # 40 steps and the final report
    assert (acc["delivered"], acc["kept"], acc["lost"]) == (0, 41, 0), acc["line"]
    folder = tmp_path / "logs" / "undelivered" / run_folder_name("undelivered-1")
    assert Path(acc["path"]).parent == folder
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    with CollectorProcess(db_path=tmp_path / "c.db") as c:
        first = _push(c.url, tmp_path / "logs" / "undelivered")
        assert first.returncode == 0, first.stdout + first.stderr
        assert "41 applied, 0 already held" in first.stdout
        assert not list(folder.glob("*.jsonl"))  # acknowledged: removed
        again = _push(c.url, copy)  # the same reports once more
        assert again.returncode == 0, again.stdout + again.stderr
        assert "0 applied, 41 already held" in again.stdout
        m = scrape(c.url)
        assert m[("nanwatch_collector_reports_accepted_total", frozenset())] == 41
        assert m[("nanwatch_collector_reports_duplicate_total", frozenset())] == 41
        assert _sdpa_calls(c.url, "undelivered-1") == 2 * 40  # two attention calls a step, each step once


def test_monitor_with_nothing_listening_says_exactly_what_it_kept(tmp_path, caplog, monkeypatch):
    monkeypatch.delenv("NANWATCH_LOG_DIR", raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))  # the default folder
    model, produced = TinyNet(), []
    port = free_port()
    with caplog.at_level(logging.INFO, logger="nanwatch.transport"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mon = nanwatch.attach(model, run_id="deaf-run", collector=f"http://127.0.0.1:{port}",
                                  on_report=produced.append, directive_source="off", capsule=False)
        _train(mon, model, range(40))
        mon.close()
    acc = _account(caplog)
    # every report made is kept: 40 steps and the final one, less a step the reporter dropped for being behind
    # (a loaded machine: training never waits for it; the next report counts it in dropped_reports)
    steps = sum(1 for r in produced if not r.final)
    assert steps + mon.dropped_reports == 40 and steps > 0, (steps, mon.dropped_reports)
    assert (acc["delivered"], acc["submitted"], acc["kept"], acc["lost"]) == (0, len(produced), len(produced), 0), \
        acc["line"]
    assert Path(acc["path"]).is_relative_to(tmp_path / "state" / "nanwatch" / "undelivered" / "run-deaf-run")
    with CollectorProcess(db_path=tmp_path / "c.db", port=port, env={"NANWATCH_TOKEN": TOKEN}) as c:
        refused = _push(c.url)  # no token: refused, nothing removed
        assert refused.returncode == 1 and "HTTP 401" in refused.stderr, refused.stdout + refused.stderr
        monkeypatch.setenv("NANWATCH_LOG_DIR", "")
        env_push = subprocess.run(  # the default folder, and the token from NANWATCH_TOKEN_FILE
            [sys.executable, "-m", "nanwatch.cli", "push", "--collector", c.url], capture_output=True, text=True,
            env={**{k: v for k, v in os.environ.items() if not k.startswith("NANWATCH_")},
                 "XDG_STATE_HOME": str(tmp_path / "state"), "NANWATCH_TOKEN_FILE": _token_file(tmp_path)},
            timeout=120)
        assert env_push.returncode == 0, env_push.stdout + env_push.stderr
        assert f"{len(produced)} applied" in env_push.stdout
        assert _sdpa_calls(c.url, "deaf-run") == 2 * steps


def _token_file(tmp_path: Path) -> str:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    return str(path)


@pytest.mark.parametrize("back_before_close", [True, False])
def test_collector_killed_and_restarted_holds_every_report_or_push_does(tmp_path, caplog, back_before_close):
    """Killed (SIGKILL) mid-run and restarted on its database: before the close (the sender's resends deliver
    all), or after it (what the trainer kept, ``nanwatch push`` delivers, after what it had delivered)."""
    model, produced = TinyNet(), []
    c = CollectorProcess(db_path=tmp_path / "c.db").start()
    try:
        with caplog.at_level(logging.INFO, logger="nanwatch.transport"):
            mon = _monitor(model, c.url, tmp_path / "logs", produced,
                           close_timeout=20.0 if back_before_close else 1.0)
            _train(mon, model, range(10))
            mon.last_report()
            c.kill()  # whatever is in flight gets no answer
            _train(mon, model, range(10, 20))
            if back_before_close:
                c.start()  # same port, same database
                _train(mon, model, range(20, 30))
            _returns(mon.close)
        steps = 30 if back_before_close else 20
        acc = _account(caplog)
        assert acc["submitted"] == len(produced) == steps + 1 and acc["lost"] == 0, acc["line"]
        assert acc["delivered"] + acc["kept"] == steps + 1, acc["line"]
        if not back_before_close:
            assert acc["kept"] >= 11, acc["line"]  # at least the steps after the kill and the final report
            c.start()
        if acc["kept"]:  # the trainer said which it kept: push delivers them
            pushed = _push(c.url, tmp_path / "logs" / "undelivered")
            assert pushed.returncode == 0, pushed.stdout + pushed.stderr
            applied, held = map(int, re.search(r"(\d+) applied, (\d+) already held", pushed.stdout).groups())
            assert applied + held == acc["kept"], pushed.stdout  # held: answered by the collector as it died
        assert _sdpa_calls(c.url, "undelivered-1") == 2 * steps  # every step, once
    finally:
        c.stop()


# ---- never through a link, never read unbounded (#37, findings 4, 5, 7) ---------------------------------

def _kept_file(folder: Path, name: str, run_id: str, seqs: range) -> Path:
    """A spool file as the writer leaves it: one StepReport a line."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = folder / name
    path.write_bytes(b"".join(step_report(run_id=run_id, seq=i, incarnation="inc1").model_dump_json().encode()
                              + b"\n" for i in seqs))
    return path


def test_push_never_writes_through_a_planted_tmp_link_nor_reads_a_planted_file(tmp_path):
    """A file sent in part (64 lines acknowledged, then a line that is no report): the rest is rewritten through
    a file push made itself, never through the ``<file>.tmp`` link someone planted beside it (finding 4); a
    ``*.jsonl`` link in the folder is named and skipped, its target neither read nor removed."""
    from nanwatch.cli.push import push

    folder = tmp_path / "undelivered" / run_folder_name("linked")
    path = _kept_file(folder, "rank0-inc1.jsonl", "linked", range(70))
    lines = path.read_bytes().splitlines()
    path.write_bytes(b"\n".join([*lines[:64], b"not a report", *lines[64:]]) + b"\n")
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (folder / "rank0-inc1.jsonl.tmp").symlink_to(victim)
    (folder / "rank1-inc1.jsonl").symlink_to(victim)
    out: list[str] = []
    with CollectorProcess(db_path=tmp_path / "c.db") as c:
        result = push([tmp_path / "undelivered"], c.url, token=None, out=out.append)
    assert victim.read_text() == "precious\n"  # neither written through nor removed
    assert (folder / "rank0-inc1.jsonl.tmp").is_symlink() and (folder / "rank1-inc1.jsonl").is_symlink()
    assert (result.applied, result.left) == (64, 7), (result, out)
    assert path.read_bytes().splitlines() == [b"not a report", *lines[64:]]  # what is left, in order
    assert not path.is_symlink() and (path.stat().st_mode & 0o777) == 0o600
    linked = [p for p in result.problems if "rank1-inc1.jsonl" in p]
    assert len(linked) == 1 and "symbolic link" in linked[0] and "skipped" in linked[0], result.problems
    assert not [p for p in folder.iterdir() if p.name.endswith(".tmp") and not p.is_symlink()]  # nothing left over


def _another_users(path: Path, monkeypatch) -> None:
    """``path`` belongs to someone else: chown'd to nobody when root, else this process claims another uid."""
    if os.getuid() == 0:
        os.chown(path, 65534, 65534)
    else:
        uid = os.getuid() + 1
        monkeypatch.setattr(os, "getuid", lambda: uid)


@pytest.mark.parametrize("planted", ["run_link", "root_link", "run_not_mine"])
def test_the_writer_refuses_a_planted_run_folder_says_so_once_and_counts_the_reports_lost(
        tmp_path, caplog, monkeypatch, planted):
    """A shared ``log_dir`` where someone planted the run folder (or ``undelivered``) as a link to another folder,
    or made it theirs: nothing is written there, one warning says why, every report is counted lost (finding 5)."""
    root = tmp_path / "logs" / "undelivered"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    if planted == "root_link":
        root.parent.mkdir()
        root.symlink_to(elsewhere, target_is_directory=True)
    else:
        root.mkdir(parents=True)
        run = root / run_folder_name("planted")
        if planted == "run_link":
            run.symlink_to(elsewhere, target_is_directory=True)
        else:
            run.mkdir()
            _another_users(run, monkeypatch)
    spool = Spool(root, run_id="planted", rank=0, incarnation="inc1")
    with caplog.at_level(logging.INFO, logger="nanwatch"), warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        sender = ReportSender(f"http://127.0.0.1:{free_port()}", spool=spool, backoff_base_s=0.05)
        for i in range(12):
            sender.submit(step_report(run_id="planted", seq=i, incarnation="inc1"))
        assert spool.keep([step_report(run_id="planted", seq=99, incarnation="inc1")]) == 0  # a second try
        sender.close(timeout_s=0.5)
    assert not list(elsewhere.iterdir())  # nothing written where the link points
    if planted != "root_link":
        assert not list(root.rglob("*.jsonl"))
    acc = _account(caplog)
    assert (acc["submitted"], acc["kept"], acc["lost"]) == (12, 0, 12), acc["line"]
    why = "owned by uid" if planted == "run_not_mine" else "symbolic link"
    assert why in acc["line"] and "refused" in acc["line"], acc["line"]
    said = [r.getMessage() for r in caplog.records if "undelivered reports not kept" in r.getMessage()]
    assert len(said) == 1 and why in said[0], said
    assert len([w for w in warned if "undelivered reports not kept" in str(w.message)]) == 1


def _push_bounded(url: str, *paths) -> subprocess.CompletedProcess:
    """``nanwatch push`` in a process whose address space is capped at 2 GiB: a file read whole past that is
    a MemoryError, never a machine out of memory."""
    code = ("import resource, sys\n"
            "resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))\n"
            "from nanwatch.cli import main\n"
            "sys.exit(main(sys.argv[1:]))\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("NANWATCH_")}
    return subprocess.run([sys.executable, "-c", code, "push", "--collector", url, *map(str, paths)],
                          capture_output=True, text=True, timeout=120, env=env)


def test_push_skips_an_oversize_sparse_file_names_it_and_sends_the_next(tmp_path):
    """A sparse 6 GiB ``.jsonl`` (no disk used) between two genuine spool files: skipped unread and named, and
    the genuine file after it is still sent (finding 7)."""
    folder = tmp_path / "undelivered" / run_folder_name("sparse")
    first = _kept_file(folder, "rank0-a.jsonl", "sparse", range(3))
    big = folder / "rank0-b.jsonl"
    with open(big, "wb") as f:
        f.truncate(6 << 30)
    last = _kept_file(folder, "rank0-c.jsonl", "sparse", range(3, 7))
    with CollectorProcess(db_path=tmp_path / "c.db") as c:
        p = _push_bounded(c.url, tmp_path / "undelivered")
    assert p.returncode == 1, p.stdout + p.stderr  # something is left: the oversize file
    assert "Traceback" not in p.stderr and "MemoryError" not in p.stderr, p.stderr
    assert "7 applied" in p.stdout, p.stdout + p.stderr
    named = [ln for ln in p.stderr.splitlines() if "rank0-b.jsonl" in ln]
    assert len(named) == 1 and "6,442,450,944 bytes" in named[0] and "skipped" in named[0], p.stderr
    assert not first.exists() and not last.exists() and big.stat().st_size == 6 << 30
