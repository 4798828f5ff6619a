"""A report's scope decides what it may change (#27, findings 9-13), against a real collector (uvicorn on
loopback, in this process): a heartbeat carries liveness only, ``heartbeat_s`` and ``world_size`` are
bounded and one rank cannot raise the run's, a final report ends only its own incarnation, and only the
run's job poster may post ``scope="job"``. One made-up rank in the victim's namespace is the attacker."""

from __future__ import annotations

import time

import httpx
from support import AUTH, background_collector, post_reports, sample, scrape, step_report

from nanwatch.bench.jobs import heartbeat, job_step
from nanwatch.monitor.data.liveness import ttl
from nanwatch.wire import ReportBatch

WORLD = 4


def test_a_heartbeat_moves_no_loss_scale(tmp_path):
    """Finding 9: a made-up rank's heartbeat with loss_scale 0.5 took the run's from 65536 to 0.5 (a page)."""
    with background_collector(tmp_path) as srv:
        real = step_report(run_id="ls", rank=0, world_size=WORLD, seq=0, step=1).model_copy(
            update={"loss_scale": 65536.0})
        post_reports(srv.url, real)
        # dropped reports make the made-up rank's series shown (as a rank that differs from the job)
        fake = heartbeat(run_id="ls", rank=3, world_size=WORLD, seq=0, step=1, incarnation="fake",
                         dropped=1).model_copy(
            update={"loss_scale": 0.5})
        post_reports(srv.url, fake)
        assert sample(scrape(srv.url), "nanwatch_loss_scale", run_id="ls") == 65536.0


def test_one_rank_cannot_raise_the_runs_heartbeat_interval(tmp_path):
    """Finding 10: one heartbeat announcing 86,400 s made every rank's TTL three days."""
    with background_collector(tmp_path) as srv:
        post_reports(srv.url, *[heartbeat(run_id="hb", rank=k, world_size=WORLD, seq=0, step=1, every_s=30.0)
                                for k in range(WORLD - 1)])
        post_reports(srv.url, heartbeat(run_id="hb", rank=WORLD - 1, world_size=WORLD, seq=0, step=1,
                                        incarnation="fake", every_s=86_400.0))
        state = srv.app.state.resources.state
        run = state.runs["hb"]
        assert run.heartbeat_s == 30.0
        assert ttl(state, run) == srv.settings.rank_ttl_s  # three 30 s heartbeats are under the TTL


def _final(run_id: str, rank: int, seq: int, incarnation: str, **kw):
    return step_report(run_id=run_id, rank=rank, world_size=2, seq=seq, step=seq + 1,
                       incarnation=incarnation).model_copy(update={"final": True, **kw})


def _refused(url: str, *reports) -> httpx.Response:
    return httpx.post(f"{url}/v1/reports", content=ReportBatch(reports=list(reports)).model_dump_json(),
                      headers=AUTH)


def test_a_final_report_ends_only_its_own_incarnation(tmp_path):
    """Finding 11 of #27: a final report from another incarnation ended the live rank and the run (muting
    NanwatchRunCrashed). It is refused (409, #37 finding 6), and ends nothing."""
    with background_collector(tmp_path) as srv:
        post_reports(srv.url, step_report(run_id="fin", rank=0, world_size=1, seq=0, step=1, incarnation="real"))
        forged = step_report(run_id="fin", rank=0, world_size=1, seq=0, step=1, incarnation="forged").model_copy(
            update={"final": True})
        resp = _refused(srv.url, forged)
        assert resp.status_code == 409 and "incarnation" in resp.json()["detail"], resp.text
        s = scrape(srv.url)
        assert not sample(s, "nanwatch_run_ended", run_id="fin")
        assert sample(s, "nanwatch_live_ranks", run_id="fin") == 1
        assert srv.app.state.resources.state.runs["fin"].ranks[0].incarnation == "real"


