"""The rollout mismatch at the collector (wire 1.8, issue #28), against a real ``nanwatch serve`` on loopback:
hand-built step reports (rank, job and detail scopes) carrying ``RlhfStat.rollout``, the rollout logprobs'
non-finite counts, classified ``rollout_events`` and a ``rollout_attribution``. They become the gauge
``nanwatch_rollout_mismatch{stat}`` (combined over ranks by what each figure is), the counters
``nanwatch_rollout_nonfinite_values_total`` and ``nanwatch_rollout_mismatch_events_total{cause}`` (a job
report counts once, a detail report never, a resend never), events in the run's log, the run view's
``rollout``, and ``nanwatch status`` lines that pass the printable filter."""

from __future__ import annotations

import contextlib
import io
import math
import subprocess
import urllib.request

import pytest
from support import TOKEN, CollectorProcess, post_reports, require_tool, run_view, sample, scrape, step_report

from nanwatch.bench.jobs import job_step
from nanwatch.cli import main
from nanwatch.monitor.data.rollout_figures import STATS
from nanwatch.wire import ModuleShare, RlhfStat, RolloutAttribution, RolloutEvent, RolloutStat, StepReport

MISMATCH, NONFINITE, EVENTS = ("nanwatch_rollout_mismatch", "nanwatch_rollout_nonfinite_values_total",
                               "nanwatch_rollout_mismatch_events_total")

#: two ranks' latest steps: rank 1 has three times rank 0's tokens and the worse figure everywhere
RANK0 = RolloutStat(tokens=100, sequences=4, abs_mean=0.01, abs_max=0.5, abs_p99=0.05, mean=0.002, rms=0.02,
                    k3_mean=1e-4, seq_ratio_max=1.5, seq_ratio_min=0.8, truncated_fraction=0.0,
                    prob_correlation=0.999, logprob_slope=1.0, seq_abs_mean_max=0.02)
RANK1 = RolloutStat(tokens=300, sequences=12, abs_mean=0.05, abs_max=1.2, abs_p99=0.3, mean=-0.01, rms=0.06,
                    k3_mean=2e-3, seq_ratio_max=3.0, seq_ratio_min=0.4, truncated_fraction=0.02,
                    prob_correlation=0.98, logprob_slope=1 / 0.7, seq_abs_mean_max=0.2, outlier_sequences=1)


def _with(r: StepReport, rollout: RolloutStat, *, nonfinite: int = 0, pad: int = 0, **update) -> StepReport:
    rlhf = RlhfStat(tokens=rollout.tokens, ratio_max=1.1,
                    nonfinite={"rollout_logprobs": nonfinite, "rollout_logprobs_pad": pad}, rollout=rollout)
    return r.model_copy(update={"rlhf": rlhf, **update})


def _drift(step: int) -> RolloutEvent:
    return RolloutEvent(cause="drift", step=step, figures={"abs_mean": 0.05, "prob_correlation": 0.98},
                        evidence="mean |dlogp| 0.05 for 20 steps at correlation 0.98", remedy="match the dtypes")


def _rollout_figures(s: dict, run_id: str) -> dict[str, float]:
    return {dict(labels)["stat"]: v for (name, labels), v in s.items()
            if name == MISMATCH and dict(labels)["run_id"] == run_id}


def test_rank_reports_combine_each_figure_its_own_way_and_a_resend_changes_nothing(collector):
    run = "rollout-ranks"
    batch = [_with(step_report(run_id=run, rank=0, world_size=2, seq=0), RANK0, nonfinite=2, pad=5),
             _with(step_report(run_id=run, rank=1, world_size=2, seq=0), RANK1, nonfinite=1, pad=7,
                   rollout_events=[_drift(0)])]
    assert post_reports(collector.url, *batch) == {"accepted": 2, "duplicates": 0}
    before = scrape(collector.url)
    got = _rollout_figures(before, run)
    assert set(got) == set(STATS)  # the fixed list: bounded cardinality, every figure exported
    assert got["abs_mean"] == pytest.approx((100 * 0.01 + 300 * 0.05) / 400)  # token-weighted, exact
    assert got["mean"] == pytest.approx((100 * 0.002 - 300 * 0.01) / 400)
    assert got["k3_mean"] == pytest.approx((100 * 1e-4 + 300 * 2e-3) / 400)
    assert got["truncated_fraction"] == pytest.approx(300 * 0.02 / 400)
    assert got["rms"] == pytest.approx(math.sqrt((100 * 0.02**2 + 300 * 0.06**2) / 400))
    assert (got["abs_max"], got["abs_p99"], got["seq_ratio_max"], got["seq_abs_mean_max"]) == (1.2, 0.3, 3.0, 0.2)
    assert (got["seq_ratio_min"], got["prob_correlation"]) == (0.4, 0.98)  # the worst rank's
    assert got["logprob_slope"] == pytest.approx(1 / 0.7)  # the farthest from 1
    # the rollout's own NaNs inside the mask, summed over ranks; padding is not counted
    assert sample(before, NONFINITE, run_id=run) == 3
    assert sample(before, EVENTS, run_id=run, cause="drift") == 1
    # a resend (the trainer's HTTP retry) is acknowledged and changes nothing
    assert post_reports(collector.url, *batch) == {"accepted": 0, "duplicates": 2}
    after = scrape(collector.url)
    assert sample(after, NONFINITE, run_id=run) == 3 and sample(after, EVENTS, run_id=run, cause="drift") == 1
    assert _rollout_figures(after, run) == got
    view = run_view(collector.url, run)
    assert view["rollout_nonfinite_total"] == 3
    assert view["rollout"]["abs_mean"] == pytest.approx(got["abs_mean"]) and view["rollout"]["tokens"] == 400
    assert [e["kind"] for e in view["events"]].count("rollout_mismatch") == 1
    assert {st["rank"]: st["rlhf"]["rollout"]["abs_max"] for st in view["ranks"]} == {0: 0.5, 1: 1.2}


