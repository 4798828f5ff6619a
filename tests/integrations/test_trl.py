"""TRL's GRPOTrainer with nothing but NanwatchCallback: rlhf health arrives, and a NaN in the reference
model shows up as non-finite ref_logprobs. Tiny Qwen3 and a word-level tokenizer, both built here; TRL's
defaults for the rest (bf16 autocast off on purpose in one run, fused LM head, two iterations, beta > 0)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from support import save_tiny_lm, step_reports

pytest.importorskip("trl")
pytest.importorskip("datasets")

import trl  # noqa: E402

from nanwatch.hooks.integrations.transformers import NanwatchCallback  # noqa: E402
from nanwatch.hooks.integrations.trl import instrument  # noqa: E402


class MyGRPO(trl.GRPOTrainer):
    """What most GRPO users write: a subclass, defined outside TRL's modules."""


def _grpo(tmp_path, *, bf16: bool, poison_ref: bool = False, cls=trl.GRPOTrainer, config=trl.GRPOConfig,
          num_iterations: int = 2, max_steps: int = 2, batch: int = 2, setup=None):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    path = save_tiny_lm(tmp_path / "model")
    tok = PreTrainedTokenizerFast.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    prompts = ["count to three", "say the number five", "one plus two equals", "count to nine"] * 2

    def reward(completions, **kwargs):  # a toy reward: longer is better
        return [float(len(c.split())) for c in completions]

    args = config(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=batch, num_generations=2,
        gradient_accumulation_steps=1, max_completion_length=8, max_steps=max_steps, num_iterations=num_iterations, beta=0.1, report_to="none", logging_steps=1,
        use_cpu=True, bf16=bf16, save_strategy="no", use_vllm=False, learning_rate=1e-3, seed=0,
        disable_tqdm=True)
    reports = []
    trainer = cls(model=model, reward_funcs=reward, args=args, processing_class=tok,
                              train_dataset=Dataset.from_dict({"prompt": prompts}),
                              callbacks=[NanwatchCallback(run_id="grpo", on_report=step_reports(reports))])
    if setup is not None:
        setup(trainer)
    if poison_ref:
        with torch.no_grad():
            trainer.ref_model.model.layers[0].mlp.down_proj.weight[0, 0] = math.nan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    return reports, trainer


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    return _grpo(tmp_path_factory.mktemp("grpo"), bf16=False)


def test_rlhf_stats_arrive_without_a_subclass(clean):
    reports, trainer = clean
    # numbered as HF logs them
    assert [r.step for r in reports] == [1, 2] == [h["step"] for h in trainer.state.log_history if "kl" in h]
    for r in reports:
        assert r.first_offender is None
        s = r.rlhf
        assert s is not None and s.tokens > 0
        assert all(v == 0 for v in s.nonfinite.values()) and {"logprobs", "ref_logprobs", "old_logprobs"} <= set(
            s.nonfinite)
        assert s.logprob_min is not None and s.logprob_min < 0 and s.advantage_std is not None
    # the KL TRL optimises (k3 weighted by the importance ratio) is labelled, and it is TRL's own figure
    logged = [h["kl"] for h in trainer.state.log_history if "kl" in h]
    assert [r.rlhf.kl_optimised for r in reports] == ["k3_ratio", "k3_ratio"]
    assert [r.rlhf.kl_k3_ratio_mean for r in reports] == pytest.approx(logged, rel=1e-3, abs=1e-6)
    # the second iteration reuses the first's generations: old logprobs exist, so ratios are measured
    assert all(r.rlhf.ratio_max is not None and math.isfinite(r.rlhf.ratio_max) for r in reports)


