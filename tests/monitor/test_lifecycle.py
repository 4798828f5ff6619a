"""Evaluation reports and crashed ranks at the collector (wire 1.5 ``stage`` and ``raised``), through a real
``nanwatch serve`` on loopback."""

import httpx
from support import AUTH, JSON, CollectorProcess, post_reports, run_view, sample, scrape, step_report

from nanwatch.wire import Coverage

SITE = "model.layers.2.self_attn"








def _eval_report(**kw):
    """An evaluation's report: every site and call of the eval stage, a bf16 attention NaN, a huge logit."""
    r = step_report(**kw, nan_at=SITE, nan=3, logit=500.0)
    for s in r.sites:
        s.stage = "eval"
    for c in r.sdpa:
        c.stage = "eval"
    r.stage, r.first_offender_stage = "eval", "eval"
    r.coverage = Coverage(forwards=1, unmeasured=["no_logits"])
    return r


def test_an_eval_report_is_counted_but_is_no_training_step(collector):
    url = collector.url
    post_reports(url, *(step_report(run_id="ev", seq=i, step=i + 1) for i in range(3)))  # training steps 1..3
    before = scrape(url)
    assert sample(before, "nanwatch_attention_logit_max", run_id="ev", layer="model.layers.3.self_attn") == 15.5
    # the evaluation after step 3; a step number above the run's (a standalone evaluation) moves nothing either
    post_reports(url, _eval_report(run_id="ev", seq=3, step=3), _eval_report(run_id="ev", seq=4, step=40))
    run, s = run_view(url, "ev"), scrape(url)
    assert run["latest_step"] == 3 and run["status"] == "live" and run["live_ranks"] == 1
    (rank,) = run["ranks"]
    assert rank["step"] == 3 and rank["logit_max"] == 15.5 and rank["nonfinite"] == 0  # the training view
    assert sample(s, "nanwatch_attention_logit_max", run_id="ev", layer="model.layers.3.self_attn") == 15.5
    assert sample(s, "nanwatch_tensor_headroom_ratio", run_id="ev", site_kind="attention") == sample(
        before, "nanwatch_tensor_headroom_ratio", run_id="ev", site_kind="attention")
    # its values are counted, under the eval stage where the metric has one
    assert sample(s, "nanwatch_sdpa_calls_total", run_id="ev", backend="flash", dtype="bfloat16", stage="eval") == 8
    assert sample(s, "nanwatch_sdpa_calls_total", run_id="ev", backend="flash", dtype="bfloat16", stage="train") == 12
    assert sample(s, "nanwatch_run_nonfinite_calls_total", run_id="ev", **{"pass": "forward"}, kind="nan",
                stage="eval") == 6
    assert sample(s, "nanwatch_run_nonfinite_calls_total", run_id="ev", **{"pass": "forward"}, kind="nan",
                stage="train") == 0
    assert sample(s, "nanwatch_first_offender_info", run_id="ev", site=SITE, **{"pass": "forward"}, stage="eval",
                rank="0") == 1
    # an evaluation is no unmeasured step, and a bf16 attention NaN in eval asks for no fp32 directive
    assert sample(s, "nanwatch_unmeasured_steps_total", run_id="ev", reason="no_logits") is None
    assert httpx.get(f"{url}/v1/directives/ev", headers=AUTH).json()["mode"] == "none"
    # the control: the same NaN in a training step does ask for it
    post_reports(url, step_report(run_id="ev", seq=5, step=4, nan_at=SITE, nan=3))
    assert httpx.get(f"{url}/v1/directives/ev", headers=AUTH).json()["mode"] == "fp32"
    assert run_view(url, "ev")["latest_step"] == 4


def test_a_rank_whose_step_raised_is_crashed_and_the_run_ends_crashed(collector):
    url = collector.url
    post_reports(url, *(step_report(run_id="boom", rank=rank, world_size=2, seq=0, step=1) for rank in (0, 1)))
    assert run_view(url, "boom")["status"] == "live"
    crash = step_report(run_id="boom", rank=1, world_size=2, seq=1, step=2).model_copy(
        update={"raised": "FloatingPointError"})
    post_reports(url, crash)
    assert post_reports(url, crash) == {"accepted": 0, "duplicates": 1}  # idempotent: one crash, one event
    run, s = run_view(url, "boom"), scrape(url)
    assert run["status"] == "crashed" and run["live_ranks"] == 1
    assert run["crashed_ranks"] == [{"rank": 1, "raised": "FloatingPointError", "step": 2}]
    assert [(r["rank"], r["crashed"]) for r in run["ranks"]] == [(0, None), (1, "FloatingPointError")]
    assert run["event_counts"]["rank_crashed"] == 1
    (ev,) = [e for e in run["events"] if e["kind"] == "rank_crashed"]
    assert (ev["rank"], ev["step"], ev["detail"]["raised"]) == (1, 2, "FloatingPointError")
    assert sample(s, "nanwatch_rank_crashed", run_id="boom", rank="1") == 1
    assert sample(s, "nanwatch_rank_crashed", run_id="boom", rank="0") is None
    assert sample(s, "nanwatch_live_ranks", run_id="boom") == 1
    # rank 0 going on does not revive the run; rank 1 restarted (a new incarnation) does
    post_reports(url, step_report(run_id="boom", rank=0, world_size=2, seq=1, step=2))
    assert run_view(url, "boom")["status"] == "crashed"
    post_reports(url, step_report(run_id="boom", rank=1, world_size=2, seq=0, step=3, incarnation="inc1"))
    run, s = run_view(url, "boom"), scrape(url)
    assert (run["status"], run["live_ranks"], run["crashed_ranks"]) == ("live", 2, [])
    assert sample(s, "nanwatch_rank_crashed", run_id="boom", rank="1") is None


def test_a_crash_outlives_a_collector_restart(tmp_path):
    db = tmp_path / "c.db"
    with CollectorProcess(db_path=db) as c:
        post_reports(c.url, step_report(run_id="gone", seq=0, step=5).model_copy(update={"raised": "RuntimeError"}),
              auth=JSON)
    with CollectorProcess(db_path=db) as c:
        run = run_view(c.url, "gone", auth={})
        assert run["status"] == "crashed"
        assert run["crashed_ranks"] == [{"rank": 0, "raised": "RuntimeError", "step": None}]
        assert sample(scrape(c.url), "nanwatch_rank_crashed", run_id="gone", rank="0") == 1
