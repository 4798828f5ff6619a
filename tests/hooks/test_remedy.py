"""Remedies keyed on where the non-finite value was born (issue #17): a precision directive only for a
half-precision attention (or logits) birth in training; an MLP birth, a non-finite weight, a non-finite
query or an eval-stage value never switch training to fp32, whether the differential rerun ran (the CPU
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
from nanwatch.wire import Incident, SiteStat, StepReport

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


def _train(fault, *, rerun: bool, impl: str = "eager", left_pad: int = 0, steps: int = STEPS):
    """A fp16 tiny Qwen3 trained under the local rules; ``fault(model)`` before step K. Returns the
    reports and the mode each step ran in."""
    torch.manual_seed(0)
    model = tiny_qwen3(impl, dtype=torch.float16, vocab_size=64, use_cache=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    reports, modes = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.attach(model, run_id="remedy", optimizer=opt, directive_source="local",
                             rerun=rerun) as mon:
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


@pytest.mark.parametrize("rerun", [True, False], ids=["rerun", "no-rerun"])
def test_a_nan_born_in_an_mlp_never_switches_training_to_fp32(rerun):
    reports, modes = _train(lambda m: _nan_out_of(m.model.layers[0].mlp), rerun=rerun)
    r = reports[K]
    # every site is read every step: the step of the birth names the MLP, not the attention downstream of it
    assert r.first_offender == "model.layers.0.mlp", r.first_offender
    # attention downstream of the birth (layer 1) is non-finite too: the old rule fired on it
    assert any(s.site == "model.layers.1.self_attn" and s.nan for s in r.sites)
    assert set(modes) == {"none"}, modes
    if rerun:
        assert r.incident.birth == "model.layers.0.mlp" and r.incident.birth_kind == "mlp", r.incident


@pytest.mark.parametrize("rerun", [True, False], ids=["rerun", "no-rerun"])
def test_a_nan_weight_never_switches_training_to_fp32(rerun):
    reports, modes = _train(lambda m: _nan_weight(m.model.layers[0].mlp.down_proj), rerun=rerun)
    assert reports[K].first_offender is not None
    assert set(modes) == {"none"}, modes
    if rerun:
        assert reports[K].incident.cls == "data_mask" and reports[K].incident.birth_params == {"weight": 1}


@pytest.mark.parametrize("rerun", [True, False], ids=["rerun", "no-rerun"])
def test_a_half_precision_attention_overflow_still_gets_fp32_at_the_next_step(rerun):
    reports, modes = _train(overflow_attention, rerun=rerun)
    assert reports[K].first_offender == "model.layers.0.self_attn"
    assert modes[K + 1:] == ["fp32"] * (STEPS - K - 1), modes  # the birth's own step is the evidence
    if rerun:
        assert reports[K].incident.birth_kind == "attention" and reports[K].incident.cls == "precision"


def test_left_padding_is_not_blamed_for_a_nan_born_in_an_mlp():
    reports, _ = _train(lambda m: _nan_out_of(m.model.layers[0].mlp), rerun=True, left_pad=8)
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
], ids=["attention", "logits", "fp32-attention", "mlp", "query", "eval", "optimizer", "data-mask",
        "not-reproducible", "optimizer-incident", "mlp-birth", "attention-birth", "no-offender"])
def test_precision_helps_only_a_half_attention_or_logits_birth_in_training(report, helps):
    assert precision_helps(report) is helps
