"""Pages an on-call engineer can trust (#18), through a real ``nanwatch serve`` on loopback: counters born at
zero (and not again after a restart or a gap), the stage of the run's non-finite count, this incident's
offender, loss-scale overflows counted apart, the math fallback named, runs that end normally (wire 1.6
``final``), and hung ranks that keep their last report time."""

import time

import httpx
import pytest
from support import AUTH, JSON, CollectorProcess, post_reports, run_view, sample, scrape, step_report

from nanwatch.wire import StepReport

L0, L1 = "model.layers.0.self_attn", "model.layers.1.self_attn"
FWD = {"pass": "forward"}








def _of(s, name, run_id) -> dict[frozenset, float]:
    return {labels: v for (n, labels), v in s.items() if n == name and ("run_id", run_id) in labels}


def _ranks(s, name, run_id) -> set[str]:
    return {dict(labels)["rank"] for labels in _of(s, name, run_id)}


def _overflow(run_id: str, rank: int, seq: int, scale: float) -> StepReport:
    """A GradScaler step that overflowed: only a gradient is non-finite, the scaler skipped the update."""
    r = step_report(run_id=run_id, rank=rank, world_size=2, seq=seq, step=seq, dtype="float16")
    back = next(s for s in r.sites if s.phase == "backward")
    back.inf, back.headroom = 5, float("inf")
    return r.model_copy(update={"scaler_overflow": True, "loss_scale": scale})


def test_a_new_series_is_scraped_at_zero_then_at_its_value(collector):
    url = collector.url
    post_reports(url, step_report(run_id="born", seq=0, nan_at=L0, nan=3))  # the run's very first report holds a NaN
    first, second = scrape(url, settled=False), scrape(url, settled=False)
    for s, want in ((first, 0), (second, 3)):
        assert sample(s, "nanwatch_run_nonfinite_calls_total", run_id="born", **FWD, kind="nan", stage="train") == want
        assert sample(s, "nanwatch_site_nonfinite_calls_total", run_id="born", site=L0, **FWD) == want
        assert sample(s, "nanwatch_nonfinite_calls_total", run_id="born", rank="0", **FWD, kind="nan") == want
        assert sample(s, "nanwatch_events_total", run_id="born", kind="first_nonfinite") == min(want, 1)
    assert sample(first, "nanwatch_sdpa_calls_total", run_id="born", backend="flash", dtype="bfloat16",
                stage="train") == 0
    assert sample(second, "nanwatch_sdpa_calls_total", run_id="born", backend="flash", dtype="bfloat16",
                stage="train") == 4
    # a NaN in a generate-stage site (an RLHF rollout) is counted under its stage, born at zero too
    r = step_report(run_id="born", seq=1, nan_at=L1, nan=2)
    for site in r.sites:
        if site.site == L1:
            site.stage = "generate"
    r.first_offender_stage = "generate"
    post_reports(url, r)
    third, fourth = scrape(url, settled=False), scrape(url, settled=False)
    assert sample(third, "nanwatch_run_nonfinite_calls_total", run_id="born", **FWD, kind="nan", stage="generate") == 0
    assert sample(fourth, "nanwatch_run_nonfinite_calls_total", run_id="born", **FWD, kind="nan", stage="generate") == 2
    # the series already exposed (train stage, the rank's) move at once
    assert sample(third, "nanwatch_run_nonfinite_calls_total", run_id="born", **FWD, kind="nan", stage="train") == 3
    assert sample(third, "nanwatch_nonfinite_calls_total", run_id="born", rank="0", **FWD, kind="nan") == 5
    # a clean series born exposed at 0 by default gets its first NaN at once (no second zero)
    post_reports(url, step_report(run_id="born", rank=1, world_size=2, seq=0))
    scrape(url, settled=False)
    post_reports(url, step_report(run_id="born", rank=1, world_size=2, seq=1, nan_at=L0, nan=1))
    assert sample(scrape(url, settled=False), "nanwatch_nonfinite_calls_total", run_id="born", rank="1", **FWD,
                kind="nan") == 1


def test_a_series_read_back_after_a_restart_is_shown_at_its_total_at_once(tmp_path):
    db = tmp_path / "r.db"
    with CollectorProcess(db_path=db) as c:
        post_reports(c.url, step_report(run_id="back", seq=0, nan_at=L0, nan=4), auth=JSON)
    with CollectorProcess(db_path=db) as c:
        post_reports(c.url, step_report(run_id="back", seq=1), auth=JSON)  # the run is live again, clean
        s = scrape(c.url, settled=False)
        assert sample(s, "nanwatch_run_nonfinite_calls_total", run_id="back", **FWD, kind="nan", stage="train") == 4
        assert sample(s, "nanwatch_site_nonfinite_calls_total", run_id="back", site=L0, **FWD) == 4
        assert sample(s, "nanwatch_nonfinite_calls_total", run_id="back", rank="0", **FWD, kind="nan") == 4
        assert sample(s, "nanwatch_events_total", run_id="back", kind="first_nonfinite") == 1


