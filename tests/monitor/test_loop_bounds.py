"""Issue #19, the loop's slice: a client's input never holds the event loop or grows memory without bound
(findings 4, 5, 11, 13), each against a real server on loopback -- ``nanwatch serve`` in a child process
where memory is measured, the same uvicorn server in this process where the collector's parts are counted."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import socket
import threading
import time

import httpx
from support import AUTH, TOKEN, CollectorProcess, background_collector, scrape, step_report

from nanwatch.monitor.data.state import CollectorState
from nanwatch.monitor.read import exporter
from nanwatch.monitor.web.body import MAX_ERRORS
from nanwatch.monitor.write import exposure


def _vm_hwm_mib(pid: int) -> float:
    """Peak resident memory of a process (``VmHWM``), MiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")




def _empty_sites_body(n_bytes: int) -> bytes:
    """Reports whose sites are empty objects: about nine errors each (issue #19.4), ``n_bytes`` of them."""
    report = json.loads(step_report(run_id="errors", seq=0).model_dump_json())
    per_report = 4096
    reports = [{**report, "sites": [{}] * per_report} for _ in range(max(1, n_bytes // (3 * per_report)))]
    return json.dumps({"reports": reports}, separators=(",", ":")).encode()


# ---- 4. a many-error body costs its first errors, not all of them ------------------------------------

def test_a_body_of_empty_sites_is_refused_after_its_first_errors(tmp_path):
    """233 KB of empty site objects (700,000 errors) took 3 s of the loop and 800 MiB to answer; validation
    now stops at the first bad item, so the answer counts a few errors and memory stays flat."""
    body = _empty_sites_body(233_000)
    with CollectorProcess(db_path=tmp_path / "c.db", env={"NANWATCH_TOKEN": TOKEN}) as c:
        before = _vm_hwm_mib(c.proc.pid)
        for _ in range(3):
            resp = httpx.post(f"{c.url}/v1/reports", content=body, headers=AUTH, timeout=120)
            assert resp.status_code == 422, resp.text
            problem = resp.json()
            assert len(problem["detail"]) <= MAX_ERRORS
            assert problem["error_count"] <= 4 * MAX_ERRORS, problem["error_count"]
        grew = _vm_hwm_mib(c.proc.pid) - before
        assert grew < 100, f"peak RSS grew {grew:.0f} MiB answering three 233 KB bodies"
        ok = httpx.post(f"{c.url}/v1/reports", content=json.dumps(
            {"reports": [json.loads(step_report(run_id="errors", seq=0).model_dump_json())]}), headers=AUTH)
        assert ok.status_code == 200, ok.text


# ---- 5. /metrics: cached by the negotiated format, one snapshot serves every format --------------------

def _count_calls(monkeypatch, name: str) -> list:
    calls, real = [], getattr(exporter, name)

    def counted(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(exporter, name, counted)
    return calls


def test_forty_openmetrics_versions_cost_one_render(tmp_path, monkeypatch):
    """Every scraper naming its own OpenMetrics ``version=`` forced a render of its own (40 scrapers pushed
    Prometheus' scrape to 122 s); the cache is keyed by the negotiated format now, so however many versions
    are asked for, nothing changed means nothing is rendered again."""
    renders = _count_calls(monkeypatch, "render")
    with background_collector(tmp_path, token=TOKEN, metrics_min_interval_s=0) as srv:
        post = httpx.post(f"{srv.url}/v1/reports", headers=AUTH,
                          content=json.dumps({"reports": [json.loads(step_report(run_id="m", seq=0)
                                                                     .model_dump_json())]}))
        assert post.status_code == 200, post.text
        for accept in ("", "application/openmetrics-text; version=1.0.0") * 2:  # the born-at-zero renders
            httpx.get(f"{srv.url}/metrics", headers={"Authorization": f"Bearer {TOKEN}", "Accept": accept})
        renders.clear()
        for i in range(40):
            accept = f"application/openmetrics-text; version=1.{i}.0"
            resp = httpx.get(f"{srv.url}/metrics", headers={"Authorization": f"Bearer {TOKEN}", "Accept": accept})
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("application/openmetrics-text; version=1.0.0")
            assert resp.text.endswith("# EOF\n") and 'run_id="m"' in resp.text
        plain = httpx.get(f"{srv.url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
        assert plain.headers["content-type"].startswith("text/plain; version=0.0.4") and 'run_id="m"' in plain.text
    assert len(renders) <= 2, [a[1:] for a in renders]  # at most once per format


def test_scrapers_in_three_formats_share_one_snapshot(monkeypatch):
    """Three ordinary scrapers in three formats (text, OpenMetrics, gzipped text) after a write waited for
    three renders one interval apart; they now share the next snapshot, each format encoded once."""
    snapshots = _count_calls(monkeypatch, "snapshot")
    renders = _count_calls(monkeypatch, "render")
    state = CollectorState(ttl_s=300, series_cap=100)
    # no run: the snapshot never asks the directive log
    renderer = exporter.MetricsRenderer(state, None, exposure, logit_tau=100.0, min_interval_s=0.5)

    async def scrape_three() -> list:
        await renderer.render("", False)  # the interval starts here
        state.writes += 1
        return await asyncio.gather(renderer.render("", False), renderer.render(
            "application/openmetrics-text; version=1.0.0", False), renderer.render("", True))

    text, om, gz = asyncio.run(scrape_three())
    assert len(snapshots) == 2 and len(renders) == 3, (snapshots, renders)
    assert gzip.decompress(gz[0]) == text[0] and om[0].endswith(b"# EOF\n")


# ---- 13. a long-poll whose client leaves ends at once --------------------------------------------------

def _wait_until(check, deadline_s: float, what: str) -> None:
    deadline = time.monotonic() + deadline_s
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_abandoned_long_polls_end_when_their_clients_leave(tmp_path):
    """Closed ``wait=60`` polls stayed for their whole minute (19,697 of them held 571 MiB); each now ends as
    soon as its client has gone, and a poll that stays still gets its answer."""
    with background_collector(tmp_path, token=TOKEN, max_wait_s=60) as srv:
        polls = srv.app.state.resources.polls
        head = (f"GET /v1/directives/gone?wait=60 HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                f"Authorization: Bearer {TOKEN}\r\n\r\n").encode()
        socks = [socket.create_connection(("127.0.0.1", int(srv.url.rsplit(":", 1)[1]))) for _ in range(50)]
        for s in socks:
            s.sendall(head)
        _wait_until(lambda: polls.waiting() == 50, 60, f"{polls.waiting()} of 50 polls waiting")
        stayer = httpx.Client(timeout=30)
        with contextlib.closing(stayer):
            answer = {}
            t = threading.Thread(target=lambda: answer.update(resp=stayer.get(
                f"{srv.url}/v1/directives/gone", params={"wait": 5}, headers=AUTH)))
            t.start()
            _wait_until(lambda: polls.waiting() == 51, 60, "the staying poll never waited")
            for s in socks:
                s.close()
            _wait_until(lambda: polls.waiting() <= 1, 10, f"{polls.waiting()} polls still waiting after their "
                        "clients left")
            t.join(30)
            assert answer["resp"].status_code == 200 and answer["resp"].json()["version"] == 0


# ---- 11. a memory budget: above it nothing new is kept, what exists keeps moving ----------------------

def _post(url: str, *reports) -> httpx.Response:
    body = json.dumps({"reports": [json.loads(r.model_dump_json()) for r in reports]})
    return httpx.post(f"{url}/v1/reports", content=body, headers=AUTH, timeout=30)


def test_above_its_memory_limit_the_collector_takes_nothing_new(tmp_path):
    """Series, runs and incarnations grew without a global bound (1.28 M series in 46 s, 568 MiB). With a
    limit below what the process already holds, a known incarnation's reports still move its series, while
    a new run, a new incarnation (429, reason ``memory``) and a new site's series are refused, all counted."""
    db, layer = tmp_path / "c.db", "model.layers.{}.self_attn"
    env = {"NANWATCH_TOKEN": TOKEN}
    with CollectorProcess(db_path=db, env=env) as c:
        assert _post(c.url, step_report(run_id="kept", seq=0, nan_at=layer.format(1), nan=2)).status_code == 200
    with CollectorProcess(db_path=db, env={**env, "NANWATCH_MEMORY_LIMIT_MIB": "1"}) as c:
        known = _post(c.url, step_report(run_id="kept", seq=1, nan_at=layer.format(1), nan=3))
        assert known.status_code == 200, known.text
        new_site = _post(c.url, step_report(run_id="kept", seq=2, layers=6, nan_at=layer.format(5), nan=1))
        assert new_site.status_code == 200, new_site.text
        for refused in (step_report(run_id="newcomer", seq=0), step_report(run_id="kept", seq=0, incarnation="b")):
            resp = _post(c.url, refused)
            assert resp.status_code == 429 and "NANWATCH_MEMORY_LIMIT_MIB" in resp.text, resp.text
        s = scrape(c.url)
        site = "nanwatch_site_nonfinite_calls_total"
        assert s[(site, frozenset({("run_id", "kept"), ("site", layer.format(1)), ("pass", "forward")}))] == 5
        assert not [k for k in s if k[0] == site and ("site", layer.format(5)) in k[1]]
        assert s[("nanwatch_collector_series_dropped_total", frozenset({("run_id", "kept")}))] > 0
        assert s[("nanwatch_collector_caps_hit_total", frozenset({("cap", "memory")}))] >= 3
        assert s[("nanwatch_collector_requests_rejected_total", frozenset({("reason", "memory")}))] == 2
        assert httpx.get(f"{c.url}/v1/runs/newcomer", headers=AUTH).status_code == 404


def test_events_are_bounded_over_all_runs(tmp_path):
    """Events were bounded per run only (735 B of disk each: 619 MiB in 45 s over many runs); the collector
    keeps at most ``NANWATCH_MAX_EVENTS`` in all (the audit trail of directive changes aside), counting what
    it did not record."""
    import sqlite3

    db = tmp_path / "c.db"
    with CollectorProcess(db_path=db, env={"NANWATCH_TOKEN": TOKEN, "NANWATCH_MAX_EVENTS": "100"}) as c:
        for batch in range(3):
            reports = [step_report(run_id=f"ev-{batch}-{i}", seq=0, nan_at="model.layers.1.self_attn", nan=1)
                       for i in range(60)]
            assert _post(c.url, *reports).status_code == 200
        s = scrape(c.url)
        assert s[("nanwatch_collector_caps_hit_total", frozenset({("cap", "total_events")}))] >= 80
    with contextlib.closing(sqlite3.connect(db)) as con:
        kinds = dict(con.execute("SELECT kind, count(*) FROM events GROUP BY kind").fetchall())
    audit = kinds.pop("directive_set", 0)  # the rules' fp32 directives: the audit trail is always recorded
    assert sum(kinds.values()) <= 100 <= sum(kinds.values()) + audit, (kinds, audit)


def test_a_scrape_copies_many_runs_in_chunks_and_gives_the_loop_back_between_them():
    """A scrape of 9,000 live runs held the loop 0.4-0.5 s while it copied them (every trainer's ingest
    waited); now the copy yields every ``SNAPSHOT_CHUNK`` runs, and a run forgotten meanwhile is left out."""
    from nanwatch.monitor.data.directive_log import DirectiveLog
    from nanwatch.monitor.data.long_poll import LongPoll
    from nanwatch.monitor.data.state import CollectorState
    from nanwatch.monitor.read.exporter import SNAPSHOT_CHUNK, snapshot, snapshot_runs
    from nanwatch.monitor.write.lifetimes import ensure_run, forget

    state = CollectorState(ttl_s=300, series_cap=1000, max_runs=10 * SNAPSHOT_CHUNK)
    n = 3 * SNAPSHOT_CHUNK + 5
    for i in range(n):
        ensure_run(state, f"run-{i:05d}")
    log = DirectiveLog(polls=LongPoll())
    ticks = []

    async def main():
        async def ticker():
            while True:
                ticks.append(len(ticks))
                if len(ticks) == 2:  # the first chunk is copied: retention forgets a run not yet copied
                    forget(state, [f"run-{n - 1:05d}"])
                await asyncio.sleep(0)

        tick = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        try:
            return await snapshot_runs(state, log, exposure, late_s=90.0)
        finally:
            tick.cancel()

    runs = asyncio.run(main())
    assert len(ticks) >= 3, "the loop never ran while the runs were copied"
    assert [r.run_id for r in runs.runs] == [f"run-{i:05d}" for i in range(n - 1)]
    snap = snapshot(state, log, exposure, logit_tau=100.0, late_s=90.0, runs=runs)
    assert len(snap.runs) == n - 1


def test_an_8_mib_report_of_empty_arrays_costs_its_parse_not_a_copy_per_error(tmp_path):
    """One report of 2.7 million empty arrays under an unknown key and five missing fields: in JSON mode
    pydantic-core copied the whole report for each error (7 s of the loop, peak RSS +1.4 GiB); a body over
    FAST_PATH_BYTES is validated from ``json.loads`` output, where an error only points at its input."""
    body = b'{"reports":[{"x":[' + b",".join([b"[]"] * 2_700_000) + b"]}]}"
    with CollectorProcess(db_path=tmp_path / "c.db", env={"NANWATCH_TOKEN": TOKEN}) as c:
        before = _vm_hwm_mib(c.proc.pid)
        resp = httpx.post(f"{c.url}/v1/reports", content=body, headers=AUTH, timeout=300)
        assert resp.status_code == 422, resp.text[:300]
        assert resp.json()["error_count"] <= 4 * MAX_ERRORS
        grew = _vm_hwm_mib(c.proc.pid) - before
        assert grew < 600, f"peak RSS grew {grew:.0f} MiB answering one 7.7 MiB body"


def _bad_bodies() -> dict[str, dict]:
    report = json.loads(step_report(run_id="paths", seq=0, nan_at="model.layers.0.self_attn", nan=1).model_dump_json())
    site = report["sites"][0]
    return {
        "bool for an int": {**report, "seq": True},
        "string for a float": {**report, "sites": [{**site, "headroom": "0.5"}]},
        "float for an int": {**report, "step": 1.0},
        "unknown field": {**report, "surprise": 1},
        "missing field": {k: v for k, v in report.items() if k != "incarnation"},
        "another major": {**report, "v": "2.0"},
        "NaN headroom (valid)": {**report, "sites": [{**site, "headroom": float("nan")}]},
        "lone surrogate": {**report, "sites": [{**site, "site": "model.\ud800x"}]},
    }


def test_both_parse_paths_agree_on_strict_json():
    """A body over FAST_PATH_BYTES is validated from Python objects, a smaller one from bytes: the same bad
    report first gets the same answer either way (padded with valid reports past the threshold)."""
    from nanwatch.monitor.data.refusal import BadBody
    from nanwatch.monitor.web.body import FAST_PATH_BYTES, parse_batch

    pad = json.loads(step_report(run_id="paths", seq=1).model_dump_json())

    def answer(reports: list) -> tuple:
        raw = json.dumps({"reports": reports}, separators=(",", ":")).encode()  # NaN as the JSON constant
        try:
            return ("ok", len(parse_batch(raw).reports)), len(raw)
        except BadBody as e:
            detail = e.detail if isinstance(e.detail, str) else [(x["type"], x["loc"]) for x in e.detail[0]]
            return (e.status, e.reason, detail if e.status == 422 else None), len(raw)

    for name, bad in _bad_bodies().items():
        small, n_small = answer([bad])
        big, n_big = answer([bad] + [pad] * 200)
        assert n_small <= FAST_PATH_BYTES < n_big, name
        if small[0] == "ok":
            assert big == ("ok", 201), (name, big)
        else:
            assert small == big, (name, small, big)
