"""Metrics that add up over two real ``nanwatch serve`` replicas on one PostgreSQL database
(docs/replicas.md#metrics): the ranks of one run reporting through different replicas are each exported
once, by the run's exporter, with their own gauges (rank 0 through a, rank 1 through b); and a handover
to the other replica starts the new exporter's series where the old one's last scrape stood, so a NaN
committed after that scrape is the new series' first increase."""

import httpx
import pytest
from support import JSON, CollectorProcess, scrape, step_report, wait_until

from nanwatch.wire import ReportBatch

pytestmark = pytest.mark.slow
SITE = "model.layers.1.self_attn"
RUN = "ranks-apart"


def _post(url: str, *reports) -> None:
    body = ReportBatch(reports=list(reports)).model_dump_json()
    for _ in range(200):  # a replica behind the database's revision asks for a retry, as the trainer's sender does
        resp = httpx.post(f"{url}/v1/reports", content=body, headers=JSON)
        if resp.status_code != 503:
            break
    assert resp.status_code == 200, resp.text


def _summed(*urls: str) -> dict[tuple[str, frozenset], list[float]]:
    """Every sample of the replicas' scrapes, by (name, labels): the values each replica showed (a series
    shown by two replicas has two)."""
    out: dict[tuple[str, frozenset], list[float]] = {}
    for url in urls:
        for key, value in scrape(url).items():
            out.setdefault(key, []).append(value)
    return out


def _of(samples: dict, name: str, **labels: str) -> list[float]:
    return samples.get((name, frozenset({"run_id": RUN, **labels}.items())), [])


@pytest.fixture
def replicas(pg_url, tmp_path):
    env = {"NANWATCH_DATABASE_URL": pg_url, "NANWATCH_DATABASE_REFRESH_S": "0.2",
           "NANWATCH_METRICS_MIN_INTERVAL_S": "0"}
    with CollectorProcess(db_path=tmp_path / "a.db", env=env) as a, \
            CollectorProcess(db_path=tmp_path / "b.db", env=env) as b:
        yield a, b


def test_each_ranks_gauges_are_exported_once_whichever_replica_it_reports_to(replicas):
    a, b = replicas
    # rank 0 through a, rank 1 through b: rank 1 alone runs fused, at a higher logit bound, and dropped 3
    _post(a.url, step_report(run_id=RUN, rank=0, world_size=2, seq=0, step=0, logit=10.0))
    _post(b.url, step_report(run_id=RUN, rank=1, world_size=2, seq=0, step=0, logit=40.0, mode="fused", dropped=3))

    def settled() -> bool:
        s = _summed(a.url, b.url)
        return (len(_of(s, "nanwatch_attention_mode", rank="1", mode="fused")) == 1
                and len(_of(s, "nanwatch_attention_mode", rank="0", mode="none")) == 1)

    wait_until(settled, "both ranks' gauges in one replica's export")
    s = _summed(a.url, b.url)
    for rank in ("0", "1"):  # each rank exactly once over the two scrapes, with its own figures
        assert len(_of(s, "nanwatch_last_report_timestamp_seconds", rank=rank)) == 1, rank
        assert len(_of(s, "nanwatch_reports_dropped_total", rank=rank)) == 1, rank
    assert _of(s, "nanwatch_reports_dropped_total", rank="1") == [3]
    assert _of(s, "nanwatch_attention_mode", rank="1", mode="none") == []
    assert _of(s, "nanwatch_live_ranks") == [2]  # one exporter, counting the rank the other replica holds
    # the run-level gauges are over both ranks' views: rank 1's bound (40 + layer 3) is the max
    assert _of(s, "nanwatch_attention_logit_max", layer="model.layers.3.self_attn") == [43.0]
    # and a newer report of rank 1 through the exporter replaces the other replica's view of it
    exporter = a if _of(_summed(a.url), "nanwatch_live_ranks") else b
    _post(exporter.url, step_report(run_id=RUN, rank=1, world_size=2, seq=1, step=1, logit=40.0, mode="fp32"))
    wait_until(lambda: _of(_summed(a.url, b.url), "nanwatch_attention_mode", rank="1", mode="fp32") == [1],
               "rank 1's newest mode, once")
    assert _of(_summed(a.url, b.url), "nanwatch_attention_mode", rank="1", mode="fused") == []


def test_a_jobs_heartbeat_only_ranks_count_live_whichever_replica_they_reach(replicas):
    from nanwatch.bench.jobs import heartbeat, job_step

    a, b = replicas
    world = 4
    job, _details = job_step([step_report(run_id=RUN, rank=k, world_size=world, seq=1, step=1) for k in range(world)])
    _post(a.url, job)  # rank 0 posts the job's report through a; every rank beats, ranks 2 and 3 through b
    for k in range(world):
        _post((a, b)[k // 2].url, heartbeat(run_id=RUN, rank=k, world_size=world, seq=0, step=1))

    def live() -> list[float]:
        return _of(_summed(a.url, b.url), "nanwatch_live_ranks")

    wait_until(lambda: live() == [world], "one exporter counting the four ranks")
    s = _summed(a.url, b.url)
    assert _of(s, "nanwatch_run_world_size") == [world]
    # no heartbeat-only rank gets per-rank series it would not get on one collector (none is late)
    assert [k for (name, labels) in s if name == "nanwatch_last_report_timestamp_seconds"
            and ("run_id", RUN) in labels for k in [dict(labels)["rank"]]] == ["0"]


def _nan_total(url: str) -> float:
    return scrape(url, settled=False).get(("nanwatch_site_nonfinite_calls_total",
                                           frozenset({("run_id", RUN), ("site", SITE), ("pass", "forward")})), 0.0)


def test_a_handover_starts_the_new_series_where_the_last_scrape_stood(replicas):
    a, b = replicas
    nan = {"nan_at": SITE, "nan": 1, "dtype": "float32"}
    _post(a.url, step_report(run_id=RUN, rank=0, seq=0, step=0, **nan))
    _post(b.url, step_report(run_id=RUN, rank=1, seq=0, step=0, **nan))  # live on both
    wait_until(lambda: sorted((_nan_total(a.url), _nan_total(b.url))) == [0, 2], "one exporter showing 2")
    owner, other = (a, b) if _nan_total(a.url) else (b, a)
    # a NaN committed after the owner's last scrape, then the owner dies: nobody scraped the 3
    _post(other.url, step_report(run_id=RUN, rank=1, seq=1, step=1, **nan))
    owner.kill()
    # the new exporter's first sample is where the dead one's last scrape stood, its next the database's
    # total: increase() over its series sees the NaN (a series starting at 3 would hide it)
    first: list[float] = []

    def exported() -> bool:
        samples = scrape(other.url, settled=False)
        key = ("nanwatch_site_nonfinite_calls_total", frozenset({("run_id", RUN), ("site", SITE), ("pass", "forward")}))
        if key in samples:
            first.append(samples[key])
        return bool(first)

    wait_until(exported, "the other replica to export the run")
    assert first == [2]
    assert _nan_total(other.url) == 3