def test_generation_is_its_own_stage_and_the_fused_head_is_said(clean):
    reports, _ = clean
    first = reports[0]
    assert {s.stage for s in first.sites} == {"train", "generate"}
    assert ("lm_head", "forward", "generate") in {(s.site, s.phase, s.stage) for s in first.sites}
    # TRL's fused LM head never calls lm_head in training: its log_probs are measured instead, and said
    train_sites = {(s.site, s.phase) for s in first.sites if s.stage == "train"}
    assert {("lm_head.log_probs", "forward"), ("lm_head.log_probs", "backward")} <= train_sites
    assert ("lm_head", "forward") not in train_sites
    assert first.coverage.logits and "no_logits" not in first.coverage.unmeasured
    assert any("ran fused" in w for w in first.warnings)


def test_a_nan_in_the_reference_model_shows_as_ref_logprobs(tmp_path):
    reports, _ = _grpo(tmp_path, bf16=True, poison_ref=True)
    s = reports[0].rlhf
    assert s.nonfinite["ref_logprobs"] == s.tokens > 0
    assert s.nonfinite["logprobs"] == 0  # the policy itself was fine at that point
    assert s.kl_k3_mean is None  # every KL term was non-finite: no figure, rather than a filtered one


def test_the_adapter_refuses_a_trl_it_does_not_know(monkeypatch):
    class FakeMonitor:
        def rlhf(self, **kwargs):
            raise AssertionError("must not be wired")

    trainer = trl.GRPOTrainer.__new__(trl.GRPOTrainer)
    monkeypatch.setattr(trl, "__version__", "9.0.0")
    with pytest.warns(RuntimeWarning, match="TRL adapter is off"):
        assert instrument(trainer, FakeMonitor()) is None
    monkeypatch.setattr(trl, "__version__", "1.16.0")
    monkeypatch.setattr(trl.GRPOTrainer, "_compute_loss", lambda self, model, batch: None)
    with pytest.warns(RuntimeWarning, match="_compute_loss is not"):
        assert instrument(trainer, FakeMonitor()) is None
    assert instrument(object(), FakeMonitor()) is None  # not a GRPOTrainer: left alone, silently
    other = trl.SFTTrainer.__new__(trl.SFTTrainer)  # a TRL trainer the adapter does not cover: said so
    with pytest.warns(RuntimeWarning, match="TRL's SFTTrainer, and the adapter covers GRPOTrainer and RLOOTrainer and their subclasses"):
        assert instrument(other, FakeMonitor()) is None


def test_a_subclass_of_grpo_trainer_gets_the_same_stats(tmp_path):
    reports, trainer = _grpo(tmp_path, bf16=False, cls=MyGRPO)
    assert type(trainer) is MyGRPO and [r.step for r in reports] == [1, 2]
    assert all(r.rlhf is not None and r.rlhf.tokens > 0 and r.rlhf.kl_optimised == "k3_ratio" for r in reports)


class MyRLOO(trl.RLOOTrainer):
    """A user's RLOO subclass."""


def test_rloo_gets_logprob_and_advantage_health_and_no_made_up_kl(tmp_path):
    """RLOO's loss reads per-sequence old logprobs and puts the KL in the reward: the report carries what
    its tensors allow (logprobs, advantages, non-finite counts) and no KL label (none is in the loss)."""
    reports, trainer = _grpo(tmp_path, bf16=False, cls=MyRLOO, config=trl.RLOOConfig)
    assert type(trainer) is MyRLOO and len(reports) == 2
    for r in reports:
        s = r.rlhf
        assert s is not None and s.tokens > 0 and {"logprobs", "advantages"} <= set(s.nonfinite), s
        assert not any(s.nonfinite.values()) and "old_logprobs" not in s.nonfinite and "ref_logprobs" not in s.nonfinite
        assert s.logprob_min is not None and s.logprob_min < 0 and s.advantage_std is not None
        assert s.kl_optimised is None and s.ratio_max is None