def test_counters_are_born_at_zero(collector):
    """The first scrape after a series' birth shows it at 0, so that increase() in the pages sees the first
    sampler NaN and the first jump."""
    run = "rollout-born"
    scrape(collector.url)
    post_reports(collector.url, _with(step_report(run_id=run, seq=0), RANK0, nonfinite=4,
                                      rollout_events=[RolloutEvent(cause="jump", step=0)]))
    first = scrape(collector.url, settled=False)
    assert sample(first, NONFINITE, run_id=run) == 0 and sample(first, EVENTS, run_id=run, cause="jump") == 0
    second = scrape(collector.url, settled=False)
    assert sample(second, NONFINITE, run_id=run) == 4 and sample(second, EVENTS, run_id=run, cause="jump") == 1


def test_job_mode_counts_the_job_once_and_detail_reports_never(collector):
    run = "rollout-job"
    for step in range(2):
        ranks = [step_report(run_id=run, rank=k, world_size=4, seq=step, nan_at="model.layers.1.self_attn"
                             if k == 3 else None, nan=1 if k == 3 else 0) for k in range(4)]
        job, details = job_step(ranks)
        assert details  # rank 3 differs: it posts a detail report beside the job's
        job = _with(job, RANK1, nonfinite=6, rollout_events=[RolloutEvent(cause="jump", step=step)])
        # a detail report carrying the same figures (its rank's share of the job's) adds nothing run-level
        details = [_with(d, RANK0, nonfinite=6, rollout_events=[RolloutEvent(cause="jump", step=step)])
                   for d in details]
        post_reports(collector.url, job, *details)
    s = scrape(collector.url)
    assert sample(s, NONFINITE, run_id=run) == 12
    assert sample(s, EVENTS, run_id=run, cause="jump") == 2
    got = _rollout_figures(s, run)
    assert got["abs_mean"] == RANK1.abs_mean and got["abs_max"] == RANK1.abs_max
    view = run_view(collector.url, run)
    assert view["rollout"]["abs_mean"] == RANK1.abs_mean and view["rollout_nonfinite_total"] == 12
    assert [e["kind"] for e in view["events"]].count("rollout_mismatch") == 2


def _status(url: str, run: str) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["status", run, "--url", url, "--token", TOKEN]) == 0
    return buf.getvalue()


