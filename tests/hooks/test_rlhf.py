"""monitor.rlhf: ratio, KL, clip fraction and advantage health, checked against a host reference."""

from __future__ import annotations

import math

import pytest
import torch

import nanwatch


@pytest.fixture
def mon():
    model = torch.nn.Linear(2, 2)  # rlhf() needs no attention; silence the "no attention" warning
    with pytest.warns(RuntimeWarning):
        m = nanwatch.attach(model, run_id="rlhf")
    yield m
    m.close()


def _batch(seed=0, b=4, t=12):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(b, t, generator=g) * 3 - 0.01
    old = lp + torch.randn(b, t, generator=g) * 0.3
    ref = lp + torch.randn(b, t, generator=g) * 0.5
    adv = torch.randn(b, t, generator=g)
    mask = torch.rand(b, t, generator=g) > 0.25
    return lp, old, ref, adv, mask


def test_stats_match_a_host_reference(mon):
    lp, old, ref, adv, mask = _batch()
    with mon.step(0):
        mon.rlhf(logprobs=lp, old_logprobs=old, ref_logprobs=ref, advantages=adv, mask=mask, clip_eps=0.2)
    r = mon.last_report().rlhf
    m = mask
    ratio = torch.exp(lp - old)[m]
    d = (ref - lp)[m]
    k3 = torch.exp(d) - d - 1
    a = adv[m].double()
    assert r.tokens == int(m.sum())
    assert r.logprob_min == pytest.approx(float(lp[m].min()))
    assert r.ratio_max == pytest.approx(float(ratio.max()), rel=1e-6)
    assert r.clip_fraction == pytest.approx(float(((ratio - 1).abs() > 0.2).double().mean()))
    assert r.kl_k1_mean == pytest.approx(float((-d).double().mean()), rel=1e-5)
    assert r.kl_k1_max == pytest.approx(float((-d).max()), rel=1e-6)
    assert r.kl_k3_mean == pytest.approx(float(k3.double().mean()), rel=1e-5)
    assert r.kl_k3_max == pytest.approx(float(k3.max()), rel=1e-6)
    assert r.advantage_std == pytest.approx(float(a.std(unbiased=False)), rel=1e-6)
    assert all(v == 0 for v in r.nonfinite.values())


def test_nan_is_counted_never_filtered_inside_and_outside_the_mask(mon):
    lp, old, ref, adv, mask = _batch(1)
    lp = lp.clone()
    inside = torch.nonzero(mask)[:3]
    outside = torch.nonzero(~mask)[:2]
    for i, j in inside:
        lp[i, j] = math.nan
    for i, j in outside:
        lp[i, j] = -math.inf
    with mon.step(0):
        mon.rlhf(logprobs=lp, old_logprobs=old, ref_logprobs=ref, mask=mask)
    rep = mon.last_report()
    r = rep.rlhf
    assert r.nonfinite["logprobs"] == 3 and r.nonfinite["logprobs_pad"] == 2
    assert r.nonfinite["old_logprobs"] == 0
    # the stats stay readable over the finite entries ...
    ok = mask & torch.isfinite(lp)
    assert r.logprob_min == pytest.approx(float(lp[ok].min()))
    assert math.isfinite(r.kl_k3_mean)
    # ... and the logprob site itself is the first offender
    assert rep.first_offender == "rlhf.logprobs"
    site = next(s for s in rep.sites if s.site == "rlhf.logprobs")
    assert (site.kind, site.nan, site.inf) == ("logprob", 1, 0)  # one call, holding NaN (elements: above)


def test_several_micro_batches_accumulate(mon):
    parts = [_batch(s) for s in (2, 3)]
    with mon.step(0):
        for lp, _old, ref, _adv, mask in parts:
            mon.rlhf(logprobs=lp, ref_logprobs=ref, mask=mask)
    r = mon.last_report().rlhf
    kls = torch.cat([(lp - ref)[mask] for lp, _old, ref, _adv, mask in parts])
    assert r.tokens == sum(int(p[4].sum()) for p in parts)
    assert r.kl_k1_mean == pytest.approx(float(kls.double().mean()), rel=1e-5)
    assert r.ratio_max is None and r.advantage_std is None  # not given, not invented