# ---- vLLM mode: the rollout's own logprobs ------------------------------------------------------------------
class _VllmMode:
    """TRL's vLLM mode without vLLM (it does not run on the CPU): TRL's own HF generation draws the tokens,
    and a bf16 copy of the policy, synced before each generation as vLLM's weights are, scores them as vLLM's
    sampler would return them (a flat list per sequence, ``None`` where vLLM has no logprob). Everything after
    that is TRL's own code with ``use_vllm`` on: ``_generate_and_score_completions`` builds
    ``sampling_per_token_logps``, ``old_per_token_logps`` and the importance-sampling ratio, ``_compute_loss``
    applies it. Generations before ``from_call`` stay in plain HF mode (no rollout logprobs)."""

    def __init__(self, trainer, *, from_call: int, nan_call: int | None = None) -> None:
        self.trainer, self.from_call, self.nan_call, self.calls = trainer, from_call, nan_call, 0
        # built anew, not deep-copied: TRL's fused LM head patches the policy's forward with closures over it
        self.rollout = type(trainer.model)(trainer.model.config).to(torch.bfloat16).eval()
        self.seen: list[tuple[torch.Tensor, dict]] = []  # (the loss forward's logprobs, the loss's inputs)
        generate, get_logps, compute_loss = (trainer._generate_single_turn, trainer._get_per_token_logps_and_entropies,
                                             trainer._compute_loss)

        def generate_single_turn(prompt_ids, *args, **kwargs):
            trainer.use_vllm = False  # TRL's HF path draws the tokens
            completion_ids, _ = generate(prompt_ids, *args, **kwargs)
            self.calls += 1
            if self.calls < self.from_call:
                return completion_ids, None
            trainer.use_vllm = True  # the rest of the step is TRL's vLLM mode
            return completion_ids, self._logprobs(prompt_ids, completion_ids)

        def logps(*args, **kwargs):
            out = get_logps(*args, **kwargs)
            if kwargs.get("compute_entropy"):
                self.lp = out[0].detach().clone()
            return out

        def loss(model, inputs):
            value = compute_loss(model, inputs)
            self.seen.append((self.lp, dict(inputs)))
            return value

        trainer._generate_single_turn, trainer._get_per_token_logps_and_entropies = generate_single_turn, logps
        trainer._compute_loss = loss

    @torch.no_grad()
    def _logprobs(self, prompt_ids, completion_ids) -> list[list[float | None]]:
        self.rollout.load_state_dict(self.trainer.model.state_dict())  # the weight sync
        out = []
        for p, c in zip(prompt_ids, completion_ids, strict=True):
            logits = self.rollout(torch.tensor([p + c])).logits[0, len(p) - 1:-1].float()
            out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(c)[:, None]).squeeze(-1).tolist())
        if self.calls == self.nan_call:
            out[0][0] = None  # a token vLLM returned no finite logprob for (TRL turns it into NaN)
        return out


