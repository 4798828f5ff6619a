"""The two things training stacks turn on by default: autocast and activation checkpointing. Under both,
the SDPA record must describe what ran, the fp32 directive must really run fp32, nothing may be counted
twice, and the logit bound must survive. Also: headroom of a tensor with nothing finite in it."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from support import SMALL, step_reports, tiny_qwen3, token_ids

import nanwatch
from nanwatch.hooks.instrument.patching import ORIGINAL_SDPA
from nanwatch.wire import Directive

LAYERS = ("model.layers.0.self_attn", "model.layers.1.self_attn")


class Attend(torch.nn.Module):
    """Nothing but the attention call, so the test can compare its output with a reference."""

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _attend_under_autocast(mode: str):
    torch.manual_seed(0)
    q, k, v = ((torch.randn(2, 4, 64, 32) * 3).requires_grad_() for _ in range(3))
    model = Attend()
    with nanwatch.attach(model, run_id="ac", is_attention=lambda n, m: isinstance(m, Attend)) as mon:
        if mode != "none":
            mon.directive_state.offer(Directive(run_id="ac", version=1, mode=mode, apply_at_step=0))
        with mon.step(0), torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(q, k, v)
        report = mon.last_report()
    return (q, k, v), out, report


def test_fp32_directive_under_autocast_runs_the_kernel_in_fp32():
    (q, k, v), out, report = _attend_under_autocast("fp32")
    with torch.no_grad():
        fp32 = ORIGINAL_SDPA(q, k, v, is_causal=True)  # the fp32 computation, no autocast
        bf16 = ORIGINAL_SDPA(q.bfloat16(), k.bfloat16(), v.bfloat16(), is_causal=True)
    assert out.dtype == torch.bfloat16  # what autocast hands the caller, as without nanwatch
    assert torch.equal(out, fp32.bfloat16())  # computed in fp32, rounded once at the end
    assert not torch.equal(fp32.bfloat16(), bf16)  # (so the comparison can tell the two paths apart)
    (call,) = report.sdpa
    assert (call.dtype, call.backend, call.confirmed) == ("float32", "cpu_flash", True)
    assert report.attention_mode == "fp32"


def test_without_a_directive_autocast_runs_bf16_and_is_recorded_as_such():
    (q, k, v), out, report = _attend_under_autocast("none")
    with torch.no_grad():
        assert torch.equal(out, ORIGINAL_SDPA(q.bfloat16(), k.bfloat16(), v.bfloat16(), is_causal=True))
    (call,) = report.sdpa
    assert (call.dtype, call.backend, call.predicted, call.confirmed, call.reason) == (
        "bfloat16", "cpu_flash", "cpu_flash", True, None)


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpointing_counts_each_call_once_and_keeps_the_logit_bound(reentrant):
    pytest.importorskip("transformers")
    model = tiny_qwen3("sdpa", **SMALL, use_cache=False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    model.train()
    reports = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.attach(model, run_id="ckpt", exact_logit_every=0,
                             on_report=step_reports(reports)) as mon:
            for n in range(3):
                with mon.step(n):
                    ids = token_ids(seed=n)
                    model(input_ids=ids, labels=ids).loss.backward()
            mon.last_report()
    for r in reports:
        c = r.coverage
        assert (c.attention_calls, c.attention_probed, c.recomputed_calls) == (2, 2, 2), c
        assert [(s.site, s.calls) for s in r.sdpa] == [(layer, 1) for layer in LAYERS]
        # forward measured in the first forward, backward once (reentrant: its hook placed at the re-run)
        calls = {(s.site, s.phase): s.calls for s in r.sites}
        for layer in LAYERS:
            assert calls[(layer, "forward")] == 1 and calls[(layer, "backward")] == 1, calls
        # the logit bound, read from the recomputed kernel's saved log-sum-exp, every step
        assert sorted(lg.layer for lg in r.logits) == sorted(LAYERS)
        assert all(lg.source == "lse" and math.isfinite(lg.bound) for lg in r.logits)
        assert c.unmeasured == [] and r.first_offender is None


def test_the_bound_read_at_the_recompute_is_the_bound_without_checkpointing():
    pytest.importorskip("transformers")
    ids = token_ids(seed=7)
    bounds = []
    for ckpt in (False, True):
        model = tiny_qwen3("sdpa", **SMALL, use_cache=False)
        if ckpt:
            model.gradient_checkpointing_enable()
        model.train()
        with nanwatch.attach(model, run_id="same", exact_logit_every=0) as mon:
            with mon.step(0):
                model(input_ids=ids, labels=ids).loss.backward()
            bounds.append({lg.layer: lg.per_head for lg in mon.last_report().logits})
    assert sorted(bounds[0]) == sorted(bounds[1]) == sorted(LAYERS)
    for layer in LAYERS:
        assert bounds[1][layer] == pytest.approx(bounds[0][layer], rel=1e-6)


def test_headroom_of_a_tensor_with_nothing_finite_is_not_safe():
    model = torch.nn.Linear(2, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mon = nanwatch.attach(model, run_id="headroom")
    with mon, mon.step(0):
        mon.watch("all_nan", torch.full((8,), math.nan))
        mon.watch("has_inf", torch.tensor([1.0, math.inf, 2.0]))
        mon.watch("some_nan", torch.tensor([math.nan, 3.0]))
    sites = {s.site: s for s in mon.last_report().sites}
    assert math.isnan(sites["all_nan"].amax) and math.isnan(sites["all_nan"].headroom)  # was 0.0: "safe"
    assert sites["has_inf"].headroom == math.inf  # an overflow already happened
    # a call that held a NaN has no known finite magnitude: not "safe" either
    assert math.isnan(sites["some_nan"].amax) and math.isnan(sites["some_nan"].headroom)
