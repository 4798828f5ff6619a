"""Every kind of held state has a per-namespace bound (#37 finding 3): one team at its bound is refused and
counted (``nanwatch_collector_caps_hit_total{cap}``), and another team's new runs, ranks, events and
counters are untouched. Against a real ``nanwatch serve`` on loopback with two scoped tokens, the bounds made
small through the environment."""

from __future__ import annotations

import json

import httpx
import pytest
from support import ADMIN, JSON, CollectorProcess, sample, scrape, step_report

from nanwatch.wire import ReportBatch

TEAM_A, TEAM_B, READER = "team-a-secret", "team-b-secret", "reader-secret"
A_H = {"Authorization": f"Bearer {TEAM_A}", **JSON}
B_H = {"Authorization": f"Bearer {TEAM_B}", **JSON}
SITE = "model.layers.1.self_attn"
PAIRS, EVENTS = 32, 10
#: weight-sync bounds: 1 MiB of sets and 6 versions a namespace
WEIGHT_MIB, WEIGHT_VERSIONS = 1, 6


@pytest.fixture(scope="module")
def teams(tmp_path_factory):
    tokens = {"team-a": {"token": TEAM_A, "runs": "team-a-*"}, "team-b": {"token": TEAM_B, "runs": "team-b-*"}}
    env = {"NANWATCH_TOKENS": json.dumps(tokens), "NANWATCH_ADMIN_TOKENS": json.dumps({"alice": ADMIN}),
           "NANWATCH_METRICS_TOKEN": READER, "NANWATCH_MAX_INCARNATIONS_PER_NAMESPACE": str(PAIRS),
           "NANWATCH_MAX_EVENTS_PER_NAMESPACE": str(EVENTS),
           "NANWATCH_MAX_WEIGHT_MIB_PER_NAMESPACE": str(WEIGHT_MIB),
           "NANWATCH_MAX_WEIGHT_VERSIONS_PER_NAMESPACE": str(WEIGHT_VERSIONS)}
    with CollectorProcess(db_path=tmp_path_factory.mktemp("nsb") / "c.db", env=env) as c:
        yield c


def _post(url: str, headers: dict, *reports) -> httpx.Response:
    return httpx.post(f"{url}/v1/reports", content=ReportBatch(reports=list(reports)).model_dump_json(),
                      headers=headers)


def _caps(url: str) -> dict[str, float]:
    return {dict(labels)["cap"]: v for (name, labels), v in scrape(url, READER).items()
            if name == "nanwatch_collector_caps_hit_total"}


def _nan(run_id: str, rank: int = 0, seq: int = 0, **kw):
    """A float32 NaN at an attention site: a first_nonfinite event, and no directive (no half precision)."""
    return step_report(run_id=run_id, rank=rank, seq=seq, step=seq + 1, nan_at=SITE, nan=2, dtype="float32", **kw)


def _victim_counts(url: str, run: str) -> None:
    """Team B's new run: accepted, its NaN counted by site and its first_nonfinite event recorded."""
    resp = _post(url, B_H, _nan(run))
    assert resp.status_code == 200, resp.text
    s = scrape(url, READER)
    assert sample(s, "nanwatch_site_nonfinite_calls_total", run_id=run, site=SITE, **{"pass": "forward"}) == 2
    assert sample(s, "nanwatch_events_total", run_id=run, kind="first_nonfinite") == 1


def test_one_teams_ranks_fill_its_own_namespace_only(teams):
    url = teams.url
    ranks = [step_report(run_id="team-a-ranks", rank=k, world_size=PAIRS, seq=0, step=1) for k in range(PAIRS)]
    assert _post(url, A_H, *ranks).status_code == 200
    before = _caps(url).get("incarnations_per_namespace", 0)
    for junk in (step_report(run_id="team-a-more", rank=0, seq=0),  # a new run's first rank
                 step_report(run_id="team-a-ranks", rank=0, world_size=PAIRS, seq=0, incarnation="restart")):
        resp = _post(url, A_H, junk)
        assert resp.status_code == 429 and "NANWATCH_MAX_INCARNATIONS_PER_NAMESPACE" in resp.text, resp.text
    assert _caps(url)["incarnations_per_namespace"] == before + 2
    # team B: new runs, then one with a NaN, all counted
    assert _post(url, B_H, *[step_report(run_id=f"team-b-new-{i}") for i in range(10)]).status_code == 200
    _victim_counts(url, "team-b-after-ranks")
    # team A's existing ranks keep reporting
    assert _post(url, A_H, ranks[0].model_copy(update={"seq": 1, "step": 2})).status_code == 200


