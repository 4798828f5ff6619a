"""Named ingest tokens scoped to run-id namespaces (issue #19, findings 6, 7, 8 and 12): a team's token
writes, reads and polls its own runs only, the run cap counts per namespace, an admin deletes a run, and
``GET /v1/runs`` comes in pages. Against a real ``nanwatch serve`` on loopback."""

from __future__ import annotations

import json

import httpx
import pytest
from support import ADMIN, JSON, CollectorProcess, scrape, step_report, wait_until

from nanwatch.cli import main as cli_main
from nanwatch.hooks.report.transport import ReportSender
from nanwatch.wire import MAX_INT, ReportBatch

TEAM_A, TEAM_B, READER = "team-a-secret", "team-b-secret", "reader-secret"
A_H = {"Authorization": f"Bearer {TEAM_A}", **JSON}
B_H = {"Authorization": f"Bearer {TEAM_B}", **JSON}
ADMIN_H = {"Authorization": f"Bearer {ADMIN}", **JSON}
READER_H = {"Authorization": f"Bearer {READER}"}
SITE = "model.layers.1.self_attn"


def _env(**more: str) -> dict[str, str]:
    """Two teams, each owning its run-id namespace; a named admin (``alice``) and a reader-only token."""
    tokens = {"team-a": {"token": TEAM_A, "runs": "team-a-*"}, "team-b": {"token": TEAM_B, "runs": "team-b-*"}}
    return {"NANWATCH_TOKENS": json.dumps(tokens), "NANWATCH_ADMIN_TOKENS": json.dumps({"alice": ADMIN}),
            "NANWATCH_METRICS_TOKEN": READER, **more}


@pytest.fixture(scope="module")
def teams(tmp_path_factory):
    with CollectorProcess(db_path=tmp_path_factory.mktemp("ns") / "c.db", env=_env()) as c:
        yield c


def _post(url: str, headers: dict, *reports) -> httpx.Response:
    return httpx.post(f"{url}/v1/reports", content=ReportBatch(reports=list(reports)).model_dump_json(),
                      headers=headers)


def _half_nan(run_id: str, seq: int, **kw):
    """A report whose fp16 attention output is NaN: the default rules issue an fp32 directive."""
    return step_report(run_id=run_id, seq=seq, dtype="float16", nan_at=SITE, nan=3, **kw)


def test_a_team_cannot_read_or_poll_another_teams_run(teams):
    url = teams.url
    assert _post(url, A_H, step_report(run_id="team-a-read")).status_code == 200
    mine = httpx.get(f"{url}/v1/runs/team-a-read", headers=A_H)
    assert mine.status_code == 200
    theirs = httpx.get(f"{url}/v1/runs/team-a-read", headers=B_H)
    unknown = httpx.get(f"{url}/v1/runs/team-a-never", headers=B_H)
    # not there for team B: the same answer as a run that does not exist (existence does not leak)
    assert theirs.status_code == unknown.status_code == 404
    assert theirs.json()["detail"].replace("team-a-read", "X") == unknown.json()["detail"].replace("team-a-never", "X")
    poll = httpx.get(f"{url}/v1/directives/team-a-read", params={"index": 0, "wait": 0}, headers=B_H)
    assert poll.status_code == 404
    assert httpx.get(f"{url}/v1/directives/team-a-read", params={"index": 0}, headers=A_H).status_code == 200
    # admins and the reader read every run
    assert httpx.get(f"{url}/v1/runs/team-a-read", headers=ADMIN_H).status_code == 200
    assert httpx.get(f"{url}/v1/runs/team-a-read", headers=READER_H).status_code == 200


def test_a_team_cannot_take_over_another_teams_idempotency(teams):
    """Finding 7 across namespaces: team B reads nothing of team A's run, and its seq = 2^53-1 for team A's
    incarnation is refused, so team A's next report (with a NaN) counts, names its offender and issues a
    directive."""
    url, run = teams.url, "team-a-victim"
    assert _post(url, A_H, step_report(run_id=run, seq=0, dtype="float16")).json() == {"accepted": 1, "duplicates": 0}
    takeover = _post(url, B_H, step_report(run_id=run, seq=MAX_INT, dtype="float16"))
    assert takeover.status_code == 403, takeover.text
    assert "team-a-victim" in takeover.json()["detail"] and "nothing was applied" in takeover.json()["detail"]
    # one foreign report refuses the whole batch: nothing of it is applied, not even team B's own run
    mixed = _post(url, B_H, step_report(run_id="team-b-own"), step_report(run_id=run, seq=MAX_INT))
    assert mixed.status_code == 403
    assert httpx.get(f"{url}/v1/runs/team-b-own", headers=ADMIN_H).status_code == 404
    assert _post(url, A_H, _half_nan(run, 1)).json() == {"accepted": 1, "duplicates": 0}
    view = httpx.get(f"{url}/v1/runs/{run}", headers=A_H).json()
    assert view["first_offender"]["site"] == SITE and view["nonfinite_total"] == 3
    assert (view["directive"]["version"], view["directive"]["mode"]) == (1, "fp32")
    s = scrape(url, READER)
    assert s[("nanwatch_collector_requests_rejected_total", frozenset({("reason", "foreign_run")}))] >= 2


