"""Namespaces do not leak (issue #27, findings 14-16), against a real ``nanwatch serve`` on loopback with
two scoped teams: one team's not-reproducible incidents never count on another team's host (the host
series carries its run's namespace, and the alert sums within one: its promtool test is in
deploy/prometheus/tests), ``/metrics`` is refused to a scoped ingest token, and host labels are capped per
run and per namespace, counted as caps hit."""

from __future__ import annotations

import json

import httpx
import pytest
from support import ADMIN, JSON, CollectorProcess, scrape, step_report

from nanwatch.wire import Incident, ReportBatch

TEAM_A, TEAM_B, READER = "team-a-secret", "team-b-secret", "reader-secret"
A_H = {"Authorization": f"Bearer {TEAM_A}", **JSON}
B_H = {"Authorization": f"Bearer {TEAM_B}", **JSON}
NOT_REPRO = "nanwatch_not_reproducible_incidents_total"
CAPS = "nanwatch_collector_caps_hit_total"
SITE = "model.layers.0.self_attn"


def _env(**more: str) -> dict[str, str]:
    tokens = {"team-a": {"token": TEAM_A, "runs": "team-a-*"}, "team-b": {"token": TEAM_B, "runs": "team-b-*"}}
    return {"NANWATCH_TOKENS": json.dumps(tokens), "NANWATCH_ADMIN_TOKENS": json.dumps({"alice": ADMIN}),
            "NANWATCH_METRICS_TOKEN": READER, **more}


def _not_repro(run_id: str, seq: int, host: str):
    """A report of step ``seq`` with a not-reproducible incident seen on ``host``."""
    inc = Incident(cls="not_reproducible", step=seq, site=SITE, phase="forward", host=f"{host} rank 0",
                   capsule=f"/capsules/{run_id}/{seq}.nwcap", birth=SITE, birth_kind="attention", birth_elements=3)
    return step_report(run_id=run_id, seq=seq, step=seq, dtype="float16", nan_at=SITE,
                       nan=3).model_copy(update={"incident": inc})


def _post(url: str, headers: dict, *reports) -> None:
    r = httpx.post(f"{url}/v1/reports", content=ReportBatch(reports=list(reports)).model_dump_json(), headers=headers)
    assert r.status_code == 200, r.text


def _hosts(scraped: dict) -> dict[tuple[str, str], float]:
    """``sum by (namespace, host)`` of the not-reproducible counter, as the alert reads it."""
    out: dict[tuple[str, str], float] = {}
    for (name, labels), v in scraped.items():
        if name == NOT_REPRO:
            d = dict(labels)
            key = (d.get("namespace", ""), d["host"])
            out[key] = out.get(key, 0) + v
    return out


@pytest.fixture(scope="module")
def teams(tmp_path_factory):
    with CollectorProcess(db_path=tmp_path_factory.mktemp("leaks") / "c.db", env=_env()) as c:
        yield c


def test_a_team_naming_another_teams_host_counts_in_its_own_namespace_only(teams):
    """Finding 14: team A names team B's host twice in its own run; team B saw it once. Each namespace's
    count is its own (today: one host series summed over both teams, 3, and B's host tickets)."""
    _post(teams.url, A_H, _not_repro("team-a-run", 1, "b-gpu-node-7"), _not_repro("team-a-run", 2, "b-gpu-node-7"))
    _post(teams.url, B_H, _not_repro("team-b-run", 1, "b-gpu-node-7"))
    by = _hosts(scrape(teams.url, READER))
    assert by[("team-b-*", "b-gpu-node-7")] == 1, by
    assert by[("team-a-*", "b-gpu-node-7")] == 2, by


def test_metrics_is_refused_to_a_scoped_token_and_shown_to_the_reader(teams):
    """Finding 15: team B's token gets 404 for team A's run, so ``/metrics`` (every namespace's run ids,
    sites, hosts and capsule paths) is refused to it too; the reader and an admin see everything."""
    _post(teams.url, A_H, _not_repro("team-a-secret-run", 1, "a-gpu-1"))
    assert httpx.get(f"{teams.url}/v1/runs/team-a-secret-run", headers=B_H).status_code == 404
    for headers in (B_H, A_H):
        r = httpx.get(f"{teams.url}/metrics", headers=headers)
        assert r.status_code == 403, r.text[:300]
        assert "team-a-secret-run" not in r.text and "a-gpu-1" not in r.text
        assert "NANWATCH_METRICS_TOKEN" in r.json()["detail"]
    for token in (READER, ADMIN):
        assert any(dict(labels).get("run_id") == "team-a-secret-run" for _, labels in scrape(teams.url, token))


def test_host_labels_are_capped_per_run_and_per_namespace_and_counted(tmp_path):
    """Finding 16: one run naming 10 hosts keeps 3 (the per-run cap), team A's runs together keep 5 (the
    per-namespace cap), team B's namespace keeps its own places; each host left out is counted as a cap hit
    (today: every host is a series, bounded by the run's series cap alone)."""
    env = _env(NANWATCH_MAX_HOSTS_PER_RUN="3", NANWATCH_MAX_HOSTS_PER_NAMESPACE="5")
    with CollectorProcess(db_path=tmp_path / "c.db", env=env) as c:
        _post(c.url, A_H, *(_not_repro("team-a-wide", i, f"fake-{i}") for i in range(10)))
        s = scrape(c.url, READER)
        assert len([k for k in _hosts(s) if k[0] == "team-a-*"]) == 3, _hosts(s)
        assert s[(CAPS, frozenset({("cap", "hosts_per_run")}))] == 7
        # a host the run already names is still counted
        _post(c.url, A_H, _not_repro("team-a-wide", 10, "fake-0"))
        assert _hosts(scrape(c.url, READER))[("team-a-*", "fake-0")] == 2
        # two more of team A's runs: 2 new hosts fit the namespace's 5, the rest do not
        _post(c.url, A_H, *(_not_repro("team-a-more", i, f"more-{i}") for i in range(3)))
        _post(c.url, A_H, _not_repro("team-a-last", 0, "last-0"), _not_repro("team-a-last", 1, "fake-1"))
        s = scrape(c.url, READER)
        a_hosts = {k[1] for k in _hosts(s) if k[0] == "team-a-*"}
        assert len(a_hosts) == 5 and "fake-1" in a_hosts and "last-0" not in a_hosts, a_hosts
        assert s[(CAPS, frozenset({("cap", "hosts_per_namespace")}))] == 2
        # team B's namespace is not full: its hosts count
        _post(c.url, B_H, _not_repro("team-b-run", 0, "b-gpu-1"))
        assert _hosts(scrape(c.url, READER))[("team-b-*", "b-gpu-1")] == 1

