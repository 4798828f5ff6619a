"""A stateful property test of the collector's write paths under store faults (hypothesis
``RuleBasedStateMachine``, a real uvicorn server on loopback).

Reports are ingested, directives set and cleared, polled and long-polled, and the server restarted on the
same SQLite file, while faults are injected into the live ``Store``: a SQLite error in ``put_counters`` or
``put_hwm``, an ``OverflowError`` in ``put_counters`` (a value SQLite cannot hold: 422), a SQLite error in
``put_directive``, or a SQLite error at the transaction's COMMIT. A model of what was acknowledged is kept,
and after every step the collector must agree with it:

* no acknowledged write is lost (counters, events and directives, also after a restart),
* none is applied twice (a retry of a refused report is accepted exactly once, a resend is a duplicate),
* no unacknowledged directive is ever served (by a poll, a long-poll, or the scrape),
* nothing crosses namespaces: each run is owned by one team's scoped ingest token, and the other team's
  token, posting into it (a new report, a resend, or a seq = 2^53-1 takeover), polling or reading it, is
  refused and changes nothing the model can see.
"""

from __future__ import annotations

import shutil
import sqlite3
import tempfile
import threading
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from support import JSON, scrape, step_report

from nanwatch.monitor.data.state import CollectorState
from nanwatch.monitor.data.store import Store
from nanwatch.monitor.server import BackgroundServer
from nanwatch.monitor.settings import Settings
from nanwatch.monitor.write import lifetimes as run_writes
from nanwatch.monitor.write import memory_sync
from nanwatch.wire import MAX_INT, ReportBatch

RUNS = ("a", "b")
#: each run is its own team's namespace: a scoped ingest token per run (admin and reader stay open: loopback)
TEAM_TOKENS = {"a": "team-a-sm-secret", "b": "team-b-sm-secret"}
TEAM_SETTINGS = {f"team-{run}": {"token": tok, "runs": run} for run, tok in TEAM_TOKENS.items()}
#: Prometheus's reader token: a scoped team token may not scrape every namespace's series (#27)
READER = "reader-" + "r" * 32


def team(run: str, *, other: bool = False) -> dict[str, str]:
    """The headers of the team that owns ``run`` (``other``: of the team that does not)."""
    owner = next(r for r in RUNS if (r != run) == other)
    return {"Authorization": f"Bearer {TEAM_TOKENS[owner]}", **JSON}

RANKS = (0, 1)
LAYERS = 2
SITES = tuple(f"model.layers.{i}.self_attn" for i in range(LAYERS))
#: what the tokenless collector records as the actor of an admin change, and the rule that sets fp32 on a
#: non-finite value in a half-precision attention site (the default policy)
ANONYMOUS, RULE_ACTOR = "anonymous", "rule:half_attention_nonfinite"
#: "double": the COMMIT fails and re-reading the store fails too (until the next request); the long-polls
#: already waiting time out meanwhile, so a version that was never committed would be served to them
INGEST_FAULTS = ("none", "counters_sqlite", "hwm_sqlite", "counters_overflow", "commit", "double")
DIRECTIVE_FAULTS = ("none", "directive_sqlite", "commit", "double")
#: a write without a fault as often as one with (a refused write's retry must succeed to be checked)
ingest_faults = st.sampled_from(INGEST_FAULTS[:1] * 4 + INGEST_FAULTS[1:])
directive_faults = st.sampled_from(DIRECTIVE_FAULTS[:1] * 2 + DIRECTIVE_FAULTS[1:])
DISK_FULL = "database or disk is full"


