"""The store at its bounds and under faults (issue #19, findings 14-16 and the schema half of 17), each
against a real server on loopback: ``nanwatch serve`` in a child process, or the same uvicorn server in
this process where a fault must be injected into its store."""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

import httpx
import pytest
from support import JSON, CollectorProcess, background_collector, failing, scrape, step_report, wait_until

from nanwatch.monitor.data import schema
from nanwatch.monitor.data.schema import DB_SCHEMA_VERSION
from nanwatch.wire import MAX_INT, ReportBatch

SITE = "model.layers.1.self_attn"


def _batch(*reports) -> str:
    return ReportBatch(reports=list(reports)).model_dump_json()


def _post(url: str, *reports) -> httpx.Response:
    return httpx.post(f"{url}/v1/reports", content=_batch(*reports), headers=JSON, timeout=30)


def _half_nan(run_id: str, seq: int):
    """A report whose fp16 attention output is NaN: the default rules issue an fp32 directive."""
    return step_report(run_id=run_id, seq=seq, dtype="float16", nan_at=SITE, nan=3)






def _stored_total(db, run_id: str, family: str = "site") -> int:
    """The run's counter total as the file holds it, read exactly (not through a float)."""
    conn = sqlite3.connect(db)
    try:
        (value,) = conn.execute("SELECT value FROM counters WHERE run_id=? AND family=?", (run_id, family)).fetchone()
    finally:
        conn.close()
    return int(value) if isinstance(value, str) else value



# ---- finding 14: counters never saturate ----------------------------------------------------------------

def test_counters_keep_counting_past_2_53_in_memory_and_in_the_store(tmp_path):
    """Three +1 reports after 2^53-1 add 3: exact in the collector and its file (Prometheus shows float64,
    where 2^53+2 is exact, so the scrape shows it too), and after a restart the total keeps counting."""
    db = tmp_path / "c.db"
    with CollectorProcess(db_path=db) as c:
        assert _post(c.url, step_report(run_id="big", seq=0, nan_at=SITE, nan=MAX_INT)).status_code == 200
        for seq in (1, 2, 3):
            assert _post(c.url, step_report(run_id="big", seq=seq, nan_at=SITE, nan=1)).status_code == 200
        key = ("nanwatch_nonfinite_calls_total",
               frozenset({("run_id", "big"), ("rank", "0"), ("pass", "forward"), ("kind", "nan")}))
        assert scrape(c.url)[key] == float(2**53 + 2)
        assert _stored_total(db, "big") == 2**53 + 2
    with CollectorProcess(db_path=db) as c:  # read back exactly, and one more counts
        assert _post(c.url, step_report(run_id="big", seq=4, nan_at=SITE, nan=1)).status_code == 200
        assert _stored_total(db, "big") == 2**53 + 3


_V2_COUNTERS = """CREATE TABLE counters (
    run_id TEXT NOT NULL, family TEXT NOT NULL, labels TEXT NOT NULL, value REAL NOT NULL,
    PRIMARY KEY (run_id, family, labels))"""


def _upgraded(db: Path) -> sqlite3.Connection:
    """An old file of run "old" (seq 0 held, 5 NaN calls) opened by a collector: seq 0 resent is a duplicate
    (its marks came through), seq 1 is accepted; returns the file, at today's schema version."""
    with CollectorProcess(db_path=db) as c:
        resend = _post(c.url, step_report(run_id="old", seq=0, nan_at=SITE, nan=5))
        assert resend.json() == {"accepted": 0, "duplicates": 1}
        assert _post(c.url, step_report(run_id="old", seq=1, nan_at=SITE, nan=2)).status_code == 200
    conn = sqlite3.connect(db)
    assert conn.execute("PRAGMA user_version").fetchone() == (DB_SCHEMA_VERSION,)
    return conn


def test_a_schema_2_file_is_upgraded_in_place_and_keeps_its_totals(tmp_path):
    db = tmp_path / "v2.db"
    with CollectorProcess(db_path=db) as c:  # a file of today's tables, then its counters made as v2 had them
        assert _post(c.url, step_report(run_id="old", seq=0, nan_at=SITE, nan=5)).status_code == 200
    conn = sqlite3.connect(db)
    rows = conn.execute("SELECT run_id, family, labels, CAST(value AS REAL) FROM counters").fetchall()
    conn.executescript(f"DROP TABLE counters; {_V2_COUNTERS}; PRAGMA user_version=2;")
    conn.executemany("INSERT INTO counters VALUES (?,?,?,?)", rows)
    conn.commit()
    conn.close()
    conn = _upgraded(db)
    assert {t for (t,) in conn.execute("SELECT DISTINCT typeof(value) FROM counters")} == {"text"}
    conn.close()
    assert _stored_total(db, "old") == 7