def _direct(lp: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """The rollout figures computed here, in float64, from the tensors the loss saw."""
    lp, rollout = lp.double(), rollout.double()
    ok = mask.bool() & torch.isfinite(lp) & torch.isfinite(rollout)
    d = lp - rollout
    dd, x, y = d[ok], lp[ok], rollout[ok]
    seq = torch.where(ok, d, 0.0).sum(1)[ok.any(1)]
    px, py = x.exp(), y.exp()
    return dict(tokens=int(ok.sum()), abs_mean=float(dd.abs().mean()), abs_max=float(dd.abs().max()),
                mean=float(dd.mean()), rms=float(dd.pow(2).mean().sqrt()), k3_mean=float((dd.expm1() - dd).mean()),
                truncated_fraction=float((dd.abs() > math.log(3.0)).double().mean()),
                prob_correlation=float(torch.corrcoef(torch.stack([px, py]))[0, 1]),
                logprob_slope=float(((x - x.mean()) * (y - y.mean())).sum() / (x - x.mean()).pow(2).sum()),
                seq_ratio_max=float(seq.max().exp()), seq_ratio_min=float(seq.min().exp()),
                p99=float(torch.quantile(dd.abs(), 0.99)))


def test_vllm_modes_sampling_logprobs_are_the_rollout_logprobs(tmp_path, monkeypatch):
    """A generation in plain HF mode feeds no rollout logprobs (nothing changes); in vLLM mode TRL's
    ``sampling_per_token_logps`` become ``rollout_logprobs`` with TRL's cap and the sequences, and the report's
    rollout figures are the ones computed directly from the loss's own tensors. vLLM itself was not run."""
    from nanwatch.hooks.facade import Monitor

    calls: list[dict] = []
    rlhf = Monitor.rlhf

    def spy(self, **kwargs):
        calls.append(kwargs)
        return rlhf(self, **kwargs)

    monkeypatch.setattr(Monitor, "rlhf", spy)
    vllm: list[_VllmMode] = []
    reports, trainer = _grpo(tmp_path, bf16=False, num_iterations=1, max_steps=3, batch=4,
                             setup=lambda t: vllm.append(_VllmMode(t, from_call=2, nan_call=3)))
    seen = vllm[0].seen
    assert [r.step for r in reports] == [1, 2, 3] and len(seen) == len(calls) == 3
    # step 1, plain HF mode: no rollout logprobs, so Monitor.rlhf is called as before and nothing is measured
    assert "sampling_per_token_logps" not in seen[0][1]
    assert not {"rollout_logprobs", "rollout_cap", "input_ids", "attention_mask"} & set(calls[0])
    assert reports[0].rlhf.rollout is None and "rollout_logprobs" not in reports[0].rlhf.nonfinite
    rows = {h["step"]: h for h in trainer.state.log_history if "loss" in h}
    assert not [k for k in rows[1] if k.startswith("nanwatch/rollout")]
    nonfinite = 0
    for report, (lp, inputs), call in zip(reports[1:], seen[1:], calls[1:], strict=True):
        # what the adapter passed: TRL's tensors, TRL's cap (3.0, not nanwatch's 2.0), TRL's concatenation
        assert call["rollout_logprobs"] is inputs["sampling_per_token_logps"] and call["rollout_cap"] == 3.0
        assert torch.equal(call["input_ids"], torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1))
        assert torch.equal(call["attention_mask"], torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1))
        s, want = report.rlhf.rollout, _direct(lp, inputs["sampling_per_token_logps"], inputs["completion_mask"])
        assert s is not None and s.cap == pytest.approx(3.0) and s.tokens == want["tokens"] > 0 and s.sequences == 4
        for name in ("abs_mean", "abs_max", "mean", "rms", "k3_mean", "truncated_fraction", "prob_correlation",
                     "logprob_slope", "seq_ratio_max", "seq_ratio_min"):
            assert getattr(s, name) == pytest.approx(want[name], rel=1e-4, abs=1e-7), name
        assert want["p99"] / 1.34 <= s.abs_p99 <= s.abs_max  # the histogram's estimate, within one bin
        assert s.abs_mean > 1e-4  # the bf16 rollout copy really differs from the fp32 trainer
        # the NaN vLLM returned is counted, not hidden (TRL neutralises it in its importance ratio)
        bad = int((~torch.isfinite(inputs["sampling_per_token_logps"]) & inputs["completion_mask"].bool()).sum())
        assert report.rlhf.nonfinite["rollout_logprobs"] == bad == (report.step == 3)
        nonfinite += bad
        # TRL's own figure (measured against its no-grad forward of the same weights) agrees
        row = rows[report.step]
        assert row["sampling/sampling_logp_difference/mean"] == pytest.approx(s.abs_mean, rel=1e-3)
        # and the Trainer's log row carries the figures
        assert row["nanwatch/rollout_abs_mean"] == pytest.approx(s.abs_mean)
        assert row["nanwatch/rollout_k3"] == pytest.approx(s.k3_mean)
        assert row["nanwatch/rollout_abs_p99"] == pytest.approx(s.abs_p99)
        assert row["nanwatch/rollout_truncated_fraction"] == pytest.approx(s.truncated_fraction)
        assert row["nanwatch/rollout_prob_correlation"] == pytest.approx(s.prob_correlation)
        assert row["nanwatch/rollout_logprob_slope"] == pytest.approx(s.logprob_slope)
        assert row["nanwatch/rollout_nonfinite"] == nonfinite