class _FailCommitOnce:
    """Stands in for the store's connection: the first COMMIT raises as a full disk would, everything else
    goes to the real connection (so ``Store.transaction`` itself rolls back)."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db
        self.fired = False

    def execute(self, sql: str, *args):
        if not self.fired and sql.strip().upper() == "COMMIT":
            self.fired = True
            raise sqlite3.OperationalError(DISK_FULL)
        return self._db.execute(sql, *args)

    def __getattr__(self, name: str):
        return getattr(self._db, name)


def _raise_once(exc: Exception, counter: list[int]):
    def flaky(*_args, **_kwargs):
        counter.append(1)
        raise exc

    return flaky


@contextmanager
def injected(store: Store, fault: str):
    """``fault`` in ``store`` for one request; the real methods and connection are back afterwards. Yields
    a list that is non-empty once the fault fired."""
    fired: list[int] = []
    real_db = store._db
    if fault == "counters_sqlite":
        store.put_counters = _raise_once(sqlite3.OperationalError(DISK_FULL), fired)
    elif fault == "counters_overflow":
        store.put_counters = _raise_once(OverflowError("Python int too large to convert to SQLite INTEGER"), fired)
    elif fault == "hwm_sqlite":
        store.put_hwm = _raise_once(sqlite3.OperationalError(DISK_FULL), fired)
    elif fault == "directive_sqlite":
        store.put_directive = _raise_once(sqlite3.OperationalError(DISK_FULL), fired)
    elif fault in ("commit", "double"):
        proxy = store._db = _FailCommitOnce(real_db)
        if fault == "double":
            store.load = _raise_once(sqlite3.OperationalError("disk I/O error"), [])
    else:
        assert fault == "none", fault
    try:
        yield fired
    finally:
        for name in ("put_counters", "put_hwm", "put_directive", "load"):
            vars(store).pop(name, None)  # back to the class's method
        if fault in ("commit", "double"):
            store._db = real_db
            if proxy.fired:
                fired.append(1)


def _expected_status(fault: str) -> int:
    return {"none": 200, "counters_overflow": 422}.get(fault, 503)


@dataclass
class Sent:
    """One report as the sender built it: resent byte for byte."""

    run: str
    rank: int
    seq: int
    nan: int
    site: str
    body: bytes


@dataclass
class Poller:
    """A long-poll in flight on a thread."""

    run: str
    index: int
    thread: threading.Thread
    result: dict = field(default_factory=dict)


class CollectorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="nanwatch-sm-"))
        self.db_path = str(self.tmp / "c.db")
        self.srv: BackgroundServer | None = None
        self.http: httpx.Client | None = None
        # the model: what the collector acknowledged
        self.next_seq: dict[tuple[str, int], int] = {(r, k): 0 for r in RUNS for k in RANKS}
        self.acked: dict[tuple[str, int], list[Sent]] = {(r, k): [] for r in RUNS for k in RANKS}
        self.pending: dict[tuple[str, int], Sent | None] = {(r, k): None for r in RUNS for k in RANKS}
        self.directive: dict[str, tuple[int, str, str]] = {r: (0, "none", "") for r in RUNS}
        #: every acknowledged directive in full, by run and version (what a poller may be served); version 0
        #: (no directive yet) and the policy's versions are recorded when a poll first returns them
        self.history: dict[str, dict[int, dict]] = {r: {} for r in RUNS}
        self.events: dict[str, Counter[str]] = {r: Counter() for r in RUNS}
        self.half_sites: dict[str, set[str]] = {r: set() for r in RUNS}
        self.first: dict[str, tuple[str, int] | None] = {r: None for r in RUNS}
        #: ranks with a report applied since the collector last (re)loaded memory from the store: only
        #: these, and their runs, have series in the scrape (a reload makes the run it refused non-live)
        self.live: set[tuple[str, int]] = set()
        self.accepted_total = self.duplicate_total = 0
        self.pollers: list[Poller] = []
        self.attempt = 0
        #: a rule has started and its invariant check has not passed yet
        self.in_step = False
        try:
            self._start()
        except BaseException:
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise

    # -- the server ------------------------------------------------------------------------------------

    def _start(self) -> None:
        # No minimum interval between renders of /metrics (every step scrapes and would wait for it); a
        # render is still reused, while nothing changed.
        self.srv = BackgroundServer(Settings(host="127.0.0.1", port=0, db_path=self.db_path, log_level="warning",
                                             metrics_min_interval_s=0, tokens=TEAM_SETTINGS,
                                             metrics_token=READER))
        self.srv.__enter__()
        self.http = httpx.Client(base_url=self.srv.url, timeout=10)
        self.live.clear()
        self.accepted_total = self.duplicate_total = 0
        self.writes = 0  # write requests (acknowledged or refused) since the start

    def _stop(self) -> None:
        if self.http is not None:
            self.http.close()
            self.http = None
        if self.srv is not None:
            self.srv.__exit__(None, None, None)
            self.srv = None

    @property
    def store(self) -> Store:
        return self.srv.app.state.resources.store

    def teardown(self) -> None:
        failing = self.in_step  # a step failed: that is the report, not what follows
        try:
            self._stop()  # answers the long-polls still waiting
            for p in self.pollers:
                p.thread.join(timeout=15)
            if not failing:
                self._check_pollers(finished_only=False)
                self._start()  # every example ends with a restart: all it acknowledged was persisted
                self.agrees_with_the_model()
        finally:
            self._stop()
            shutil.rmtree(self.tmp, ignore_errors=True)

    # -- the model's effects ---------------------------------------------------------------------------

    def _failed(self, run: str) -> None:
        """A write to ``run`` was refused: nothing changed, and the collector reloaded memory from the store,
        which takes that run's per-rank views (other runs keep theirs)."""
        self.live = {(r, k) for r, k in self.live if r != run}

    def _new_version(self, run: str, mode: str, set_by: str) -> None:
        version = self.directive[run][0] + 1
        self.directive[run] = (version, mode, set_by)
        self.events[run]["directive_cleared" if mode == "none" else "directive_set"] += 1

    def _applied(self, r: Sent) -> None:
        self.acked[(r.run, r.rank)].append(r)
        self.live.add((r.run, r.rank))
        if r.nan:
            if self.first[r.run] is None:
                self.first[r.run] = (r.site, r.rank)
                self.events[r.run]["first_nonfinite"] += 1
            if r.site not in self.half_sites[r.run]:
                self.half_sites[r.run].add(r.site)
                self.events[r.run]["half_attention_nonfinite"] += 1
            if self.directive[r.run][1] == "none":
                self._new_version(r.run, "fp32", RULE_ACTOR)

    # -- rules -----------------------------------------------------------------------------------------

    @rule(run=st.sampled_from(RUNS), rank=st.sampled_from(RANKS),
          how=st.sampled_from(["next", "next", "resend", "resend", "abandon"]), pick=st.integers(0, 7),
          nan=st.sampled_from([0, 0, 1, 3]), site=st.sampled_from(SITES), fault=ingest_faults,
          retry_now=st.booleans())
    def ingest(self, run, rank, how, pick, nan, site, fault, retry_now):
        """Send one report: the refused one again if there is one ("next"), a new one, or a resend of one
        that was acknowledged. "abandon" gives a refused report up and sends the next seq instead. A
        refused report is retried at once (``retry_now``), or later (the ``retry`` rule)."""
        self.in_step = True
        self._send((run, rank), how, pick, nan, site, fault)
        if retry_now and self.pending[(run, rank)] is not None:
            self._send((run, rank), "next", 0, 0, SITES[0], "none")

    @precondition(lambda self: any(self.pending.values()))
    @rule(pick=st.integers(0, 3), fault=ingest_faults)
    def retry(self, pick, fault):
        """The sender retries a refused report (of one of the ranks that hold one)."""
        self.in_step = True
        keys = [k for k, r in self.pending.items() if r is not None]
        self._send(keys[pick % len(keys)], "next", 0, 0, SITES[0], fault)

    def _send(self, key: tuple[str, int], how: str, pick: int, nan: int, site: str, fault: str) -> None:
        run, rank = key
        acked = self.acked[key]
        if how == "resend" and acked:
            report, resend = acked[pick % len(acked)], True
        else:
            resend = False
            report = self.pending[key] if how == "next" else None
            if report is None:
                seq = self.next_seq[key]
                self.next_seq[key] = seq + 1
                body = ReportBatch(reports=[step_report(
                    run_id=run, rank=rank, seq=seq, layers=LAYERS, nan_at=site if nan else None, nan=nan,
                    time_s=1.7e9 + seq)]).model_dump_json().encode()
                report = Sent(run, rank, seq, nan, site, body)
        self.writes += 1
        with injected(self.store, fault) as fired:
            resp = self.http.post("/v1/reports", content=report.body, headers=team(run))
            self._outwait(fault)
        assert fired or fault == "none", f"fault {fault} never fired"
        assert resp.status_code == _expected_status(fault), (fault, resp.status_code, resp.text)
        if resp.status_code != 200:
            self._failed(run)
            if not resend:
                self.pending[key] = report  # the sender keeps it to retry; the collector holds nothing of it
            return
        if resend:
            assert resp.json() == {"accepted": 0, "duplicates": 1}, f"a resend of seq {report.seq} was applied again"
            self.duplicate_total += 1
            return
        assert resp.json() == {"accepted": 1, "duplicates": 0}, (
            f"seq {report.seq} of {key} (never acknowledged) was not applied: {resp.json()}")
        self.pending[key] = None
        self.accepted_total += 1
        self._applied(report)

    @rule(run=st.sampled_from(RUNS), mode=st.sampled_from(["fp32", "fused", "none", "delete"]),
          fault=directive_faults, long_poll=st.booleans())
    def set_directive(self, run, mode, fault, long_poll):
        """PUT a new directive (or DELETE: mode none), with a long-poll waiting on the current version."""
        self.in_step = True
        version = self.directive[run][0]
        if long_poll:
            self._start_poller(run, version)
        self.attempt += 1
        reason = f"attempt {self.attempt}"
        self.writes += 1
        with injected(self.store, fault) as fired:
            if mode == "delete":
                resp = self.http.delete(f"/v1/directives/{run}")
            else:
                resp = self.http.put(f"/v1/directives/{run}", json={"mode": mode, "reason": reason}, headers=JSON)
            self._outwait(fault)
        assert fired or fault == "none", f"fault {fault} never fired"
        assert resp.status_code == _expected_status(fault), (fault, resp.status_code, resp.text)
        if resp.status_code != 200:
            self._failed(run)
            return
        d = resp.json()
        mode = "none" if mode == "delete" else mode
        assert (d["run_id"], d["version"], d["mode"], d["set_by"]) == (run, version + 1, mode, ANONYMOUS), d
        assert d["reason"] == ("cleared" if resp.request.method == "DELETE" else reason), d
        self._new_version(run, mode, ANONYMOUS)
        self._record(run, d)

    @rule(run=st.sampled_from(RUNS), ahead=st.booleans())
    def poll(self, run, ahead):
        """A trainer's poll: at its version (it has it) or ahead of it, answered at once or after a short
        wait, always with the acknowledged directive."""
        self.in_step = True
        version = self.directive[run][0]
        index, wait = (version + 1, 0.05) if ahead else (0, 0)
        resp = self.http.get(f"/v1/directives/{run}", params={"index": index, "wait": wait}, headers=team(run))
        assert resp.status_code == 200, resp.text
        self._check_directive(run, resp.json())

    @rule(run=st.sampled_from(RUNS), rank=st.sampled_from(RANKS),
          how=st.sampled_from(["next", "resend", "takeover", "poll", "read", "list"]), pick=st.integers(0, 7))
    def trespass(self, run, rank, how, pick):
        """The other team's token goes for ``run``: posts the owner's next report, a resend of an
        acknowledged one, or seq = 2^53-1 for the owner's incarnation (which would make every later report
        a duplicate); polls its directive, reads it, or lists runs. Refused, and nothing changes: the
        invariants and the owner's later reports (accepted, never duplicates) say so."""
        self.in_step = True
        other = team(run, other=True)
        if how in ("next", "resend", "takeover"):
            acked = self.acked[(run, rank)]
            seq = {"next": self.next_seq[(run, rank)], "takeover": MAX_INT}.get(how)
            if seq is None:
                seq = acked[pick % len(acked)].seq if acked else 0
            body = ReportBatch(reports=[step_report(run_id=run, rank=rank, seq=seq, layers=LAYERS, nan_at=SITES[0],
                                                    nan=1)]).model_dump_json()
            resp = self.http.post("/v1/reports", content=body, headers=other)
            assert resp.status_code == 403, (how, resp.status_code, resp.text)
        elif how == "poll":
            resp = self.http.get(f"/v1/directives/{run}", params={"index": 0, "wait": 0}, headers=other)
            assert resp.status_code == 404, resp.text
        elif how == "read":
            resp = self.http.get(f"/v1/runs/{run}", headers=other)
            assert resp.status_code == 404, resp.text
        else:
            resp = self.http.get("/v1/runs", headers=other)
            assert resp.status_code == 200 and run not in {r["run_id"] for r in resp.json()["runs"]}, resp.text

    @precondition(lambda self: self.writes >= 2)
    @rule()
    def restart(self):
        """Stop the collector and start a new one on the same file: everything acknowledged is there.
        (Only after a few writes: restarting an unchanged collector tests nothing new, and a restart costs
        more than all the other steps of an example together.)"""
        self.in_step = True
        self._stop()
        self._start()

    # -- long-polls ------------------------------------------------------------------------------------

    def _start_poller(self, run: str, index: int) -> None:
        url = f"{self.srv.url}/v1/directives/{run}"
        polls = self.srv.app.state.resources.polls
        waiting_before = polls._waiting.get(run, 0)

        def wait(p: Poller) -> None:
            t0 = time.monotonic()
            try:
                r = httpx.get(url, params={"index": index, "wait": 2}, headers=team(run), timeout=15)
                p.result.update(status=r.status_code, body=r.json() if r.status_code == 200 else r.text)
            except Exception as e:  # noqa: BLE001 - reported by the check
                p.result.update(error=repr(e))
            p.result["elapsed"] = time.monotonic() - t0

        p = Poller(run, index, threading.Thread(target=lambda: wait(p), daemon=True))
        p.thread.start()
        self.pollers.append(p)
        deadline = time.monotonic() + 5
        while polls._waiting.get(run, 0) <= waiting_before:  # parked in the collector before the write
            if not p.thread.is_alive() or time.monotonic() > deadline:
                break  # what it got is checked with the others
            time.sleep(0.002)

    def _outwait(self, fault: str) -> None:
        """Under a double fault, let the waiting long-polls time out while the store cannot be re-read."""
        if fault == "double":
            for p in self.pollers:
                p.thread.join(15)

    def _check_pollers(self, *, finished_only: bool = True) -> None:
        left = []
        for p in self.pollers:
            if finished_only and p.thread.is_alive():
                left.append(p)
                continue
            assert not p.thread.is_alive(), "a long-poll never came back"
            assert "error" not in p.result and p.result.get("status") == 200, p.result
            d = p.result["body"]
            assert d["version"] >= p.index, (p.index, d)
            known = self.history[p.run].get(d["version"])
            assert known == d, (f"a long-poll at index {p.index} of run {p.run!r} was served a directive that "
                                f"was never acknowledged: {d}; acknowledged: {known}")
        self.pollers = left

    # -- invariants ------------------------------------------------------------------------------------

    def _record(self, run: str, d: dict) -> None:
        known = self.history[run].setdefault(d["version"], d)
        assert known == d, f"version {d['version']} of {run!r} changed: {known} -> {d}"

    def _check_directive(self, run: str, d: dict) -> None:
        version, mode, set_by = self.directive[run]
        assert (d["run_id"], d["version"], d["mode"], d["set_by"]) == (run, version, mode, set_by), (
            f"served {d}, the acknowledged directive is version {version} mode {mode!r} by {set_by!r}")
        self._record(run, d)  # a rule's directive is first seen here; any other must match its PUT's answer

    @invariant()
    def agrees_with_the_model(self):
        for run in RUNS:
            resp = self.http.get(f"/v1/directives/{run}", params={"index": 0, "wait": 0}, headers=team(run))
            assert resp.status_code == 200, resp.text
            self._check_directive(run, resp.json())
        s = scrape(self.srv.url, READER)
        assert s[("nanwatch_collector_reports_accepted_total", frozenset())] == self.accepted_total
        assert s[("nanwatch_collector_reports_duplicate_total", frozenset())] == self.duplicate_total
        assert {dict(k[1]).get("run_id") for k in s} <= {None, *RUNS}
        for run in RUNS:
            self._check_run_series(run, s)
        self._check_pollers()  # after the GETs above: they record the versions the policy's rule made
        self.in_step = False

    def _check_run_series(self, run: str, s: dict) -> None:
        def series(name: str) -> dict[frozenset, float]:
            return {labels: v for (n, labels), v in s.items() if n == name and ("run_id", run) in labels}

        events = {dict(k)["kind"]: v for k, v in series("nanwatch_events_total").items()}
        assert events == {k: float(v) for k, v in self.events[run].items() if v}, (run, events, self.events[run])

        reports = [r for k in RANKS for r in self.acked[(run, k)]]
        live = any((run, k) in self.live for k in RANKS)
        want_sites = {}
        if live:
            for site in SITES:
                n = sum(r.nan for r in reports if r.site == site)
                if n:
                    want_sites[frozenset({("run_id", run), ("site", site), ("pass", "forward")})] = float(n)
        assert series("nanwatch_site_nonfinite_calls_total") == want_sites, (
            f"run {run!r}: per-site counters differ from the acknowledged reports (live={live})")

        got_ranks = {dict(k)["rank"]: v for k, v in series("nanwatch_nonfinite_calls_total").items()
                     if ("pass", "forward") in k and ("kind", "nan") in k}
        want_ranks = {str(k): float(sum(r.nan for r in self.acked[(run, k)])) for k in RANKS if (run, k) in self.live}
        assert got_ranks == want_ranks, f"run {run!r}: per-rank counters differ from the acknowledged reports"

        version, mode, _ = self.directive[run]
        want_info = {frozenset({("run_id", run), ("mode", mode), ("version", str(version))}): 1.0} if live else {}
        assert series("nanwatch_directive_info") == want_info, f"run {run!r}: the scrape's directive is not the model's"

        first = self.first[run]
        got_first = [dict(k) for k in series("nanwatch_first_offender_info")]
        want_first = ([{"run_id": run, "site": first[0], "pass": "forward", "stage": "train", "rank": str(first[1])}]
                      if live and first else [])
        assert got_first == want_first, f"run {run!r}: first offender {got_first}, acknowledged {want_first}"


