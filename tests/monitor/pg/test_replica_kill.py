"""kill -9 of one replica while reports of one run flow through both: nothing acknowledged is lost, nothing
is counted twice, and the other replica went on serving the run throughout (docs/replicas.md)."""


import httpx
import pytest
from support import JSON, CollectorProcess, step_report, wait_until

from nanwatch.hooks.report.transport import ReportSender
from nanwatch.wire import ReportBatch

pytestmark = pytest.mark.slow
SITE = "model.layers.1.self_attn"
N = 200  # reports per sender



def _run(url: str) -> dict:
    return httpx.get(f"{url}/v1/runs/kill").json()


def test_kill_9_of_one_replica_under_load_loses_nothing_acknowledged(pg_url, tmp_path):
    env = {"NANWATCH_DATABASE_URL": pg_url, "NANWATCH_DATABASE_REFRESH_S": "0.2"}
    # two ranks through each replica (a load balancer's split), one run
    reports = {side: [step_report(run_id="kill", rank=rank, seq=seq, step=seq, nan_at=SITE, nan=1, dtype="float32")
                      for seq in range(N // 2) for rank in ranks]
               for side, ranks in (("a", (0, 1)), ("b", (2, 3)))}
    a = CollectorProcess(db_path=tmp_path / "a.db", env=env).start()
    b = CollectorProcess(db_path=tmp_path / "b.db", env=env).start()
    to_a = ReportSender(a.url, max_queue=1024, batch_max=16, backoff_max_s=0.5)
    to_b = ReportSender(b.url, max_queue=1024, batch_max=16, backoff_max_s=0.5)
    restarted = None
    try:
        for r in reports["a"][:150]:
            assert to_a.submit(r)
        for r in reports["b"]:
            assert to_b.submit(r)
        wait_until(lambda: to_a.delivered >= 60, "a to acknowledge 60")
        a.kill()  # mid-flow: a's sender has batches in flight, b's is still delivering
        acknowledged = to_a.delivered
        assert all(to_a.submit(r) for r in reports["a"][150:])
        wait_until(lambda: to_b.delivered == N, "b to go on serving the run while a is dead")
        restarted = CollectorProcess(db_path=tmp_path / "a.db", port=a.port, env=env).start()  # its pod replaced
        wait_until(lambda: to_a.delivered == N, "the reports a's trainers held while it was dead")
        assert to_a.close(timeout_s=10) and to_b.close(timeout_s=10)
        assert to_a.dropped == to_b.dropped == 0
        # every report once, seen alike through both replicas
        wait_until(lambda: _run(b.url)["nonfinite_total"] == _run(restarted.url)["nonfinite_total"] == 2 * N,
              "both replicas to count every report once")
        # what a acknowledged before its death, resent to b: duplicates, all of them
        resend = ReportBatch(reports=reports["a"][:acknowledged]).model_dump_json()
        assert httpx.post(f"{b.url}/v1/reports", content=resend, headers=JSON).json() == \
            {"accepted": 0, "duplicates": acknowledged}
        assert _run(b.url)["nonfinite_total"] == 2 * N
    finally:
        to_a.close(timeout_s=0)
        to_b.close(timeout_s=0)
        for c in (a, b, restarted):
            if c is not None:
                c.stop()


def _exported(url: str) -> float:
    from support import scrape

    return scrape(url).get(("nanwatch_site_nonfinite_calls_total",
                            frozenset({("run_id", "lease"), ("site", SITE), ("pass", "forward")})), 0.0)


def test_a_runs_series_move_to_the_other_replica_when_its_exporter_is_killed(pg_url, tmp_path):
    env = {"NANWATCH_DATABASE_URL": pg_url, "NANWATCH_DATABASE_REFRESH_S": "0.2"}
    with CollectorProcess(db_path=tmp_path / "a.db", env=env) as a, \
            CollectorProcess(db_path=tmp_path / "b.db", env=env) as b:
        for rank, replica in ((0, a), (1, b)):  # the run is live on both
            body = ReportBatch(reports=[step_report(run_id="lease", rank=rank, seq=0, step=0, nan_at=SITE, nan=1,
                                                    dtype="float32")]).model_dump_json()
            assert httpx.post(f"{replica.url}/v1/reports", content=body, headers=JSON).status_code == 200
        wait_until(lambda: sorted((_exported(a.url), _exported(b.url))) == [0, 2], "one replica to export the run")
        owner, other = (a, b) if _exported(a.url) else (b, a)
        owner.kill()
        wait_until(lambda: _exported(other.url) == 2, "the other replica to take the run's lease and export it")
