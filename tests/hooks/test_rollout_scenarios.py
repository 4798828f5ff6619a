"""The rollout mismatch on a real loop: a tiny Qwen3 trained in fp32 (a GRPO-shaped policy-gradient step)
while a separate copy, driven on its own thread as a rollout engine's worker would be, samples the completions
with ``generate(output_scores=True)`` and hands back its logprobs of the tokens it drew. Each test breaks the
rollout side the way users reported it, and checks what nanwatch measures and how it classifies it."""

from __future__ import annotations

import warnings

import pytest
import torch
from support import RolloutEngine, grpo_step, rollout_policy

import nanwatch

pytestmark = pytest.mark.slow
pytest.importorskip("transformers")

NEW, BATCH = RolloutEngine.NEW, RolloutEngine.BATCH


@pytest.fixture(autouse=True)
def _capsules_in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # an attribution writes its capsule under ./nanwatch-capsules


def _run(engine: RolloutEngine, policy: torch.nn.Module, steps: int, *, sync_until: int | None = None,
         lr: float = 1e-4, agree: list | None = None, temperature_from: tuple[int, float] | None = None):
    """Train ``steps`` GRPO-shaped steps on the engine's samples; the weights are synced before every step
    below ``sync_until`` (None: always); ``agree`` gets, per step, whether the engine's weight fingerprints
    equal the trainer's when it samples; ``temperature_from`` (step, T): the engine's sampler alone switches
    to temperature T from that step. Returns the reports."""
    opt = torch.optim.AdamW(policy.parameters(), lr=lr)
    reports = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the drift/jump log lines are the point here
        mon = nanwatch.attach(policy, run_id="rollout-loop", optimizer=opt)
    try:
        for step in range(steps):
            if sync_until is None or step < sync_until:
                engine.sync(policy)
            if agree is not None:
                agree.append(nanwatch.fingerprint(engine.model) == nanwatch.fingerprint(policy))
            if temperature_from is not None and step == temperature_from[0]:
                engine.temperature = temperature_from[1]
            sequences, rollout = engine.sample(step)
            grpo_step(mon, policy, opt, step, sequences, rollout)
            reports.append(mon.last_report())
    finally:
        mon.close()
        engine.close()
    return reports


def _events(reports) -> list[tuple[int, str]]:
    assert {r.attention_mode for r in reports} == {"none"}  # no cause of a rollout mismatch is the attention's
    return [(r.step, e.cause) for r in reports for e in r.rollout_events]


def test_a_healthy_rollout_raises_no_event_in_200_steps():
    policy = rollout_policy()
    reports = _run(RolloutEngine(policy), policy, 200)
    assert _events(reports) == []
    assert all(r.rlhf.rollout.tokens == BATCH * NEW for r in reports)
    assert max(r.rlhf.rollout.abs_max for r in reports) < 1e-4  # KV cache against a full forward, fp32


def _attribution(reports):
    found = [r.rollout_attribution for r in reports if r.rollout_attribution is not None]
    assert len(found) == 1, found  # once per run
    return found[0]


def test_a_bf16_rollout_engine_is_a_drift_attributed_to_a_lowered_module():
    policy = rollout_policy()
    reports = _run(RolloutEngine(policy, dtype=torch.bfloat16), policy, 6)
    assert _events(reports) == [(2, "drift")]
    drift = reports[2].rollout_events[0]
    assert drift.figures["abs_mean"] > 1e-3 and abs(drift.figures["logprob_slope"] - 1) < 0.1
    found = _attribution(reports)
    assert (found.cause, found.step, found.rollout_dtype) == ("drift", 2, "bfloat16")
    assert found.module is not None and found.modules  # every module of this engine is low-precision
    assert found.observed_abs_mean / 3 < found.lowered_abs_mean < found.observed_abs_mean * 3


def test_only_lm_head_in_bf16_names_lm_head():
    policy = rollout_policy()
    reports = _run(RolloutEngine(policy, lowered=("lm_head",)), policy, 6)
    assert _events(reports) == [(2, "drift")]
    assert _attribution(reports).module == "lm_head"


@pytest.mark.parametrize("lr", [1e-3, 3e-3])
def test_weights_no_longer_synced_from_step_k_is_a_jump_at_k_plus_1_and_never_a_drift_or_offset(lr):
    """#36: stale weights became a drift three steps after the jump (1e-3), or an offset (3e-3), and the drift
    got a module attributed: the rising mismatch of stale weights stays the jump's, however long it lasts."""
    policy, k, steps = rollout_policy(), 6, 16
    agree: list[bool] = []
    reports = _run(RolloutEngine(policy), policy, steps, sync_until=k + 1, lr=lr, agree=agree)
    assert _events(reports) == [(k + 1, "jump")]
    jump = reports[k + 1].rollout_events[0]
    assert jump.figures["factor"] > 100 and "weight sync" in jump.remedy
    assert all(r.rollout_attribution is None for r in reports)
    assert agree == [True] * (k + 1) + [False] * (steps - k - 1)  # the weight fingerprints say why


def test_a_temperature_switched_on_by_the_sampler_mid_run_is_an_offset_never_a_jump():
    """#36: the rollout switches to T=0.7 at step 6 while the trainer keeps 1.0: it paged as a weight-sync jump
    at step 6, and the right offset came two steps later. A line of slope 1/T explains it: an offset only."""
    policy = rollout_policy()
    reports = _run(RolloutEngine(policy), policy, 10, temperature_from=(6, 0.7))
    assert _events(reports) == [(8, "offset")]
    offset = reports[8].rollout_events[0]
    assert offset.figures["logprob_slope"] > 1.1 and "temperature" in offset.evidence, offset.evidence


def test_a_temperature_applied_by_the_sampler_alone_is_an_offset():
    policy = rollout_policy()
    reports = _run(RolloutEngine(policy, temperature=0.7), policy, 6)
    assert _events(reports) == [(2, "offset")]
    offset = reports[2].rollout_events[0]
    assert offset.figures["logprob_slope"] > 1.2 and "temperature" in offset.evidence


def test_a_nan_in_the_samplers_logprobs_is_counted_and_not_hidden():
    policy = rollout_policy()
    engine = RolloutEngine(policy)
    engine.nan_at = 3
    reports = _run(engine, policy, 5)
    counts = [r.rlhf.nonfinite["rollout_logprobs"] for r in reports]
    assert counts == [0, 0, 0, 1, 0]
    assert reports[3].rlhf.rollout.tokens == BATCH * NEW - 1  # left out of the figures, and said so
    assert _events(reports) == []