def test_a_blind_final_cannot_end_a_crashed_or_hung_rank(tmp_path):
    """#37 finding 6: a final for another rank without that rank's incarnation cleared its crash and set
    nanwatch_run_ended (NanwatchRunCrashed muted until the victim reported again). It must carry the
    incarnation the run holds for the rank: a crashed one's, a hung one's; else 409 and nothing changes. The
    rank's own final (its incarnation) still ends it, and a resent one is acknowledged."""
    with background_collector(tmp_path, rank_ttl_s=0.5) as srv:
        url = srv.url
        post_reports(url, step_report(run_id="blind", rank=0, world_size=2, seq=0, step=1, incarnation="r0"),
                     step_report(run_id="blind", rank=1, world_size=2, seq=0, step=1, incarnation="r1"))
        post_reports(url, _final("blind", 0, 1, "r0"))  # rank 0 ended normally
        crashed = step_report(run_id="blind", rank=1, world_size=2, seq=1, step=2, incarnation="r1").model_copy(
            update={"raised": "RuntimeError"})
        post_reports(url, crashed)
        assert sample(scrape(url), "nanwatch_rank_crashed", run_id="blind", rank="1") == 1
        for guess in ("made-up", "inc0", ""):  # blind: any incarnation but the victim's
            blind = _final("blind", 1, 9, guess or "x")
            resp = _refused(url, blind)
            assert resp.status_code == 409, resp.text
        s = scrape(url)
        assert sample(s, "nanwatch_rank_crashed", run_id="blind", rank="1") == 1
        assert not sample(s, "nanwatch_run_ended", run_id="blind")
        rejected = sample(s, "nanwatch_collector_requests_rejected_total", reason="final_incarnation")
        assert rejected == 3
        # a hung rank (silent past its TTL, swept): the same
        post_reports(url, step_report(run_id="hung", rank=0, world_size=1, seq=0, step=1, incarnation="h0"))
        state = srv.app.state.resources.state
        deadline = time.monotonic() + 10
        while 0 not in state.runs["hung"].silent and time.monotonic() < deadline:
            time.sleep(0.05)
        assert state.runs["hung"].silent[0].incarnation == "h0"
        assert _refused(url, _final("hung", 0, 1, "guess").model_copy(update={"world_size": 1})).status_code == 409
        assert 0 in state.runs["hung"].silent and not state.runs["hung"].ended
        # the rank's own final ends it, once; its resend is a duplicate, not a refusal
        own = _final("hung", 0, 1, "h0").model_copy(update={"world_size": 1})
        assert post_reports(url, own) == {"accepted": 1, "duplicates": 0}
        assert post_reports(url, own) == {"accepted": 0, "duplicates": 1}
        assert state.runs["hung"].ended


def test_one_heartbeat_cannot_set_the_world_size(tmp_path):
    """Finding 12: one heartbeat with world_size 2^53-1 set the run's world size (a false RanksMissing)."""
    with background_collector(tmp_path) as srv:
        post_reports(srv.url, *[step_report(run_id="ws", rank=k, world_size=2, seq=0, step=1) for k in range(2)])
        post_reports(srv.url, heartbeat(run_id="ws", rank=5, world_size=2**53 - 1, seq=0, step=1,
                                        incarnation="fake"))
        assert sample(scrape(srv.url), "nanwatch_run_world_size", run_id="ws") == 2


def test_only_the_job_poster_posts_job_reports(tmp_path):
    """Finding 13: any rank could post scope=job and rewrite the run's first and latest offender."""
    real_site, fake_site = "model.layers.2.self_attn", "model.layers.31.mlp"
    with background_collector(tmp_path) as srv:
        reports = [step_report(run_id="job", rank=k, world_size=8, seq=0, step=1,
                               nan_at=real_site if k == 3 else None, nan=2 if k == 3 else 0) for k in range(8)]
        job, _details = job_step(reports)
        assert job.rank == 0
        post_reports(srv.url, job)
        forged = job.model_copy(update={"rank": 7, "incarnation": "fake", "first_offender": fake_site,
                                        "first_offender_rank": 7, "seq": 5, "step": 2})
        resp = httpx.post(f"{srv.url}/v1/reports", content=ReportBatch(reports=[forged]).model_dump_json(),
                          headers=AUTH)
        assert resp.status_code == 403, resp.text
        assert "job reports posted by rank 0" in resp.json()["detail"]
        s = scrape(srv.url)
        latest = {dict(labels)["site"]: dict(labels)["rank"] for (name, labels), _v in s.items()
                  if name == "nanwatch_latest_offender_info"}
        assert fake_site not in latest and latest.get(real_site) == "3", latest
        assert sample(s, "nanwatch_collector_requests_rejected_total", reason="job_scope") == 1