def test_a_schema_3_file_gains_the_weight_syncs_table_and_keeps_its_rows(tmp_path):
    """Schema 3 (before the weight syncs were stored) to 4 in place: the table is added, nothing else moves."""
    db = tmp_path / "v3.db"
    with CollectorProcess(db_path=db) as c:
        assert _post(c.url, step_report(run_id="old", seq=0, nan_at=SITE, nan=5)).status_code == 200
    conn = sqlite3.connect(db)
    conn.executescript("DROP TABLE weight_syncs; PRAGMA user_version=3;")
    conn.close()
    conn = _upgraded(db)
    assert DB_SCHEMA_VERSION == 4
    assert schema.table_columns(conn, "weight_syncs") == schema.COLUMNS["weight_syncs"]
    conn.close()
    assert _stored_total(db, "old") == 7


# ---- finding 15: a failed write repairs what it touched; retention yields to the loop -------------------

def test_a_failed_write_rereads_only_the_runs_it_touched(tmp_path):
    with background_collector(tmp_path) as srv:
        for i in range(20):
            assert _post(srv.url, step_report(run_id=f"other-{i}", seq=0)).status_code == 200
        store = srv.app.state.resources.store
        real_load, read = store.load, []

        def spy(*args, **kwargs):
            loaded = real_load(*args, **kwargs)
            read.append({k[0] for k in loaded.hwm} | set(loaded.touched))
            return loaded

        store.load = spy
        with failing(store, "put_counters", sqlite3.OperationalError("database or disk is full")):
            assert _post(srv.url, _half_nan("victim", 0)).status_code == 503
        store.load = real_load
        assert read and all(runs <= {"victim"} for runs in read), read  # never the other 20 runs
        assert _post(srv.url, _half_nan("victim", 0)).json() == {"accepted": 1, "duplicates": 0}
        runs = {r["run_id"] for r in httpx.get(f"{srv.url}/v1/runs", timeout=30).json()["runs"]}
        assert runs >= {"victim", *(f"other-{i}" for i in range(20))}


def _big_run(db, run_id: str, events: int) -> None:
    """``run_id`` with ``events`` events, last written long ago (past any retention)."""
    conn = sqlite3.connect(db)
    conn.executemany("INSERT INTO events (run_id, time, kind, dedupe) VALUES (?,?,?,?)",
                     ((run_id, 0.0, "incident", f"e:{i}") for i in range(events)))
    conn.execute("INSERT OR REPLACE INTO runs VALUES (?,?)", (run_id, time.time() - 10**6))
    conn.commit()
    conn.close()


def _count(db, run_id: str) -> int:
    conn = sqlite3.connect(db, timeout=30)
    try:
        return conn.execute("SELECT COUNT(*) FROM events WHERE run_id=?", (run_id,)).fetchone()[0]
    finally:
        conn.close()


def test_retiring_a_big_run_yields_to_the_loop_between_batches(tmp_path):
    """The sweeper forgets a run of 100k events: /healthz is answered while the run is partly deleted
    (so the deletion went in batches, the loop serving between them), a report for that run sent meanwhile
    is refused (503, retry) or kept, never acknowledged and then deleted, and in the end nothing else of
    the run is left."""
    db, n = tmp_path / "c.db", 100_000
    with CollectorProcess(db_path=db):  # the schema
        pass
    _big_run(db, "big", n)
    env = {"NANWATCH_RUN_RETENTION_S": "3600", "NANWATCH_RANK_TTL_S": "8"}  # a sweep every 2 s
    with CollectorProcess(db_path=db, env=env) as c:
        seen, acked, seq = set(), [], 0
        deadline = time.monotonic() + 60
        while (left := _count(db, "big")) and time.monotonic() < deadline:
            assert httpx.get(f"{c.url}/healthz", timeout=30).status_code == 200
            seen.add(left)
            if left < n:  # the deletion has begun: a trainer reports to the run id now
                resp = _post(c.url, step_report(run_id="big", seq=seq))
                assert resp.status_code in (200, 503), resp.text
                if resp.status_code == 200:
                    acked.append(seq)
                seq += 1
        assert left == 0, "the run was never forgotten"
        assert any(0 < k < n for k in seen), sorted(seen)[:5]  # answered between batches
        if not acked:
            assert httpx.get(f"{c.url}/v1/runs/big", timeout=30).status_code == 404
    conn = sqlite3.connect(db)
    stored = conn.execute("SELECT MAX(seq) FROM hwm WHERE run_id='big'").fetchone()[0]
    conn.close()
    assert stored == (max(acked) if acked else None)  # what was acknowledged is kept