def test_the_run_list_shows_a_team_its_own_runs(teams):
    url = teams.url
    for run, h in (("team-a-list", A_H), ("team-b-list", B_H)):
        assert _post(url, h, step_report(run_id=run)).status_code == 200
    listed = {r["run_id"] for r in httpx.get(f"{url}/v1/runs", headers=B_H).json()["runs"]}
    assert "team-b-list" in listed and not any(r.startswith("team-a-") for r in listed)
    everything = {r["run_id"] for r in httpx.get(f"{url}/v1/runs", headers=READER_H).json()["runs"]}
    assert {"team-a-list", "team-b-list"} <= everything


def test_the_run_list_comes_in_pages(teams, capsys):
    url = teams.url
    runs = [f"team-b-page-{i:02d}" for i in range(7)]
    assert _post(url, B_H, *[step_report(run_id=r) for r in runs]).status_code == 200
    seen, after, pages = [], "", 0
    while True:
        page = httpx.get(f"{url}/v1/runs", params={"limit": 3, "after": after}, headers=B_H)
        assert page.status_code == 200, page.text
        body = page.json()
        assert len(body["runs"]) <= 3
        seen += [r["run_id"] for r in body["runs"]]
        pages += 1
        after = body["next_after"]
        if after is None:
            break
    assert seen == sorted(seen) and set(runs) <= set(seen) and len(seen) == len(set(seen)) and pages >= 3
    assert httpx.get(f"{url}/v1/runs", params={"limit": 1001}, headers=B_H).status_code == 422
    # nanwatch status follows the pages to the last one
    assert cli_main(["status", "--url", url, "--token", TEAM_B]) == 0
    printed = capsys.readouterr().out
    assert all(r in printed for r in runs) and "team-a-" not in printed


def test_one_teams_junk_runs_do_not_lock_out_another(tmp_path):
    """Finding 6: the run cap counts per namespace. Team B fills its own; team A and an admin directive for
    a new team-A run still get through, and the refusal is counted."""
    with CollectorProcess(db_path=tmp_path / "c.db", env=_env(NANWATCH_MAX_RUNS="5")) as c:
        junk = [step_report(run_id=f"team-b-junk-{i}") for i in range(5)]
        assert _post(c.url, B_H, *junk).status_code == 200
        assert _post(c.url, A_H, step_report(run_id="team-a-job")).status_code == 200
        put = httpx.put(f"{c.url}/v1/directives/team-a-new", json={"mode": "fp32"}, headers=ADMIN_H)
        assert put.status_code == 200, put.text
        refused = _post(c.url, B_H, step_report(run_id="team-b-junk-5"))
        assert refused.status_code == 429 and "team-b-*" in refused.json()["detail"]
        assert scrape(c.url, READER)[("nanwatch_collector_caps_hit_total", frozenset({("cap", "runs")}))] == 1


def test_an_admin_deletes_a_run(tmp_path):
    log = tmp_path / "collector.log"
    with CollectorProcess(db_path=tmp_path / "c.db", env=_env(NANWATCH_MAX_RUNS="1"), log_path=log) as c:
        assert _post(c.url, A_H, _half_nan("team-a-old", 0)).status_code == 200
        assert _post(c.url, A_H, step_report(run_id="team-a-next")).status_code == 429  # the namespace is full
        assert httpx.delete(f"{c.url}/v1/runs/team-a-old", headers=A_H).status_code == 403  # not an admin token
        gone = httpx.delete(f"{c.url}/v1/runs/team-a-old", headers=ADMIN_H)
        assert gone.status_code == 204, gone.text
        assert httpx.delete(f"{c.url}/v1/runs/team-a-old", headers=ADMIN_H).status_code == 404
        assert httpx.get(f"{c.url}/v1/runs/team-a-old", headers=ADMIN_H).status_code == 404
        assert not any(dict(labels).get("run_id") == "team-a-old" for _, labels in scrape(c.url, READER))
        assert _post(c.url, A_H, step_report(run_id="team-a-next")).status_code == 200  # its place is free
        c.stop()
        assert "'team-a-old' deleted by 'alice'" in log.read_text()
        c.start()  # and it stays deleted
        assert httpx.get(f"{c.url}/v1/runs/team-a-old", headers=ADMIN_H).status_code == 404
        assert httpx.get(f"{c.url}/v1/runs/team-a-next", headers=ADMIN_H).status_code == 200



