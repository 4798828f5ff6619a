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


def _grpo(tmp_path, *, bf16: bool, poison_ref: bool = False, cls=trl.GRPOTrainer, config=trl.GRPOConfig):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    path = save_tiny_lm(tmp_path / "model")
    tok = PreTrainedTokenizerFast.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    prompts = ["count to three", "say the number five", "one plus two equals", "count to nine"] * 2

    def reward(completions, **kwargs):  # a toy reward: longer is better
        return [float(len(c.split())) for c in completions]

    args = config(
        output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, num_generations=2, gradient_accumulation_steps=1,
        max_completion_length=8, max_steps=2, num_iterations=2, beta=0.1, report_to="none", logging_steps=1,
        use_cpu=True, bf16=bf16, save_strategy="no", use_vllm=False, learning_rate=1e-3, seed=0,
        disable_tqdm=True)
    reports = []
    trainer = cls(model=model, reward_funcs=reward, args=args, processing_class=tok,
                              train_dataset=Dataset.from_dict({"prompt": prompts}),
                              callbacks=[NanwatchCallback(run_id="grpo", on_report=step_reports(reports))])
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