CollectorMachine.TestCase.settings = settings(max_examples=25, stateful_step_count=12, deadline=None,
                                              suppress_health_check=[HealthCheck.too_slow])
#: ~20 s on two cores, most of it uvicorn starting and stopping (each example, and each restart)
TestCollectorWrites = pytest.mark.slow(CollectorMachine.TestCase)


def _keep_hwm(reload):
    def sabotaged(state: CollectorState, loaded, **kw) -> None:
        hwm = dict(state.hwm)
        reload(state, loaded, **kw)
        state.hwm = hwm  # a rolled-back report's high-water mark survives the reload

    return sabotaged


@pytest.mark.parametrize("sabotage", ["no reload", "hwm kept"])
def test_the_machine_catches_a_collector_that_keeps_a_failed_write(monkeypatch, sabotage):
    """The properties can fail. A collector that does not reload memory after a rolled-back write (its
    memory then disagrees with what was acknowledged, somewhere), or that keeps a refused report's
    high-water mark (its retry is then a duplicate: lost). Deterministic (derandomized, no shrinking), a
    few seconds each."""
    if sabotage == "no reload":
        monkeypatch.setattr(memory_sync.MemorySync, "restore", lambda self, runs, marks, **kw: None)
        match = None
    else:
        monkeypatch.setattr(memory_sync, "reload", _keep_hwm(run_writes.reload))
        match = r"never acknowledged\) was not applied"
    quick = settings(max_examples=50, stateful_step_count=12, deadline=None, database=None, derandomize=True,
                     phases=[Phase.generate], report_multiple_bugs=False, suppress_health_check=[HealthCheck.too_slow])
    with pytest.raises(AssertionError, match=match):
        run_state_machine_as_test(CollectorMachine, settings=quick)
