"""Rollout against trainer: the figures of ``Monitor.rlhf(rollout_logprobs=)`` against a host reference, and the
classifier's four causes on figure series shaped like the failures users reported."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import nanwatch
from nanwatch.hooks.rollout.compare import EDGES
from nanwatch.hooks.rollout.mismatch import MismatchClassifier
from nanwatch.hooks.rollout.sync_verdict import verdict_of
from nanwatch.wire import RolloutStat


@pytest.fixture
def mon():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # no attention in a Linear: warned, not our business here
        m = nanwatch.attach(torch.nn.Linear(2, 2), run_id="rollout")
    yield m
    m.close()


def _pair(seed=0, b=6, t=40):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(b, t, generator=g) * 4 - 0.01
    rollout = lp + torch.randn(b, t, generator=g) * 0.3
    rollout[2] -= 3.0  # one sequence far off, with tokens whose ratio leaves [1/2, 2]
    mask = torch.rand(b, t, generator=g) > 0.2
    rollout[0, 5], rollout[1, 7] = math.nan, -math.inf
    mask[0, 5], mask[1, 7] = True, False
    return lp, rollout, mask


def _reported(mon, *calls, step=0):
    with mon.step(step):
        for kw in calls:
            mon.rlhf(**kw)
    return mon.last_report().rlhf


def test_figures_match_a_host_reference_and_sampler_nans_are_counted_not_replaced(mon):
    lp, ro, mask = _pair()
    r = _reported(mon, dict(logprobs=lp, rollout_logprobs=ro, mask=mask))
    assert r.nonfinite["rollout_logprobs"] == 1 and r.nonfinite["rollout_logprobs_pad"] == 1
    ok = mask & torch.isfinite(ro)
    d = (lp - ro)[ok].double()
    x, y = lp[ok].double(), ro[ok].double()
    s = r.rollout
    assert s.tokens == int(ok.sum()) and s.sequences == 6 and s.cap == pytest.approx(2.0)
    assert s.abs_mean == pytest.approx(d.abs().mean().item(), rel=1e-6)
    assert s.abs_max == pytest.approx(d.abs().max().item(), rel=1e-6)
    assert s.mean == pytest.approx(d.mean().item(), rel=1e-6)
    assert s.rms == pytest.approx(d.pow(2).mean().sqrt().item(), rel=1e-6)
    assert s.k3_mean == pytest.approx((torch.expm1(d) - d).mean().item(), rel=1e-6)
    assert s.truncated_fraction == pytest.approx((d.abs() > math.log(2.0)).double().mean().item())
    assert s.prob_correlation == pytest.approx(torch.corrcoef(torch.stack([x.exp(), y.exp()]))[0, 1].item(), rel=1e-6)
    slope = ((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum()
    assert s.logprob_slope == pytest.approx(slope.item(), rel=1e-6)
    seq = torch.where(ok, lp - ro, 0.0).double().sum(1)
    assert s.seq_ratio_max == pytest.approx(seq.max().exp().item(), rel=1e-6)
    assert s.seq_ratio_min == pytest.approx(seq.min().exp().item(), rel=1e-6)
    per_seq = torch.where(ok, (lp - ro).abs(), 0.0).double().sum(1) / ok.sum(1)
    assert s.seq_abs_mean_max == pytest.approx(per_seq.max().item(), rel=1e-6)
    exact = torch.quantile(d.abs(), 0.99).item()
    assert exact / 1.34 <= s.abs_p99 <= exact * 1.34  # within one histogram bin (10**(8/64))


def test_the_outlier_sequence_is_counted():
    lp = torch.full((8, 20), -1.0)
    ro = lp + 0.01 * torch.randn(8, 20, generator=torch.Generator().manual_seed(1))
    ro[3] += 1.5
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with nanwatch.attach(torch.nn.Linear(2, 2), run_id="outlier") as m:
            s = _reported(m, dict(logprobs=lp, rollout_logprobs=ro)).rollout
    assert s.outlier_sequences == 1 and s.seq_abs_mean_max == pytest.approx(1.5, abs=0.05)


def test_calls_in_one_step_add_up_to_one_call_on_their_union(mon):
    (lp1, ro1, m1), (lp2, ro2, m2) = _pair(1), _pair(2)
    two = _reported(mon, dict(logprobs=lp1, rollout_logprobs=ro1, mask=m1),
                    dict(logprobs=lp2, rollout_logprobs=ro2, mask=m2), step=0).rollout
    one = _reported(mon, dict(logprobs=torch.cat([lp1, lp2]), rollout_logprobs=torch.cat([ro1, ro2]),
                              mask=torch.cat([m1, m2])), step=1).rollout
    for field, value in one.model_dump().items():
        if field != "outlier_sequences":  # relative to each call's own batch mean, by definition
            assert getattr(two, field) == (pytest.approx(value, rel=1e-9) if isinstance(value, float) else value)


def test_the_cap_is_the_configured_one_unless_the_call_names_its_own(mon):
    lp, ro, mask = _pair()
    d = (lp - ro)[mask & torch.isfinite(ro)].double()
    s = _reported(mon, dict(logprobs=lp, rollout_logprobs=ro, mask=mask, rollout_cap=3.0)).rollout
    assert s.cap == pytest.approx(3.0)
    assert s.truncated_fraction == pytest.approx((d.abs() > math.log(3.0)).double().mean().item())


def test_a_misaligned_rollout_is_warned_about_and_left_out(mon):
    lp, ro, mask = _pair()
    with pytest.warns(RuntimeWarning, match="rollout_logprobs"):
        r = _reported(mon, dict(logprobs=lp, rollout_logprobs=ro[:, :-1], mask=mask))
    assert r.rollout is None and r.tokens == int(mask.sum())


def test_the_histogram_edges_are_log_spaced_from_1e_minus_6_to_100():
    assert EDGES[0] == pytest.approx(1e-6) and EDGES[-1] == pytest.approx(100.0) and len(EDGES) == 65


# ---- the classifier ------------------------------------------------------------------------------------
def _stat(abs_mean, *, mean=0.0, slope=1.0, outliers=0, sequences=16, worst=None):
    return RolloutStat(tokens=1000, sequences=sequences, abs_mean=abs_mean, mean=mean, rms=abs_mean * 1.25,
                       abs_p99=abs_mean * 4, k3_mean=abs_mean ** 2 / 2, logprob_slope=slope, prob_correlation=0.999,
                       outlier_sequences=outliers, seq_abs_mean_max=worst if worst is not None else abs_mean * 2)


def _events(series):
    c = MismatchClassifier()
    return [(step, e.cause) for step, s in enumerate(series) for e in c.observe(step, s)]


def test_healthy_figures_raise_nothing_in_200_steps():
    g = torch.Generator().manual_seed(3)
    noise = (torch.rand(200, generator=g) * 2e-7).tolist()  # fp32 KV cache against a full forward
    assert _events([_stat(v) for v in noise]) == []


def test_a_stale_weight_sync_is_one_jump_at_the_step_it_happens():
    # TRL #5312: sampling_logp_difference/mean went from 0.015 to 0.201, then stayed there
    series = [_stat(0.015 + 0.001 * (i % 3)) for i in range(30)] + [_stat(0.201)] * 20
    got = _events(series)
    assert (30, "jump") in got and [e for e in got if e[1] == "jump"] == [(30, "jump")]


def test_a_temperature_on_the_sampler_alone_is_an_offset_not_a_drift():
    got = _events([_stat(0.3, slope=1 / 0.7, mean=-0.05) for _ in range(10)])
    assert got == [(2, "offset")]


def test_a_one_sided_shift_is_an_offset():
    assert _events([_stat(0.08, mean=-0.08, slope=1.0) for _ in range(5)]) == [(2, "offset")]


def test_a_bf16_rollout_is_one_drift_and_again_when_it_doubles():
    series = [_stat(0.008)] * 10 + [_stat(0.02)] * 5
    assert _events(series) == [(2, "drift"), (10, "drift")]


def test_a_few_far_sequences_are_outliers_and_not_repeated_every_step():
    got = _events([_stat(0.0005, outliers=2, worst=0.4)] * 30)
    assert got == [(0, "outliers")]
    many = _events([_stat(0.0005, outliers=9, sequences=16, worst=0.4)])  # half the batch: no longer "a few"
    assert many == []


# ---- the weight sync's verdict decides (#36) ------------------------------------------------------------------
def _view(latest, **workers):
    """A ``GET /v1/runs/{run_id}/weights`` answer: workers as name=(latest_posted, latest_verified, outcome, lag)."""
    return {"latest_published": latest, "workers": {
        k: dict(latest_posted=p, latest_verified=v, outcome=o, lag=lag) for k, (p, v, o, lag) in workers.items()}}


def _verdicts(views: dict[int, dict]):
    """A ``sync`` callable answering, from each step on, that step's view (the latest given before it), and a
    list of the steps it was asked at."""
    asked, step = [], [0]

    def sync():
        asked.append(step[0])
        return verdict_of(views[max(k for k in views if k <= step[0])])

    return sync, asked, step


def _classified(series, views):
    c, (sync, asked, now) = MismatchClassifier(), _verdicts(views)
    got = []
    for n, s in enumerate(series):
        now[0] = n
        got += [(n, e.cause, e) for e in c.observe(n, s, sync=sync)]
    return [(n, cause) for n, cause, _ in got], [e for *_, e in got], asked


def test_the_verdict_of_a_weight_sync_view():
    assert verdict_of(_view(None)).state == "untracked"
    assert verdict_of(_view(7)).state == "untracked"  # published, but no worker posts fingerprints
    assert verdict_of(_view(7, a=(7, 7, "verified", 0), b=(7, 7, "verified", 0))).state == "verified"
    pending = verdict_of(_view(8, a=(8, 8, "verified", 0), b=(7, 7, "verified", 0)))
    assert pending.state == "pending" and "rollout worker b" in pending.detail
    stale = verdict_of(_view(8, a=(8, 8, "verified", 0), b=(8, 7, "mismatch", 0)))
    assert (stale.state, stale.key) == ("stale", "mismatch:b") and "version 8" in stale.detail
    lag = verdict_of(_view(12, a=(6, 6, "verified", 6)))
    assert (lag.state, lag.key) == ("stale", "lag:a") and "6 weight version(s) behind" in lag.detail
    assert verdict_of(_view(3, a=(3, None, "unverifiable", 0))).state == "untracked"


def test_stale_weights_the_sync_names_are_one_stale_event_never_a_jump_drift_or_offset():
    """The trainer's weights move on and the worker's do not: a jump's rise, then a mismatch that keeps growing
    (a drift's pattern) and one-sided (an offset's). With the worker's fingerprints mismatching, it is one
    stale_weights event, at the rise; nothing else, however long it lasts."""
    series = [_stat(0.0005)] * 6 + [_stat(0.2)] + [_stat(0.2 + 0.02 * i, mean=-0.2) for i in range(20)]
    ok, bad = _view(6, w=(6, 6, "verified", 0)), _view(7, w=(7, 6, "mismatch", 0))
    got, events, asked = _classified(series, {0: ok, 6: bad})
    assert got == [(6, "stale_weights")]
    assert events[0].figures["weight_version"] == 7 and "rollout worker w" in events[0].evidence
    assert asked == [6]  # asked when the rise was a candidate, not while it stays explained


def test_a_slow_stale_drift_is_stale_weights_and_never_drift_or_offset():
    """A small learning rate: stale weights creep up instead of jumping (the issue's 0.01 -> 0.056)."""
    series = [_stat(0.01 + 0.003 * i) for i in range(30)] + [_stat(0.1, mean=-0.09)] * 10
    got, _, _ = _classified(series, {0: _view(3, w=(3, 2, "verified", 2))})  # lagging from the start
    assert got == [(2, "stale_weights")]


def test_a_jump_with_verified_weights_is_a_shift_not_a_sync_page_and_the_level_it_holds_a_drift():
    series = [_stat(0.0005)] * 10 + [_stat(0.2)] * 10
    got, events, _ = _classified(series, {0: _view(5, w=(5, 5, "verified", 0))})
    assert got == [(10, "shift"), (12, "drift")]
    assert events[0].remedy.startswith("not the weight sync") and "weights verified" in events[0].evidence


def test_a_worker_whose_set_is_on_its_way_waits_a_step_then_the_verdict_decides():
    """Step 10 rises while the worker has not verified the latest version yet (pending): no event at 10; at 11
    the worker lags (silent): stale weights, one step late, never a jump or a shift."""
    series = [_stat(0.0005)] * 10 + [_stat(0.2)] * 10
    views = {0: _view(9, w=(9, 9, "verified", 0)), 10: _view(10, w=(9, 9, "verified", 0)),
             11: _view(11, w=(9, 9, "verified", 2))}
    got, _, asked = _classified(series, views)
    assert got == [(11, "stale_weights")] and asked == [10, 11]
    verified_late = {0: _view(9, w=(9, 9, "verified", 0)), 10: _view(10, w=(9, 9, "verified", 0)),
                     11: _view(10, w=(10, 10, "verified", 0))}
    assert _classified(series, verified_late)[0] == [(11, "shift"), (12, "drift")]


def test_a_verdict_that_stays_pending_decides_as_before_after_a_few_steps():
    series = [_stat(0.0005)] * 10 + [_stat(0.2)] * 10
    got, events, _ = _classified(series, {0: _view(10, w=(9, 9, "verified", 0))})
    assert got == [(13, "jump")] and "has not verified weight version 10" in events[0].evidence


def test_a_drift_with_verified_weights_says_so_and_with_no_sync_is_as_before():
    series = [_stat(0.008)] * 6
    got, events, _ = _classified(series, {0: _view(2, w=(2, 2, "verified", 0))})
    assert got == [(2, "drift")] and "weights verified" in events[0].evidence
    assert _classified(series, {0: _view(None)})[0] == [(2, "drift")]
