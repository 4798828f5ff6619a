"""The rollout mismatch on a real loop: a tiny Qwen3 trained in fp32 (a GRPO-shaped policy-gradient step)
while a separate copy, driven on its own thread as a rollout engine's worker would be, samples the completions
with ``generate(output_scores=True)`` and hands back its logprobs of the tokens it drew. Each test breaks the
rollout side the way users reported it, and checks what nanwatch measures and how it classifies it."""

from __future__ import annotations

import copy
import math
import warnings
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import nanwatch

pytestmark = pytest.mark.slow
pytest.importorskip("transformers")

PROMPT, NEW, BATCH = 4, 4, 4


@pytest.fixture(autouse=True)
def _capsules_in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # an attribution writes its capsule under ./nanwatch-capsules


def _policy(seed: int = 0) -> torch.nn.Module:
    from nanwatch.bench.tiny_models import tiny_qwen3

    model = tiny_qwen3("sdpa", seed=seed, tie_word_embeddings=False)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # peaked next-token distributions, as a trained model's are
    return model


class RolloutEngine:
    """The rollout side: its own copy of the policy, on its own thread. ``dtype`` and ``lowered`` (module
    names) set its precision; ``temperature`` is applied by its sampler only."""

    def __init__(self, policy: torch.nn.Module, *, dtype: torch.dtype | None = None, lowered: tuple[str, ...] = (),
                 temperature: float = 1.0) -> None:
        self.model = copy.deepcopy(policy).eval()
        if dtype is not None:
            self.model.to(dtype)
        for name in lowered:
            module = self.model.get_submodule(name).to(torch.bfloat16)
            module.register_forward_pre_hook(lambda m, a: tuple(x.to(torch.bfloat16) for x in a))
            module.register_forward_hook(lambda m, a, out: out.float())
        self.temperature = temperature
        self.nan_at: int | None = None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-engine")

    def sync(self, policy: torch.nn.Module) -> None:
        """A weight sync: the trainer's weights, cast to the engine's dtypes."""
        state = {k: v.detach().clone() for k, v in policy.state_dict().items()}
        self._thread.submit(self.model.load_state_dict, state).result()

    def sample(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._thread.submit(self._sample, step).result()

    @torch.no_grad()
    def _sample(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1000 + step)
        prompts = torch.randint(1, self.model.config.vocab_size, (BATCH, PROMPT), generator=g)
        torch.manual_seed(step)
        out = self.model.generate(prompts, do_sample=True, max_new_tokens=NEW, temperature=self.temperature,
                                  top_k=0, top_p=1.0, output_scores=True, return_dict_in_generate=True,
                                  pad_token_id=0, eos_token_id=None)
        logprobs = nanwatch.hooks.rollout_logprobs(out).processed  # of the distribution the sampler drew from
        if step == self.nan_at:
            logprobs[1, 2] = math.nan  # a sampler NaN: TRL PR #6693 would neutralise it
        return out.sequences, logprobs

    def close(self) -> None:
        self._thread.shutdown()


def _run(engine: RolloutEngine, policy: torch.nn.Module, steps: int, *, sync_until: int | None = None,
         lr: float = 1e-4):
    """Train ``steps`` GRPO-shaped steps on the engine's samples; the weights are synced before every step
    below ``sync_until`` (None: always). Returns the reports."""
    opt = torch.optim.AdamW(policy.parameters(), lr=lr)
    reports = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the drift/jump log lines are the point here
        mon = nanwatch.attach(policy, run_id="rollout-loop", optimizer=opt)
    try:
        for step in range(steps):
            if sync_until is None or step < sync_until:
                engine.sync(policy)
            sequences, rollout = engine.sample(step)
            with mon.step(step):
                logits = policy(sequences).logits[:, -NEW - 1:-1].float()
                logprobs = logits.log_softmax(-1).gather(-1, sequences[:, -NEW:, None]).squeeze(-1)
                rewards = torch.randn(BATCH, generator=torch.Generator().manual_seed(step))
                advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-4)
                mon.rlhf(logprobs=logprobs, rollout_logprobs=rollout, advantages=advantages, input_ids=sequences)
                (-(advantages[:, None] * logprobs).mean()).backward()
                opt.step()
                opt.zero_grad()
            reports.append(mon.last_report())
    finally:
        mon.close()
        engine.close()
    return reports


def _events(reports) -> list[tuple[int, str]]:
    return [(r.step, e.cause) for r in reports for e in r.rollout_events]


def test_a_healthy_rollout_raises_no_event_in_200_steps():
    policy = _policy()
    reports = _run(RolloutEngine(policy), policy, 200)
    assert _events(reports) == []
    assert all(r.rlhf.rollout.tokens == BATCH * NEW for r in reports)
    assert max(r.rlhf.rollout.abs_max for r in reports) < 1e-4  # KV cache against a full forward, fp32


def _attribution(reports):
    found = [r.rollout_attribution for r in reports if r.rollout_attribution is not None]
    assert len(found) == 1, found  # once per run
    return found[0]


def test_a_bf16_rollout_engine_is_a_drift_attributed_to_a_lowered_module():
    policy = _policy()
    reports = _run(RolloutEngine(policy, dtype=torch.bfloat16), policy, 6)
    assert _events(reports) == [(2, "drift")]
    drift = reports[2].rollout_events[0]
    assert drift.figures["abs_mean"] > 1e-3 and abs(drift.figures["logprob_slope"] - 1) < 0.1
    found = _attribution(reports)
    assert (found.cause, found.step, found.rollout_dtype) == ("drift", 2, "bfloat16")
    assert found.module is not None and found.modules  # every module of this engine is low-precision
    assert found.observed_abs_mean / 3 < found.lowered_abs_mean < found.observed_abs_mean * 3


def test_only_lm_head_in_bf16_names_lm_head():
    policy = _policy()
    reports = _run(RolloutEngine(policy, lowered=("lm_head",)), policy, 6)
    assert _events(reports) == [(2, "drift")]
    assert _attribution(reports).module == "lm_head"


def test_weights_no_longer_synced_from_step_k_is_a_jump_at_k_plus_1():
    policy, k = _policy(), 6
    reports = _run(RolloutEngine(policy), policy, 10, sync_until=k + 1, lr=1e-3)
    assert _events(reports) == [(k + 1, "jump")]
    jump = reports[k + 1].rollout_events[0]
    assert jump.figures["factor"] > 100 and "weight sync" in jump.remedy


def test_a_temperature_applied_by_the_sampler_alone_is_an_offset():
    policy = _policy()
    reports = _run(RolloutEngine(policy, temperature=0.7), policy, 6)
    assert _events(reports) == [(2, "offset")]
    offset = reports[2].rollout_events[0]
    assert offset.figures["logprob_slope"] > 1.2 and "temperature" in offset.evidence


def test_a_nan_in_the_samplers_logprobs_is_counted_and_not_hidden():
    policy = _policy()
    engine = RolloutEngine(policy)
    engine.nan_at = 3
    reports = _run(engine, policy, 5)
    counts = [r.rlhf.nonfinite["rollout_logprobs"] for r in reports]
    assert counts == [0, 0, 0, 1, 0]
    assert reports[3].rlhf.rollout.tokens == BATCH * NEW - 1  # left out of the figures, and said so
    assert _events(reports) == []
