"""The collector attacked as a hostile or unlucky client would (issue #11), each finding reproduced against
a real server on loopback: ``nanwatch serve`` in a child process, or the same uvicorn server in this
process where a fault must be injected into its store."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import sqlite3
import threading
import time

import httpx
import pytest
from support import ADMIN, JSON, TOKEN, CollectorProcess, background_collector, failing, scrape, step_report

from nanwatch.monitor.data.state import CollectorState
from nanwatch.monitor.read import exporter
from nanwatch.monitor.settings import Settings
from nanwatch.monitor.write import exposure
from nanwatch.wire import MAX_INT, Incident, ReportBatch

ADMIN_H = {"Authorization": f"Bearer {ADMIN}", **JSON}
INGEST_H = {"Authorization": f"Bearer {TOKEN}", **JSON}


def _batch(*reports) -> str:
    return ReportBatch(reports=list(reports)).model_dump_json()


def _half_nan(run_id: str, seq: int, **kw):
    """A report whose fp16 attention output is NaN: the default rules issue an fp32 directive."""
    return step_report(run_id=run_id, seq=seq, dtype="float16", nan_at="model.layers.1.self_attn", nan=3, **kw)






def _directive(url: str, run_id: str) -> dict:
    return httpx.get(f"{url}/v1/directives/{run_id}", params={"wait": 0}, timeout=10).json()


# ---- 1. memory never moves ahead of the store ----------------------------------------------------------

@pytest.mark.parametrize("exc,status", [(OverflowError("int too large to convert to float"), 422),
                                        (sqlite3.OperationalError("database or disk is full"), 503)])
def test_a_failed_ingest_changes_nothing_and_wakes_nobody(tmp_path, exc, status):
    """The batch would have issued a rule's fp32 directive: after the failure, memory, the database and a
    long-poller all agree that nothing happened, and the retry is applied once."""
    with background_collector(tmp_path) as srv:
        store = srv.app.state.resources.store
        polled: dict = {}
        poller = threading.Thread(target=lambda: polled.update(httpx.get(
            f"{srv.url}/v1/directives/ovf", params={"index": 0, "wait": 1.5}, timeout=10).json()))
        poller.start()
        time.sleep(0.3)
        with failing(store, "put_counters", exc):
            first = httpx.post(f"{srv.url}/v1/reports", content=_batch(_half_nan("ovf", 0)), headers=JSON)
        poller.join()
        assert first.status_code == status, first.text
        assert polled["version"] == 0  # the long-poller never saw the directive the failed batch made
        assert _directive(srv.url, "ovf")["version"] == 0
        assert not any(("run_id", "ovf") in labels for _, labels in scrape(srv.url))
        retry = httpx.post(f"{srv.url}/v1/reports", content=_batch(_half_nan("ovf", 0)), headers=JSON)
        assert retry.json() == {"accepted": 1, "duplicates": 0}
        d = _directive(srv.url, "ovf")
        assert (d["version"], d["mode"]) == (1, "fp32")
    with background_collector(tmp_path) as srv:  # and the store holds exactly that
        d = _directive(srv.url, "ovf")
        assert (d["version"], d["mode"]) == (1, "fp32")


@pytest.mark.parametrize("method", ["PUT", "DELETE"])
def test_a_directive_change_the_disk_refuses_is_a_503_and_never_served(tmp_path, method):
    with background_collector(tmp_path) as srv:
        res = srv.app.state.resources
        assert httpx.put(f"{srv.url}/v1/directives/d", json={"mode": "fused"}).json()["version"] == 1
        polled: dict = {}
        poller = threading.Thread(target=lambda: polled.update(httpx.get(
            f"{srv.url}/v1/directives/d", params={"index": 1, "wait": 1.5}, timeout=10).json()))
        poller.start()
        time.sleep(0.3)
        with failing(res.store, "put_directive", sqlite3.OperationalError("database or disk is full")):
            resp = httpx.request(method, f"{srv.url}/v1/directives/d", json={"mode": "fp32"} if method == "PUT" else None)
        poller.join()
        assert resp.status_code == 503 and resp.headers["Retry-After"] == "1", resp.text
        assert "nothing was applied" in resp.json()["detail"]
        assert (polled["version"], polled["mode"]) == (1, "fused")
        assert _directive(srv.url, "d")["version"] == 1
        assert httpx.put(f"{srv.url}/v1/directives/d", json={"mode": "fp32"}).json()["version"] == 2
    with background_collector(tmp_path) as srv:  # v2 is the fp32 that was acknowledged, not a reused number
        d = _directive(srv.url, "d")
        assert (d["version"], d["mode"]) == (2, "fp32")


def test_a_store_that_cannot_be_reread_after_a_failed_write_serves_nothing_until_it_can(tmp_path):
    """The failed batch issued an fp32 directive in memory, and the reload that should undo it fails too:
    until a reload succeeds, nothing is answered from that memory (503, /readyz not ready), then the
    retry is applied once and the directive is the committed one."""
    with background_collector(tmp_path) as srv:
        store = srv.app.state.resources.store
        full = sqlite3.OperationalError("database or disk is full")
        with failing(store, "put_counters", full), failing(store, "load", sqlite3.OperationalError("disk I/O error")):
            assert httpx.post(f"{srv.url}/v1/reports", content=_batch(_half_nan("rr", 0)),
                              headers=JSON).status_code == 503
            poll = httpx.get(f"{srv.url}/v1/directives/rr", params={"wait": 0})
            assert poll.status_code == 503 and poll.headers["Retry-After"] == "1", poll.text
            assert httpx.get(f"{srv.url}/metrics").status_code == 503
            assert httpx.get(f"{srv.url}/readyz").status_code == 503
        assert httpx.get(f"{srv.url}/readyz").status_code == 200  # re-read: memory is the store's again
        assert _directive(srv.url, "rr")["version"] == 0
        retry = httpx.post(f"{srv.url}/v1/reports", content=_batch(_half_nan("rr", 0)), headers=JSON)
        assert retry.json() == {"accepted": 1, "duplicates": 0}
        assert (_directive(srv.url, "rr")["version"], _directive(srv.url, "rr")["mode"]) == (1, "fp32")


def test_a_count_beyond_the_wire_bound_is_a_422(collector):
    body = _batch(step_report(run_id="huge", seq=0)).replace('"nan":0', '"nan":' + "1" + "0" * 400, 1)
    resp = httpx.post(f"{collector.url}/v1/reports", content=body, headers=INGEST_H)
    assert resp.status_code == 422 and resp.json()["error_count"] == 1, resp.text
    assert resp.json()["detail"][0]["loc"][-1] == "nan"


# ---- 2. /metrics: a reader token, and rendered off the event loop --------------------------------------

def test_metrics_needs_a_reader_token_and_the_metrics_token_reads_only(tmp_path):
    env = {"NANWATCH_TOKEN": TOKEN, "NANWATCH_ADMIN_TOKEN": ADMIN, "NANWATCH_METRICS_TOKEN": "prom-secret"}
    with CollectorProcess(db_path=tmp_path / "c.db", env=env) as c:
        assert httpx.get(f"{c.url}/metrics").status_code == 401
        for token in (TOKEN, ADMIN, "prom-secret"):
            resp = httpx.get(f"{c.url}/metrics", headers={"Authorization": f"Bearer {token}"})
            assert resp.status_code == 200 and "nanwatch_collector_reports_accepted_total" in resp.text
        prom = {"Authorization": "Bearer prom-secret", **JSON}
        assert httpx.post(f"{c.url}/v1/reports", content=_batch(step_report(run_id="m", seq=0)),
                          headers=prom).status_code == 403
        assert httpx.put(f"{c.url}/v1/directives/m", json={"mode": "fp32"}, headers=prom).status_code == 403
    with CollectorProcess(db_path=tmp_path / "d.db", env={**env, "NANWATCH_METRICS_PUBLIC": "true"}) as c:
        assert httpx.get(f"{c.url}/metrics").status_code == 200


def test_concurrent_scrapes_all_see_what_was_acknowledged_before_them(collector):
    """Scrapes share renders (at most one running, one queued), yet none misses a report acknowledged
    before it was sent."""
    for seq in range(3):
        body = _batch(step_report(run_id="scrapes", seq=seq, nan_at="model.layers.0.self_attn", nan=1))
        assert httpx.post(f"{collector.url}/v1/reports", content=body, headers=INGEST_H).status_code == 200
        results: list = []
        threads = [threading.Thread(target=lambda out=results: out.append(scrape(collector.url))) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        key = ("nanwatch_site_nonfinite_calls_total",
               frozenset({("run_id", "scrapes"), ("site", "model.layers.0.self_attn"), ("pass", "forward")}))
        assert [s[key] for s in results] == [seq + 1] * 6


def test_a_scrape_flood_costs_at_most_one_render_per_interval(monkeypatch):
    """Eight scrape loops and a write every millisecond for 1.2 s: every scrape after a change waits for
    the next render, renders start at least ``min_interval_s`` apart (0.2 s: at most 7 in 1.2 s, however
    fast or slow the machine), and the scrapers share them. A render starts on the event loop, with its
    snapshot (the formatting runs later, in a worker thread whose start a loaded machine can delay), so
    that is where the starts are counted; the spacing allows 20 ms of scheduling between the renderer's
    clock read and the snapshot."""
    renders, snapshot = [], exporter.snapshot

    def counted(*args, **kwargs):
        renders.append(time.monotonic())
        return snapshot(*args, **kwargs)

    monkeypatch.setattr(exporter, "snapshot", counted)
    state = CollectorState(ttl_s=300, series_cap=100)
    # no run: the snapshot never asks the directive log
    renderer = exporter.MetricsRenderer(state, None, exposure, logit_tau=100.0, min_interval_s=0.2)
    answered = []

    async def flood() -> None:
        loop = asyncio.get_running_loop()
        stop = loop.time() + 1.2

        async def scraper() -> None:
            while loop.time() < stop:
                body, _ = await renderer.render("", False)
                answered.append(body)
                await asyncio.sleep(0)  # as a real request would: a reused render returns without yielding

        async def writer() -> None:
            while loop.time() < stop:
                state.writes += 1
                await asyncio.sleep(0.001)

        await asyncio.gather(writer(), *(scraper() for _ in range(8)))

    asyncio.run(flood())
    assert 1 <= len(renders) <= 7, renders
    assert all(b - a >= 0.2 - 0.02 for a, b in zip(renders, renders[1:], strict=False)), renders
    assert len(answered) >= 8 * (len(renders) - 1)  # every loop got every render but perhaps the last


# ---- 3. request heads: a size limit and a time limit ---------------------------------------------------

def _recv_all(s: socket.socket) -> bytes:
    out = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := s.recv(65536):
            out += chunk
    return out


def test_an_oversized_head_gets_431_and_is_not_buffered(tmp_path):
    with CollectorProcess(db_path=tmp_path / "c.db", env={"NANWATCH_MAX_HEADER_BYTES": "16384"}) as c:
        s = socket.create_connection(("127.0.0.1", c.port))
        s.settimeout(10)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # cut off once over the limit
            s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: " + b"a" * (4 << 20))
        assert _recv_all(s).startswith(b"HTTP/1.1 431")
        s.close()
        assert httpx.get(f"{c.url}/healthz").status_code == 200


def test_a_half_sent_head_is_closed_after_the_header_timeout(tmp_path):
    with CollectorProcess(db_path=tmp_path / "c.db", env={"NANWATCH_HEADER_TIMEOUT_S": "1"}) as c:
        conns = []
        for _ in range(20):
            s = socket.create_connection(("127.0.0.1", c.port))
            s.sendall(b"POST /v1/reports HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            s.settimeout(15)
            conns.append(s)
        assert all(_recv_all(s) == b"" for s in conns)  # closed by the server, nothing answered
        for s in conns:
            s.close()
        assert httpx.get(f"{c.url}/healthz").status_code == 200


# ---- 4. a 422 lists the first 20 errors and how many -----------------------------------------------------

def test_a_body_of_thousands_of_bad_items_gets_a_short_answer(collector):
    r = json.loads(_batch(step_report(run_id="many", seq=0)))
    r["reports"][0]["sites"] = [{"bogus": i} for i in range(4000)]  # over the 4096-site bound on errors
    resp = httpx.post(f"{collector.url}/v1/reports", content=json.dumps(r), headers=INGEST_H)
    assert resp.status_code == 422
    body = resp.json()
    # validation stops at the first bad site (issue #19.4): its errors alone, not 4000 sites' worth
    assert 0 < len(body["detail"]) <= 20 and body["error_count"] <= 20 and len(resp.content) < 8192


# ---- 5. bodies: a deadline, and no slot taken before the body is in ------------------------------------

def test_a_body_that_never_finishes_gets_408(tmp_path):
    with CollectorProcess(db_path=tmp_path / "c.db", env={"NANWATCH_BODY_TIMEOUT_S": "1"}) as c:
        s = socket.create_connection(("127.0.0.1", c.port))
        s.settimeout(15)
        s.sendall(b"POST /v1/reports HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000\r\n\r\n{\"reports\": [")
        answer = _recv_all(s)
        s.close()
        assert answer.startswith(b"HTTP/1.1 408"), answer[:200]


# ---- 6. only the revert a directive allowed, by the rank that decides, ends it -------------------------

def _post(url: str, *reports, status: int = 200) -> None:
    resp = httpx.post(f"{url}/v1/reports", content=_batch(*reports), headers=INGEST_H)
    assert resp.status_code == status, resp.text


def _applied(run_id: str, seq: int, mode: str, version: int, **kw):
    return step_report(run_id=run_id, seq=seq, mode=mode, **kw).model_copy(update={"directive_version": version})


def test_an_ingest_token_cannot_cancel_an_operators_directive(collector):
    url = collector.url
    # an operator's fp32 without auto-revert: rank 0 reporting mode none does not end it
    assert httpx.put(f"{url}/v1/directives/op", json={"mode": "fp32"}, headers=ADMIN_H).json()["version"] == 1
    _post(url, _applied("op", 0, "fp32", 1))
    _post(url, _applied("op", 1, "none", 1))
    assert _directive_auth(url, "op")["version"] == 1
    # with auto-revert allowed: not by rank 1, not by a new incarnation of rank 0; rank 0 itself may
    assert httpx.put(f"{url}/v1/directives/ar", json={"mode": "fp32", "revert_after_clean_steps": 2},
                     headers=ADMIN_H).json()["version"] == 1
    two = {"world_size": 2}
    _post(url, _applied("ar", 0, "fp32", 1).model_copy(update=two),
          _applied("ar", 0, "fp32", 1, rank=1).model_copy(update=two))
    _post(url, _applied("ar", 1, "none", 1, rank=1).model_copy(update=two))
    _post(url, _applied("ar", 0, "none", 1, incarnation="restarted").model_copy(update=two))
    assert _directive_auth(url, "ar")["version"] == 1
    _post(url, _applied("ar", 1, "fp32", 1).model_copy(update=two))  # the real rank 0, still on fp32
    _post(url, _applied("ar", 2, "fp32", 1).model_copy(update=two))
    _post(url, _applied("ar", 3, "none", 1).model_copy(update=two))  # reverts after its 2 clean steps
    d = _directive_auth(url, "ar")
    assert (d["version"], d["mode"], d["set_by"]) == (2, "none", "trainer:auto-revert")
    # and a rank outside its world is refused outright
    body = _batch(step_report(run_id="ar", seq=0, rank=5)).replace('"world_size":6', '"world_size":2')
    resp = httpx.post(f"{url}/v1/reports", content=body, headers=INGEST_H)
    assert resp.status_code == 422 and "outside world_size" in resp.text


def _directive_auth(url: str, run_id: str) -> dict:
    return httpx.get(f"{url}/v1/directives/{run_id}", params={"wait": 0}, headers=INGEST_H).json()


# ---- 7. steps count per incarnation ---------------------------------------------------------------------

def test_a_huge_or_stale_step_does_not_push_directives_out_of_reach(tmp_path):
    with CollectorProcess(db_path=tmp_path / "c.db", env={"NANWATCH_RANK_TTL_S": "1"}) as c:
        _post_open(c.url, step_report(run_id="s", seq=0, step=MAX_INT))
        d = httpx.put(f"{c.url}/v1/directives/s", json={"mode": "fp32"}, headers=JSON).json()
        assert d["apply_at_step"] == MAX_INT  # within the schema's bound
        time.sleep(1.5)  # that rank goes silent; the job restarts from step 0 as a new incarnation
        _post_open(c.url, step_report(run_id="s", seq=0, step=3, incarnation="second"))
        d = httpx.put(f"{c.url}/v1/directives/s", json={"mode": "fused"}, headers=JSON).json()
        assert d["apply_at_step"] == 4
        c.stop()
        c.start()
        _post_open(c.url, step_report(run_id="s", seq=1, step=4, incarnation="second"))
        assert httpx.put(f"{c.url}/v1/directives/s", json={"mode": "fp32"}, headers=JSON).json()["apply_at_step"] == 5


def _post_open(url: str, *reports) -> None:
    assert httpx.post(f"{url}/v1/reports", content=_batch(*reports), headers=JSON).status_code == 200


# ---- 8. caps, counted, and retention ---------------------------------------------------------------------

def test_caps_refuse_new_runs_and_bound_events_and_are_counted(tmp_path):
    env = {"NANWATCH_MAX_RUNS": "2", "NANWATCH_MAX_EVENTS_PER_RUN": "10", "NANWATCH_MAX_INCARNATIONS_PER_RUN": "3"}
    with CollectorProcess(db_path=tmp_path / "c.db", env=env) as c:
        _post_open(c.url, step_report(run_id="r1", seq=0), step_report(run_id="r2", seq=0))
        resp = httpx.post(f"{c.url}/v1/reports", content=_batch(step_report(run_id="r3", seq=0)), headers=JSON)
        assert resp.status_code == 429 and "NANWATCH_MAX_RUNS" in resp.json()["detail"]
        assert httpx.put(f"{c.url}/v1/directives/r4", json={"mode": "fp32"}, headers=JSON).status_code == 429
        for rank, inc in ((1, "b"), (2, "c")):  # live pairs (a pair no longer live gives its place up)
            _post_open(c.url, step_report(run_id="r1", rank=rank, seq=0, incarnation=inc))
        resp = httpx.post(f"{c.url}/v1/reports", content=_batch(step_report(run_id="r1", rank=3, seq=0, incarnation="d")),
                          headers=JSON)
        assert resp.status_code == 429 and "INCARNATIONS" in resp.json()["detail"]
        for seq in range(1, 30):  # an incident per report, each its own event, were it not capped
            incident = Incident(cls="not_classified", step=seq, note="client-chosen")
            _post_open(c.url, step_report(run_id="r2", seq=seq, step=seq).model_copy(update={"incident": incident}))
        assert httpx.put(f"{c.url}/v1/directives/r2", json={"mode": "fp32"}, headers=JSON).status_code == 200
        run = httpx.get(f"{c.url}/v1/runs/r2").json()
        assert run["event_counts"] == {"incident": 10, "directive_set": 1}  # the audit trail is never dropped
        s = scrape(c.url)
        caps = {dict(labels)["cap"]: v for name, labels in s if name == "nanwatch_collector_caps_hit_total"
                for v in [s[(name, labels)]]}
        assert caps["runs"] == 2 and caps["incarnations"] == 1 and caps["events"] > 0


def test_a_run_past_retention_is_forgotten_everywhere(tmp_path):
    env = {"NANWATCH_RUN_RETENTION_S": "1", "NANWATCH_RANK_TTL_S": "0.5"}
    with CollectorProcess(db_path=tmp_path / "c.db", env=env) as c:
        _post_open(c.url, _half_nan("old", 0))
        assert httpx.get(f"{c.url}/v1/runs/old").status_code == 200
        deadline = time.monotonic() + 15
        while httpx.get(f"{c.url}/v1/runs/old").status_code != 404:
            assert time.monotonic() < deadline, "the run was never forgotten"
            time.sleep(0.2)
        assert not any(("run_id", "old") in labels for _, labels in scrape(c.url))
    db = sqlite3.connect(tmp_path / "c.db")
    for table in ("events", "directives", "hwm", "counters", "runs"):
        assert db.execute(f"SELECT COUNT(*) FROM {table} WHERE run_id='old'").fetchone() == (0,), table


# ---- 9. readiness is honest, and a foreign database is refused -------------------------------------------

def test_readyz_says_not_ready_while_the_store_refuses_writes(tmp_path):
    with background_collector(tmp_path) as srv:
        store = srv.app.state.resources.store
        assert httpx.get(f"{srv.url}/readyz").status_code == 200
        real = store._db

        class Full:  # the connection as a full disk shows it: reads work, writes fail
            def __getattr__(self, name):
                return getattr(real, name)

            def execute(self, sql, *args):
                if sql.lstrip().upper().startswith(("INSERT", "UPDATE", "DELETE", "COMMIT")):
                    raise sqlite3.OperationalError("database or disk is full")
                return real.execute(sql, *args)

        store._db = Full()
        try:
            resp = httpx.get(f"{srv.url}/readyz")
            assert resp.status_code == 503 and "disk is full" in resp.json()["detail"]
            assert httpx.post(f"{srv.url}/v1/reports", content=_batch(step_report(run_id="f", seq=0)),
                              headers=JSON).status_code == 503
        finally:
            store._db = real
        assert httpx.get(f"{srv.url}/readyz").status_code == 200


def test_a_foreign_database_is_refused_at_start(tmp_path, capsys):
    from nanwatch.cli import main

    db = tmp_path / "other.db"
    conn = sqlite3.connect(db)
    conn.execute("CREATE TABLE events (x INTEGER)")
    conn.commit()
    conn.close()
    assert main(["serve", "--db", str(db), "--port", "0"]) == 2
    assert "not a nanwatch collector database" in capsys.readouterr().err


# ---- 10. no secret in the log, no control character in a label, tokens are ASCII ------------------------

def test_a_token_in_the_query_string_is_not_logged(tmp_path):
    log = tmp_path / "c.log"
    with CollectorProcess(db_path=tmp_path / "c.db", env={"NANWATCH_LOG_LEVEL": "info"}, log_path=log) as c:
        httpx.get(f"{c.url}/healthz", params={"token": "s3cr3t-value", "x": "1"})
        time.sleep(0.3)
    text = log.read_text()
    # an allow-list (#19): x is no parameter of any route, so its value is not shown either
    assert "/healthz?token=<redacted>&x=<redacted>" in text and "s3cr3t-value" not in text


def test_a_dtype_with_control_characters_is_refused(collector):
    r = json.loads(_batch(step_report(run_id="ctl", seq=0)))
    r["reports"][0]["sdpa"][0]["dtype"] = "bfloat16\n# HELP fake"
    resp = httpx.post(f"{collector.url}/v1/reports", content=json.dumps(r), headers=INGEST_H)
    assert resp.status_code == 422 and resp.json()["detail"][0]["loc"][-1] == "dtype"


@pytest.mark.parametrize("char", ["\u0085", "\u202e", "\u2066", "\u200f", "\u2028"])
def test_a_site_name_with_a_c1_control_or_a_bidi_mark_is_refused(collector, char):
    """A site name becomes a label on a page and a dashboard: it must read as it is (#19: U+0085 and U+202E
    were accepted)."""
    r = json.loads(_batch(step_report(run_id="bidi", seq=0, nan_at="model.layers.0.self_attn", nan=1)))
    r["reports"][0]["sites"][0]["site"] = f"model.{char}nrettap"
    resp = httpx.post(f"{collector.url}/v1/reports", content=json.dumps(r), headers=INGEST_H)
    assert resp.status_code == 422 and resp.json()["detail"][0]["loc"][-1] == "site"
    assert httpx.get(f"{collector.url}/v1/runs/bidi", headers=INGEST_H).status_code == 404  # nothing applied


def test_tokens_must_be_visible_ascii():
    with pytest.raises(ValueError, match="visible ASCII"):
        Settings(token="pässwort").ingest_tokens()
    with pytest.raises(ValueError, match="visible ASCII"):
        Settings(admin_token="two words").admin_token_map()


# ---- 11. the tokenless loopback default: JSON only, loopback Host only ---------------------------------

def test_the_tokenless_default_refuses_cross_site_and_rebound_requests(tmp_path):
    with CollectorProcess(db_path=tmp_path / "c.db") as c:
        body = _batch(step_report(run_id="csrf", seq=0))
        plain = httpx.post(f"{c.url}/v1/reports", content=body, headers={"Content-Type": "text/plain"})
        assert plain.status_code == 415 and "application/json" in plain.json()["detail"]
        rebound = httpx.put(f"{c.url}/v1/directives/csrf", json={"mode": "skip_step"},
                            headers={"Host": "attacker.example:8000"})
        assert rebound.status_code == 400
        assert _directive(c.url, "csrf")["version"] == 0
        assert httpx.put(f"{c.url}/v1/directives/csrf", json={"mode": "fp32"},
                         headers={"Host": f"localhost:{c.port}"}).status_code == 200


# ---- what held before, kept under test -----------------------------------------------------------------

def test_deeply_nested_json_is_a_4xx(collector):
    body = '{"reports": ' + "[" * 100_000 + "]" * 100_000 + "}"
    resp = httpx.post(f"{collector.url}/v1/reports", content=body, headers=INGEST_H)
    assert resp.status_code in (400, 422), resp.text


def test_hundreds_of_long_polls_are_all_woken_by_one_change(collector):
    import asyncio

    async def main() -> list[int]:
        limits = httpx.Limits(max_connections=310)  # room for the PUT beside the 300 held polls
        async with httpx.AsyncClient(base_url=collector.url, headers=INGEST_H, timeout=30, limits=limits) as client:
            polls = [asyncio.create_task(client.get("/v1/directives/many-polls", params={"index": 0, "wait": 20}))
                     for _ in range(300)]
            await asyncio.sleep(1.0)
            put = await client.put("/v1/directives/many-polls", json={"mode": "fp32"}, headers=ADMIN_H)
            assert put.status_code == 200
            return [(await p).json()["version"] for p in polls]

    assert asyncio.run(main()) == [1] * 300