def test_events_and_attribution_reach_the_run_view_and_status_named_and_printable(collector):
    run = "rollout-named"
    jump = RolloutEvent(cause="jump", step=7, figures={"abs_mean": 0.201, "abs_mean_before": 0.015},
                        evidence="abs_mean 0.015 -> 0.201 in one step\nnanwatch: all clear",
                        remedy="check the weight sync (fingerprints)")
    at = RolloutAttribution(step=7, cause="drift", rollout_dtype="bfloat16", sequences=4, observed_abs_mean=0.064,
                            lowered_abs_mean=0.06, module="model.layers.1.input_layernorm",
                            modules=[ModuleShare(module="model.layers.1.input_layernorm", abs_mean=0.05, share=0.83),
                                     ModuleShare(module="lm_head", abs_mean=0.004, share=0.07)],
                            capsule="/capsules/rollout-named/step7.nwcap", seconds=1.5)
    post_reports(collector.url, _with(step_report(run_id=run, seq=7, step=7), RANK1, nonfinite=2,
                                      rollout_events=[jump], rollout_attribution=at))
    view = run_view(collector.url, run)
    by_kind = {e["kind"]: e for e in view["events"]}
    ev = by_kind["rollout_mismatch"]
    assert (ev["step"], ev["detail"]["cause"], ev["detail"]["figures"]) == (7, "jump", jump.figures)
    assert ev["detail"]["remedy"] == jump.remedy and ev["detail"]["evidence"] == jump.evidence
    att = by_kind["rollout_attribution"]
    assert att["site"] == "model.layers.1.input_layernorm" and att["detail"]["modules"][0]["share"] == 0.83
    assert view["event_counts"]["rollout_mismatch"] == 1 and view["event_counts"]["rollout_attribution"] == 1
    out = _status(collector.url, run)
    line = next(x for x in out.splitlines() if x.strip().startswith("rollout vs trainer:"))
    for part in ("|Δlogp| mean 0.05", "p99 0.3", "k3 0.002", "truncated 2% (cap 2)", "correlation 0.98",
                 "slope 1.429", "non-finite rollout logprobs 2", "over 300 tokens"):
        assert part in line, line
    mismatch = next(x for x in out.splitlines() if x.strip().startswith("rollout mismatch at step 7"))
    assert "jump" in mismatch and "abs_mean 0.201" in mismatch and "check the weight sync" in mismatch
    # the trainer's newline is shown, never obeyed: no line of the output is the forged one
    assert "\\u000ananwatch: all clear" in mismatch
    assert not any(x.strip().startswith("nanwatch: all clear") for x in out.splitlines())
    named = next(x for x in out.splitlines() if x.strip().startswith("rollout attribution at step 7"))
    assert "module model.layers.1.input_layernorm (lowered to bfloat16)" in named
    assert "model.layers.1.input_layernorm 83%" in named and "capsule /capsules/rollout-named/step7.nwcap" in named
    # a resend: no second event of either kind
    post_reports(collector.url, _with(step_report(run_id=run, seq=7, step=7), RANK1, nonfinite=2,
                                      rollout_events=[jump], rollout_attribution=at))
    assert run_view(collector.url, run)["event_counts"] == view["event_counts"]


def test_status_from_a_local_file_shows_the_same_rollout_lines(tmp_path):
    """The trainer's JSONL record (``--file``) folds into the same lines (a job report's rollout is the run's)."""
    job = _with(step_report(run_id="rollout-file", seq=3, step=3), RANK1, nonfinite=2,
                rollout_events=[_drift(3)]).model_copy(update={"scope": "job"})
    (tmp_path / "r.jsonl").write_text(job.model_dump_json() + "\n")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["status", "--file", str(tmp_path / "r.jsonl")]) == 0
    out = buf.getvalue()
    assert "rollout vs trainer: |Δlogp| mean 0.05, p99 0.3" in out and "non-finite rollout logprobs 2" in out
    assert "rollout mismatch at step 3 on rank 0: drift; abs_mean 0.05 prob_correlation 0.98" in out


def test_promtool_check_metrics_passes_with_the_rollout_families(collector):
    promtool = require_tool("promtool")
    # its own run: under pytest-xdist the tests that post to this collector may run in another worker
    post_reports(collector.url, _with(step_report(run_id="rollout-promtool", seq=0), RANK1, nonfinite=1,
                                      rollout_events=[_drift(0)]))
    req = urllib.request.Request(collector.url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        text = r.read().decode()
    assert f"{MISMATCH}{{" in text and f"{NONFINITE}{{" in text and f"{EVENTS}{{" in text
    out = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr



def test_a_collector_restart_keeps_the_counts_and_the_events_and_counts_a_resend_never(tmp_path):
    """The counters come back at their totals at once when the run reports again (no born-at-zero again: the
    pages' increase() sees no change across the restart), the events stay in the run's log, and a resend after the restart is
    acknowledged and counted nowhere."""
    db = tmp_path / "nanwatch.db"
    report = _with(step_report(run_id="rollout-restart", seq=0), RANK1, nonfinite=5,
                   rollout_events=[RolloutEvent(cause="jump", step=0), _drift(0)])
    with CollectorProcess(db_path=db) as first:
        post_reports(first.url, report)
        scrape(first.url)
    with CollectorProcess(db_path=db) as second:
        # the trainer's next report makes the run live again: its totals show at once, not at 0 first
        post_reports(second.url, _with(step_report(run_id="rollout-restart", seq=1), RANK1))
        once = scrape(second.url, settled=False)
        assert sample(once, NONFINITE, run_id="rollout-restart") == 5
        assert sample(once, EVENTS, run_id="rollout-restart", cause="jump") == 1
        assert post_reports(second.url, report) == {"accepted": 0, "duplicates": 1}
        again = scrape(second.url)
        assert sample(again, NONFINITE, run_id="rollout-restart") == 5
        assert sample(again, EVENTS, run_id="rollout-restart", cause="drift") == 1
        assert run_view(second.url, "rollout-restart")["event_counts"]["rollout_mismatch"] == 2
