"""A rank that stops reporting loses its series after the TTL, except its last report time (it is silent
without having ended: hung, and its stale-rank alert keeps firing); its totals come back with it."""

import time

import httpx
import pytest
from support import JSON, CollectorProcess, scrape, step_report

from nanwatch.wire import ReportBatch

pytestmark = pytest.mark.slow


def _post(url, *reports):
    assert httpx.post(f"{url}/v1/reports", content=ReportBatch(reports=list(reports)).model_dump_json(),
                      headers=JSON).status_code == 200


def _ranks(s, name: str = "nanwatch_last_report_timestamp_seconds") -> set[str]:
    return {dict(labels)["rank"] for n, labels in s if n == name}


def test_silent_rank_series_disappear_after_ttl(tmp_path):
    env = {"NANWATCH_RANK_TTL_S": "0.5"}
    with CollectorProcess(db_path=tmp_path / "ttl.db", env=env) as c:
        _post(c.url, step_report(run_id="ttl", rank=0, seq=0),
              step_report(run_id="ttl", rank=1, seq=0, nan_at="model.layers.0.self_attn", nan=4))
        assert _ranks(scrape(c.url)) == {"0", "1"}
        seq, deadline = 1, time.monotonic() + 30
        while "1" in _ranks(s := scrape(c.url), "nanwatch_attention_mode"):  # rank 0 reports, rank 1 is silent
            assert time.monotonic() < deadline, "rank 1's series never expired"
            _post(c.url, step_report(run_id="ttl", rank=0, seq=seq))
            seq += 1
            time.sleep(0.1)
        # per-rank series are gone but its last report time (#18: a hung rank keeps alerting); the run's
        # first-offender records (one series per run) still name rank 1
        assert not any(dict(labels).get("rank") == "1" for name, labels in s
                       if name not in ("nanwatch_first_offender_info", "nanwatch_latest_offender_info",
                                       "nanwatch_last_report_timestamp_seconds"))
        assert _ranks(s) == {"0", "1"}
        assert ("nanwatch_first_offender_info", frozenset({("run_id", "ttl"), ("site", "model.layers.0.self_attn"),
                                                           ("pass", "forward"), ("stage", "train"),
                                                           ("rank", "1")})) in s
        assert ("nanwatch_attention_mode", frozenset({("run_id", "ttl"), ("rank", "0"), ("mode", "none")})) in s
        # rank 1 comes back: its counter resumes from its total instead of resetting
        _post(c.url, step_report(run_id="ttl", rank=1, seq=1))
        key = ("nanwatch_nonfinite_calls_total",
               frozenset({("run_id", "ttl"), ("rank", "1"), ("pass", "forward"), ("kind", "nan")}))
        assert scrape(c.url)[key] == 4
