"""The collector is SIGKILLed mid-run and restarted on the same SQLite file."""


import httpx
import pytest
from support import JSON, CollectorProcess, scrape, step_report, wait_until

from nanwatch.hooks.report.transport import ReportSender
from nanwatch.wire import ReportBatch

pytestmark = pytest.mark.slow
SITE = "model.layers.1.self_attn"



def _site_total(url: str) -> float:
    return scrape(url)[("nanwatch_site_nonfinite_calls_total",
                        frozenset({("run_id", "crash"), ("site", SITE), ("pass", "forward")}))]


def test_sigkill_and_restart_loses_nothing_and_counts_nothing_twice(tmp_path):
    db = tmp_path / "nanwatch.db"
    first = CollectorProcess(db_path=db).start()
    sender = ReportSender(first.url, max_queue=1024, batch_max=16, backoff_max_s=0.5)
    reports = [step_report(run_id="crash", rank=seq % 4, seq=seq // 4, step=seq // 4, nan_at=SITE, nan=1,
                           dtype="float32") for seq in range(400)]
    try:
        for r in reports[:100]:
            assert sender.submit(r)
        wait_until(lambda: sender.delivered == 100, "the first 100 reports")
        put = httpx.put(f"{first.url}/v1/directives/crash", json={"mode": "fused", "reason": "before the crash"})
        assert put.status_code == 200
        first.kill()

        # The training loop goes on while the collector is dead: every submit returns at once and fits
        # the queue. Reaching the next line before any restart is the proof that nothing blocked.
        assert all(sender.submit(r) for r in reports[100:])
        assert first.proc.poll() is not None and sender.dropped == 0

        second = CollectorProcess(db_path=db, port=first.port).start()
        try:
            wait_until(lambda: sender.delivered == 400, "the reports queued while the collector was down")
            assert sender.close(timeout_s=10) and sender.dropped == 0
            assert _site_total(second.url) == 400
            # a resend of reports applied before the crash is acknowledged, and not counted again
            resend = ReportBatch(reports=reports[:64]).model_dump_json()
            assert httpx.post(f"{second.url}/v1/reports", content=resend, headers=JSON).json() == {"accepted": 0, "duplicates": 64}
            assert _site_total(second.url) == 400
            s = scrape(second.url)
            for rank in range(4):
                assert s[("nanwatch_nonfinite_calls_total", frozenset(
                    {("run_id", "crash"), ("rank", str(rank)), ("pass", "forward"), ("kind", "nan")}))] == 100
            d = httpx.get(f"{second.url}/v1/directives/crash").json()
            assert (d["version"], d["mode"], d["reason"]) == (1, "fused", "before the crash")
            kinds = [e["kind"] for e in httpx.get(f"{second.url}/v1/runs/crash").json()["events"]]
            assert kinds.count("first_nonfinite") == 1 and kinds.count("directive_set") == 1
        finally:
            second.stop()
    finally:
        sender.close(timeout_s=0)
        first.stop()