@pytest.mark.slow
def test_sigkill_with_namespaced_tokens_loses_nothing_and_crosses_nothing(tmp_path):
    """Two teams send through their own scoped tokens while the collector is SIGKILLed and restarted; team
    B also tries to post into team A's run throughout. Each team's run holds exactly its own reports, once."""
    db, n = tmp_path / "c.db", 200
    first = CollectorProcess(db_path=db, env=_env()).start()
    senders = {team: ReportSender(first.url, token=tok, max_queue=1024, batch_max=16, backoff_max_s=0.5)
               for team, tok in (("a", TEAM_A), ("b", TEAM_B))}
    reports = {team: [step_report(run_id=f"team-{team}-kill", rank=i % 2, seq=i // 2, nan_at=SITE, nan=1,
                                  dtype="float32") for i in range(n)] for team in senders}
    second = None
    try:
        for team, sender in senders.items():
            for r in reports[team][: n // 2]:
                assert sender.submit(r)
        wait_until(lambda: all(s.delivered == n // 2 for s in senders.values()), "the first half")
        first.kill()
        for team, sender in senders.items():
            assert all(sender.submit(r) for r in reports[team][n // 2:])
        second = CollectorProcess(db_path=db, port=first.port, env=_env()).start()
        foreign = _post(second.url, B_H, step_report(run_id="team-a-kill", seq=MAX_INT, nan_at=SITE, nan=1))
        assert foreign.status_code == 403
        wait_until(lambda: all(s.delivered == n for s in senders.values()), "the reports queued while it was down")
        assert all(s.close(timeout_s=10) and s.dropped == 0 for s in senders.values())
        s = scrape(second.url, READER)
        for team in senders:
            key = ("nanwatch_site_nonfinite_calls_total",
                   frozenset({("run_id", f"team-{team}-kill"), ("site", SITE), ("pass", "forward")}))
            assert s[key] == n, team
        resend = ReportBatch(reports=reports["a"][:32]).model_dump_json()
        assert httpx.post(f"{second.url}/v1/reports", content=resend, headers=A_H).json() == {
            "accepted": 0, "duplicates": 32}
        assert httpx.post(f"{second.url}/v1/reports", content=resend, headers=B_H).status_code == 403
    finally:
        for sender in senders.values():
            sender.close(timeout_s=0)
        first.stop()
        if second is not None:
            second.stop()


def test_junk_incarnations_do_not_lock_out_a_restart(tmp_path):
    """Finding 6, within one namespace: incarnations no longer live (superseded by their rank's restart)
    give up their high-water marks to a victim's restart instead of refusing it; live ones still count."""
    env = _env(NANWATCH_MAX_INCARNATIONS_PER_RUN="4")
    with CollectorProcess(db_path=tmp_path / "c.db", env=env) as c:
        run = "team-a-restarts"
        for i in range(4):  # rank 0 "restarted" four times: only its latest incarnation is live
            assert _post(c.url, A_H, step_report(run_id=run, rank=0, incarnation=f"junk{i}")).status_code == 200
        restart = _post(c.url, A_H, step_report(run_id=run, rank=1, incarnation="victim", nan_at=SITE, nan=1,
                                                 dtype="float32"))
        assert restart.status_code == 200, restart.text
        assert restart.json() == {"accepted": 1, "duplicates": 0}
        # the live ones keep their marks: their resends are still duplicates
        for rank, inc in ((1, "victim"), (0, "junk3")):
            again = _post(c.url, A_H, step_report(run_id=run, rank=rank, incarnation=inc))
            assert again.json() == {"accepted": 0, "duplicates": 1}
        # live incarnations still fill the cap: four live ranks, and a fifth pair is refused
        for rank in (2, 3):
            assert _post(c.url, A_H, step_report(run_id=run, rank=rank, incarnation="live")).status_code == 200
        assert _post(c.url, A_H, step_report(run_id=run, rank=4, incarnation="live")).status_code == 429
        view = httpx.get(f"{c.url}/v1/runs/{run}", headers=A_H).json()
        assert view["nonfinite_total"] == 1