def test_the_latest_offender_is_this_incidents(collector):
    url = collector.url
    post_reports(url, step_report(run_id="two", rank=0, world_size=2, seq=0, nan_at=L0, nan=1),
          step_report(run_id="two", rank=1, world_size=2, seq=0))
    s = scrape(url)
    first = dict(run_id="two", site=L0, **FWD, stage="train", rank="0")
    assert sample(s, "nanwatch_first_offender_info", **first) == 1
    assert sample(s, "nanwatch_latest_offender_info", **first) == 1
    post_reports(url, step_report(run_id="two", rank=1, world_size=2, seq=1, nan_at=L1, nan=2),
          step_report(run_id="two", rank=0, world_size=2, seq=1))  # a clean report after it moves nothing
    s = scrape(url)
    assert sample(s, "nanwatch_first_offender_info", **first) == 1
    assert _of(s, "nanwatch_latest_offender_info", "two") == {
        frozenset(dict(run_id="two", site=L1, **FWD, stage="train", rank="1").items()): 1}


def test_loss_scale_overflows_are_counted_apart_once_per_step(collector):
    url = collector.url
    for seq in (0, 1):  # two steps, each reported by both ranks
        post_reports(url, _overflow("amp", 0, seq, 1024.0 / 2 ** seq), _overflow("amp", 1, seq, 2048.0 / 2 ** seq))
    s, run = scrape(url), run_view(url, "amp")
    assert sample(s, "nanwatch_loss_scale_overflows_total", run_id="amp") == 2
    assert sample(s, "nanwatch_loss_scale", run_id="amp") == 512.0
    assert set(_of(s, "nanwatch_run_nonfinite_calls_total", "amp").values()) == {0}
    assert set(_of(s, "nanwatch_nonfinite_calls_total", "amp").values()) == {0}
    assert not _of(s, "nanwatch_site_nonfinite_calls_total", "amp")
    assert not _of(s, "nanwatch_first_offender_info", "amp") and not _of(s, "nanwatch_latest_offender_info", "amp")
    assert run["first_offender"] is None and run["nonfinite_total"] == 0
    assert run["event_counts"] == {"loss_scale_overflow": 1}
    assert httpx.get(f"{url}/v1/directives/amp", headers=AUTH).json()["mode"] == "none"
    # the control: the same gradient Inf without the scaler's word is an incident
    post_reports(url, _overflow("amp", 0, 2, 256.0).model_copy(update={"scaler_overflow": False}))
    s = scrape(url)
    assert sample(s, "nanwatch_run_nonfinite_calls_total", run_id="amp", **{"pass": "backward"}, kind="inf",
                stage="train") == 5
    assert sample(s, "nanwatch_loss_scale_overflows_total", run_id="amp") == 2
    assert sample(s, "nanwatch_loss_scale", run_id="amp") == 256.0


def test_the_math_fallback_is_named_by_site_and_rank(collector):
    url = collector.url
    post_reports(url, step_report(run_id="slow", rank=0, world_size=2, seq=0),
          step_report(run_id="slow", rank=1, world_size=2, seq=0, backend="math"),
          step_report(run_id="slow", rank=0, world_size=2, seq=1, backend="math", dtype="float32"))  # fp32: not it
    assert _of(scrape(url), "nanwatch_math_fallback_info", "slow") == {
        frozenset(dict(run_id="slow", site="model.layers.3.self_attn", dtype="bfloat16", rank="1").items()): 1}


def test_a_run_that_ends_normally_says_so_and_survives_a_restart(tmp_path):
    db, run = tmp_path / "e.db", "done"
    with CollectorProcess(db_path=db) as c:
        post_reports(c.url, *(step_report(run_id=run, rank=k, world_size=2, seq=0, nan_at=L0, nan=1) for k in (0, 1)),
              auth=JSON)
        post_reports(c.url, step_report(run_id=run, rank=0, world_size=2, seq=1).model_copy(update={"final": True}),
              auth=JSON)
        s, view = scrape(c.url), run_view(c.url, run, auth={})
        assert _ranks(s, "nanwatch_last_report_timestamp_seconds", run) == {"1"}  # rank 0 ended: no RankStale
        assert _ranks(s, "nanwatch_attention_mode", run) == {"1"}
        assert view["status"] == "live" and view["live_ranks"] == 1 and sample(s, "nanwatch_run_ended", run_id=run) is None
        post_reports(c.url, step_report(run_id=run, rank=1, world_size=2, seq=1).model_copy(update={"final": True}),
              auth=JSON)
        # a straggling heartbeat of an incarnation that ended holds nothing
        post_reports(c.url, StepReport(run_id=run, scope="heartbeat", rank=1, world_size=2, incarnation="inc0", seq=2,
                                step=1, time=time.time()), auth=JSON)
        s, view = scrape(c.url), run_view(c.url, run, auth={})
        assert sample(s, "nanwatch_run_ended", run_id=run) == 1
        assert not _of(s, "nanwatch_last_report_timestamp_seconds", run) and not _of(s, "nanwatch_live_ranks", run)
        assert (view["status"], view["live_ranks"], view["event_counts"]["run_ended"]) == ("ended", 0, 1)
        assert sample(s, "nanwatch_run_nonfinite_calls_total", run_id=run, **FWD, kind="nan", stage="train") == 2
    with CollectorProcess(db_path=db) as c:
        assert run_view(c.url, run, auth={})["status"] == "ended"
        assert sample(scrape(c.url), "nanwatch_run_ended", run_id=run) == 1
        # a new incarnation revives it
        post_reports(c.url, step_report(run_id=run, rank=0, world_size=2, seq=0, incarnation="inc1"), auth=JSON)
        s, view = scrape(c.url), run_view(c.url, run, auth={})
        assert view["status"] == "live" and sample(s, "nanwatch_run_ended", run_id=run) is None
        assert _ranks(s, "nanwatch_last_report_timestamp_seconds", run) == {"0"}
    with CollectorProcess(db_path=db) as c:  # the revival is stored too
        assert run_view(c.url, run, auth={})["status"] == "idle"


