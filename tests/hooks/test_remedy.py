"""Remedies keyed on where the non-finite value was born (issue #17): a precision directive only for a
half-precision attention (or logits) birth in training; an MLP birth, a non-finite weight, a non-finite
query or an eval-stage value never switch training to fp32, whether the differential replay ran (the CPU
default) or not (the GPU default). And the incident blames fully masked rows only where the value was
born in them, not because a left-padded batch has pad rows on every clean step."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from support import overflow_attention, tiny_qwen3, token_ids

import nanwatch
from nanwatch.policy import precision_helps
from nanwatch.wire import Coverage, Incident, SiteStat, StepReport

pytest.importorskip("transformers")

K, STEPS = 2, 6


def _nan_out_of(module) -> None:
    """From now on ``module``'s forward output is NaN: a value born there, in training and eval alike."""
    module.register_forward_hook(lambda m, a, out: out * math.nan, prepend=True)  # before nanwatch reads it


def _nan_weight(module) -> None:
    with torch.no_grad():
        module.weight[0, 0] = math.nan


def _batch(n: int, *, left_pad: int) -> dict:
    ids = token_ids(2, 32, seed=n, vocab=64)
    mask = torch.ones_like(ids)
    mask[1, :left_pad] = 0  # row 1 left-padded, as HF pads decoder-only batches (and GRPO's)
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _train(fault, *, replay: bool, impl: str = "eager", left_pad: int = 0, steps: int = STEPS):
    """A fp16 tiny Qwen3 trained under the local rules; ``fault(model)`` before step K. Returns the
    reports and the mode each step ran in."""
    torch.manual_seed(0)
    model = tiny_qwen3(impl, dtype=torch.float16, vocab_size=64, use_cache=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    reports, modes = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.attach(model, run_id="remedy", optimizer=opt, directive_source="local",
                             rerun=replay) as mon:
            for n in range(steps):
                if n == K:
                    fault(model)
                with mon.step(n):
                    modes.append(mon.directive_state.mode)
                    model(**_batch(n, left_pad=left_pad)).loss.backward()
                    opt.step()
                    opt.zero_grad()
                reports.append(mon.last_report())
    return reports, modes


@pytest.mark.parametrize("replay", [True, False], ids=["replay", "no-replay"])
def test_a_nan_born_in_an_mlp_never_switches_training_to_fp32(replay):
    reports, modes = _train(lambda m: _nan_out_of(m.model.layers[0].mlp), replay=replay)
    r = reports[K]
    # step K reads no coarse site (coarse_every=4): the NaN is first seen downstream, at layer 1's (eager)
    # attention output, which is no evidence of an attention birth; its alarm makes the next steps read them all
    assert r.coverage.coarse_skipped and r.first_offender == "model.layers.1.self_attn", r.first_offender
    named = reports[K + 1]
    assert not named.coverage.coarse_skipped and named.first_offender == "model.layers.0.mlp", named.first_offender
    # attention downstream of the birth (layer 1) is non-finite too: the old rule fired on it
    assert any(s.site == "model.layers.1.self_attn" and s.nan for s in named.sites)
    assert set(modes) == {"none"}, modes
    if replay:
        assert r.incident.birth == "model.layers.0.mlp" and r.incident.birth_kind == "mlp", r.incident


@pytest.mark.parametrize("replay", [True, False], ids=["replay", "no-replay"])
def test_a_nan_weight_never_switches_training_to_fp32(replay):
    reports, modes = _train(lambda m: _nan_weight(m.model.layers[0].mlp.down_proj), replay=replay)
    assert reports[K].first_offender is not None
    assert set(modes) == {"none"}, modes
    if replay:
        assert reports[K].incident.cls == "data_mask" and reports[K].incident.birth_params == {"weight": 1}


@pytest.mark.parametrize("replay", [True, False], ids=["replay", "no-replay"])
def test_a_half_precision_attention_overflow_still_gets_fp32_at_the_next_step(replay):
    reports, modes = _train(overflow_attention, replay=replay)
    assert reports[K].first_offender == "model.layers.0.self_attn"
    if replay:  # the rerun's drill-down finds the birth whatever the step read
        assert modes[K + 1:] == ["fp32"] * (STEPS - K - 1), modes
    else:
        # step K read no coarse site (coarse_every=4): an eager attention module's NaN output may come from
        # upstream, so no directive yet; its alarm makes step K+1 read every site, which names the birth
        assert reports[K].coverage.coarse_skipped and not reports[K + 1].coverage.coarse_skipped
        assert reports[K + 1].first_offender == "model.layers.0.self_attn"
        assert modes[K + 1] == "none" and modes[K + 2:] == ["fp32"] * (STEPS - K - 2), modes
    if replay:
        assert reports[K].incident.birth_kind == "attention" and reports[K].incident.cls == "precision"


def test_left_padding_is_not_blamed_for_a_nan_born_in_an_mlp():
    reports, _ = _train(lambda m: _nan_out_of(m.model.layers[0].mlp), replay=True, left_pad=8)
    # the pad rows are fully masked on the clean steps too: the premise of the old, wrong note
    assert all(f.fully_masked_rows for r in reports[:K] for f in r.fingerprints), reports[0].fingerprints
    inc = reports[K].incident
    assert inc.birth == "model.layers.0.mlp", inc
    assert "masked" not in inc.note, inc.note


def _report(first: str | None, kind: str, *, dtype: str = "float16", stage: str = "train",
            incident: Incident | None = None, phase: str = "forward") -> StepReport:
    site = SiteStat(site=first or "x", kind=kind, phase=phase, stage=stage, dtype=dtype, numel=4, nan=1, inf=0,
                    amax=math.nan, headroom=math.nan)
    return StepReport(run_id="r", incarnation="i", seq=0, step=3, time=0.0, sites=[site], stage=stage,
                      first_offender=first, first_offender_phase=phase, first_offender_stage=stage,
                      incident=incident)


def _skipped(r: StepReport, *, query_finite: bool = False) -> StepReport:
    """``r`` from a step that read no coarse site; with ``query_finite``, the attention call's query read finite."""
    sites = list(r.sites)
    if query_finite:
        sites.append(SiteStat(site=r.first_offender + ".query", kind="attention", phase="forward", stage="train",
                              dtype="float16", numel=4, nan=0, inf=0, amax=1.0, headroom=1.0 / 65504))
    return r.model_copy(update={"coverage": Coverage(coarse_skipped=True), "sites": sites})


@pytest.mark.parametrize(("report", "helps"), [
    (_report("l.0.self_attn", "attention"), True),
    (_report("lm_head", "logits"), True),
    (_report("l.0.self_attn", "attention", dtype="float32"), False),
    (_report("l.0.mlp", "mlp"), False),
    (_report("l.0.self_attn.query", "attention"), False),
    (_report("l.0.self_attn", "attention", stage="eval"), False),
    (_report("l.0.down_proj.weight", "param", phase="optimizer"), False),
    (_report("l.0.self_attn", "attention", incident=Incident(cls="data_mask", step=3)), False),
    (_report("l.0.self_attn", "attention", incident=Incident(cls="not_reproducible", step=3)), False),
    (_report("l.0.self_attn", "attention", incident=Incident(cls="optimizer", step=3, phase="optimizer")), False),
    (_report("l.1.self_attn", "attention", incident=Incident(cls="precision", step=3, birth="l.0.mlp",
                                                                birth_kind="mlp")), False),
    (_report("l.0.self_attn", "attention", incident=Incident(cls="precision", step=3, birth="l.0.self_attn",
                                                                birth_kind="attention")), True),
    (_report(None, "attention"), False),
    (_skipped(_report("l.1.self_attn", "attention")), False),
    (_skipped(_report("lm_head", "logits")), False),
    (_skipped(_report("l.1.self_attn", "attention"), query_finite=True), True),
], ids=["attention", "logits", "fp32-attention", "mlp", "query", "eval", "optimizer", "data-mask",
        "not-reproducible", "optimizer-incident", "mlp-birth", "attention-birth", "no-offender",
        "unread-coarse-attention", "unread-coarse-logits", "unread-coarse-finite-query"])
def test_precision_helps_only_a_half_attention_or_logits_birth_in_training(report, helps):
    assert precision_helps(report) is helps
