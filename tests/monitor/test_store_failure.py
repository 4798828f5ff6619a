"""A failed SQLite commit loses nothing: 503, memory rolled back to the store, the retry applied once."""

import sqlite3

import httpx
from support import JSON, scrape, step_report

from nanwatch.monitor.server import BackgroundServer
from nanwatch.monitor.settings import Settings
from nanwatch.wire import ReportBatch


def test_a_failed_commit_is_a_503_and_the_retry_counts_once(tmp_path):
    settings = Settings(host="127.0.0.1", port=0, db_path=str(tmp_path / "c.db"), log_level="warning")
    with BackgroundServer(settings) as srv:
        store = srv.app.state.resources.store
        real_put = store.put_counters
        fail = {"left": 1}

        def flaky(rows):
            if fail["left"]:
                fail["left"] -= 1
                raise sqlite3.OperationalError("database or disk is full")
            return real_put(rows)

        store.put_counters = flaky
        body = ReportBatch(reports=[step_report(run_id="disk", seq=0, nan_at="model.layers.0.self_attn",
                                                nan=3)]).model_dump_json()
        first = httpx.post(srv.url + "/v1/reports", content=body, headers=JSON, timeout=10)
        assert first.status_code == 503 and "retry" in first.json()["detail"]
        assert first.headers["Retry-After"] == "1"
        second = httpx.post(srv.url + "/v1/reports", content=body, headers=JSON, timeout=10)  # the sender's retry
        assert second.status_code == 200 and second.json() == {"accepted": 1, "duplicates": 0}
        third = httpx.post(srv.url + "/v1/reports", content=body, headers=JSON, timeout=10)  # a genuine resend
        assert third.json() == {"accepted": 0, "duplicates": 1}
        s = scrape(srv.url)
    key = ("nanwatch_nonfinite_calls_total",
           frozenset({("run_id", "disk"), ("rank", "0"), ("pass", "forward"), ("kind", "nan")}))
    assert s[key] == 3.0