# ---- finding 16: a double fault leaks no version; versions never restart for a run id -------------------

def test_a_double_fault_never_answers_a_waiting_poll_with_an_uncommitted_version(tmp_path):
    """The COMMIT fails and re-reading the store fails too: a long-poll already waiting times out with the
    committed version (0), not the fp32 version the failed batch made in memory."""
    with background_collector(tmp_path) as srv:
        store = srv.app.state.resources.store
        polled: dict = {}
        poller = threading.Thread(target=lambda: polled.update(httpx.get(
            f"{srv.url}/v1/directives/dd", params={"index": 0, "wait": 3}, timeout=60).json()))
        poller.start()
        time.sleep(0.5)
        with failing(store, "put_counters", sqlite3.OperationalError("database or disk is full")), \
                failing(store, "load", sqlite3.OperationalError("disk I/O error")):
            assert _post(srv.url, _half_nan("dd", 0)).status_code == 503
            poller.join()
        assert polled.get("version") == 0, polled
        assert _post(srv.url, _half_nan("dd", 0)).json() == {"accepted": 1, "duplicates": 0}
        d = httpx.get(f"{srv.url}/v1/directives/dd", params={"wait": 0}, timeout=30).json()
        assert (d["version"], d["mode"]) == (1, "fp32")


def test_directive_versions_never_restart_for_a_run_id(tmp_path):
    """A run with directive version 3 is forgotten (retention), the collector restarts, and a poller holding
    index 3 for that run id is woken by the next directive, version 4, not a reused 1."""
    db = tmp_path / "c.db"
    with CollectorProcess(db_path=db, env={"NANWATCH_RUN_RETENTION_S": "1", "NANWATCH_RANK_TTL_S": "0.5"}) as c:
        for mode in ("fp32", "fused", "fp32"):
            d = httpx.put(f"{c.url}/v1/directives/v", json={"mode": mode}, timeout=30).json()
        assert d["version"] == 3
        wait_until(lambda: httpx.get(f"{c.url}/v1/runs/v", timeout=30).status_code == 404, "never forgotten")
    with CollectorProcess(db_path=db) as c:
        polled: dict = {}
        poller = threading.Thread(target=lambda: polled.update(httpx.get(
            f"{c.url}/v1/directives/v", params={"index": 3, "wait": 20}, timeout=60).json()))
        poller.start()
        time.sleep(0.5)
        d = httpx.put(f"{c.url}/v1/directives/v", json={"mode": "fused"}, timeout=30).json()
        poller.join()
        assert d["version"] == 4
        assert (polled["version"], polled["mode"]) == (4, "fused")


# ---- finding 17 (schema half): /readyz checks the schema is whole ---------------------------------------

@pytest.mark.parametrize("ddl,named", [("DROP TABLE runs", "table runs"),
                                       ("ALTER TABLE hwm DROP COLUMN step", "column hwm.step")])
def test_readyz_names_a_missing_table_or_column(tmp_path, ddl, named):
    db = tmp_path / "c.db"
    with CollectorProcess(db_path=db) as c:
        assert httpx.get(f"{c.url}/readyz", timeout=30).status_code == 200
        conn = sqlite3.connect(db, timeout=30)
        conn.execute(ddl)
        conn.commit()
        conn.close()
        resp = httpx.get(f"{c.url}/readyz", timeout=30)
        assert resp.status_code == 503 and named in resp.json()["detail"], resp.text


# ---- a restart on a full database holds what decides something, not every event's key --------------------

def test_a_restart_holds_no_event_keys_but_still_dedupes_against_the_store(tmp_path):
    """5,000 events of a run read back as counts, not as 5,000 keys in memory (a restart on a file at the
    caps held every key: the largest part of its peak), and an event recorded before the restart is still
    not recorded twice after it: the run's first offender stays the first."""
    db = tmp_path / "c.db"
    with background_collector(tmp_path) as srv:
        assert _post(srv.url, _half_nan("full", 0)).status_code == 200
    _big_run(db, "full", 5_000)
    with background_collector(tmp_path) as srv:
        state = srv.app.state.resources.state
        assert sum(len(run.event_keys) for run in state.runs.values()) < 10
        before = httpx.get(f"{srv.url}/v1/runs/full", timeout=30).json()["event_counts"]
        assert before["incident"] == 5_000 and before["first_nonfinite"] == 1
        assert _post(srv.url, _half_nan("full", 1)).json() == {"accepted": 1, "duplicates": 0}
        after = httpx.get(f"{srv.url}/v1/runs/full", timeout=30).json()["event_counts"]
        assert after["first_nonfinite"] == 1