def test_one_teams_events_fill_its_own_namespace_only(teams):
    url = teams.url
    before = _caps(url).get("events_per_namespace", 0)
    # an admin frees team A's places (the ranks test filled them), then team A makes more events than its share
    for run in ("team-a-ranks",):
        httpx.delete(f"{url}/v1/runs/{run}", headers={"Authorization": f"Bearer {ADMIN}"})
    runs = [f"team-a-ev-{i}" for i in range(EVENTS + 3)]
    assert _post(url, A_H, *[_nan(r) for r in runs]).status_code == 200
    kept = sum(sample(scrape(url, READER), "nanwatch_events_total", run_id=r, kind="first_nonfinite") or 0
               for r in runs)
    assert kept <= EVENTS
    assert _caps(url)["events_per_namespace"] >= before + 3
    _victim_counts(url, "team-b-after-events")


def _rollout_set(tensors: int) -> dict:
    """A rollout worker's set with no trainer side (it waits for one): ~240 KB held for 1,100 tensors."""
    return {"side": "rollout", "worker": "w0",
            "fingerprints": {f"model.layers.{i}.mlp.down_proj.weight": f"{i:032x}" for i in range(tensors)}}


def _put(url: str, headers: dict, run_id: str, version: int, body: dict) -> httpx.Response:
    return httpx.put(f"{url}/v1/runs/{run_id}/weights/{version}", json=body, headers=headers)


def test_one_teams_weight_sync_sets_fill_its_own_namespace_only(teams):
    """Finding 3 as it was found: team A's rollout-only sets (no trainer side) filled the collector until team
    B's new runs got 429 memory and its NaN counter stayed 0, with cap="memory" at 0. Now team A's sets and
    versions are bounded in its namespace (429, counted), and team B is untouched."""
    url, run = teams.url, "team-a-weights"
    caps = _caps(url)
    for version in range(1, 5):  # four sets of ~240 KB fit in 1 MiB
        resp = _put(url, A_H, run, version, _rollout_set(1100))
        assert resp.status_code == 200, resp.text
    resp = _put(url, A_H, run, 5, _rollout_set(1100))
    assert resp.status_code == 429 and "NANWATCH_MAX_WEIGHT_MIB_PER_NAMESPACE" in resp.text, resp.text
    for version in (5, 6):  # small sets still fit, up to the versions bound
        assert _put(url, A_H, run, version, _rollout_set(2)).status_code == 200
    assert _put(url, A_H, "team-a-weights-2", 7, _rollout_set(2)).status_code == 429  # a seventh version
    after = _caps(url)
    assert after["weight_bytes_per_namespace"] == caps.get("weight_bytes_per_namespace", 0) + 1
    assert after["weight_versions_per_namespace"] == caps.get("weight_versions_per_namespace", 0) + 1
    # team B: new runs, its NaN counted, and its own weight sets taken
    assert _post(url, B_H, *[step_report(run_id=f"team-b-w-{i}") for i in range(5)]).status_code == 200
    _victim_counts(url, "team-b-after-weights")
    assert _put(url, B_H, "team-b-after-weights", 1, _rollout_set(1100)).status_code == 200


def test_every_memory_refusal_is_counted(tmp_path):
    """Finding 3 saw cap="memory" stay 0 while reports and weight sets got 429 memory: above the memory limit a
    new run and a weight set are refused, and each refusal is counted."""
    from support import background_collector

    with background_collector(tmp_path, memory_limit_mib=1, metrics_min_interval_s=0) as srv:
        runs = httpx.post(f"{srv.url}/v1/reports", content=ReportBatch(reports=[step_report(run_id="mem")]).model_dump_json(),
                          headers=JSON)
        weights = _put(srv.url, JSON, "mem-w", 1, _rollout_set(2))
        assert runs.status_code == weights.status_code == 429
        assert "memory" in runs.text and "memory" in weights.text
        s = scrape(srv.url, "")
        assert sample(s, "nanwatch_collector_caps_hit_total", cap="memory") == 2
        assert sample(s, "nanwatch_collector_requests_rejected_total", reason="memory") == 2