def _until_expired(url: str, run: str, rank: str, keep_alive, what: str) -> dict:
    """Scrape (rank 0 reporting meanwhile) until ``rank``'s attention-mode series expired (its TTL)."""
    deadline = time.monotonic() + 30
    while rank in _ranks(s := scrape(url), "nanwatch_attention_mode", run):
        assert time.monotonic() < deadline, f"{what}: rank {rank}'s series never expired"
        keep_alive()
        time.sleep(0.1)
    return s


@pytest.mark.slow
def test_a_hung_rank_keeps_its_last_report_time_until_it_ends(tmp_path):
    env = {"NANWATCH_RANK_TTL_S": "0.5"}
    run, seq = "hung", iter(range(1, 10_000))
    with CollectorProcess(db_path=tmp_path / "h.db", env=env) as c:
        post_reports(c.url, *(step_report(run_id=run, rank=k, world_size=2, seq=0, nan_at=L0 if k else None,
                                   nan=4 if k else 0) for k in (0, 1)), auth=JSON)

        def rank0() -> None:
            post_reports(c.url, step_report(run_id=run, rank=0, world_size=2, seq=next(seq)), auth=JSON)

        s = _until_expired(c.url, run, "1", rank0, "silent rank")
        assert _ranks(s, "nanwatch_last_report_timestamp_seconds", run) == {"0", "1"}  # hung: still alerting
        assert sample(s, "nanwatch_live_ranks", run_id=run) == 1
        assert _ranks(s, "nanwatch_nonfinite_calls_total", run) == {"0"}
        # it comes back after its TTL: its counter at its total at once
        post_reports(c.url, step_report(run_id=run, rank=1, world_size=2, seq=1), auth=JSON)
        assert sample(scrape(c.url, settled=False), "nanwatch_nonfinite_calls_total", run_id=run, rank="1", **FWD,
                    kind="nan") == 4
        # silent again, then it closes normally: its last report time goes at once
        _until_expired(c.url, run, "1", rank0, "silent again")
        post_reports(c.url, step_report(run_id=run, rank=1, world_size=2, seq=2).model_copy(update={"final": True}),
              auth=JSON)
        assert _ranks(scrape(c.url), "nanwatch_last_report_timestamp_seconds", run) == {"0"}


@pytest.mark.slow
def test_a_hung_rank_is_let_go_after_the_silent_keep(tmp_path):
    env = {"NANWATCH_RANK_TTL_S": "0.5", "NANWATCH_SILENT_KEEP_S": "3"}
    run, seq = "let-go", iter(range(1, 10_000))
    with CollectorProcess(db_path=tmp_path / "k.db", env=env) as c:
        post_reports(c.url, *(step_report(run_id=run, rank=k, world_size=2, seq=0) for k in (0, 1)), auth=JSON)

        def rank0() -> None:
            post_reports(c.url, step_report(run_id=run, rank=0, world_size=2, seq=next(seq)), auth=JSON)

        s = _until_expired(c.url, run, "1", rank0, "silent rank")
        seen_hung = "1" in _ranks(s, "nanwatch_last_report_timestamp_seconds", run)
        deadline = time.monotonic() + 30
        while "1" in _ranks(scrape(c.url), "nanwatch_last_report_timestamp_seconds", run):
            assert time.monotonic() < deadline, "the hung rank's last report time was never let go"
            rank0()
            time.sleep(0.2)
        assert seen_hung  # it was kept past its TTL, then let go
        # rank 0 is live right after a report (its TTL is 0.5 s: a loaded machine may take longer than that
        # between a report and the next request, so a few tries)
        statuses = []
        for _ in range(5):
            rank0()
            statuses.append(run_view(c.url, run, auth={})["status"])
            if statuses[-1] == "live":
                break
        assert statuses[-1] == "live", statuses
