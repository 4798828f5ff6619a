"""Rollout attribution (issue #28, part 4): a tiny Qwen3 trainer in fp32, a separate copy as the rollout
engine whose logprobs come from ``generate(output_scores=True)``, and the module whose precision explains
the mismatch named by re-running the worst sequences with one unit lowered at a time.

The trainer's first block has its q/k norms scaled by 4 (larger attention logits: the rounding of q and k
to bf16 then moves the attention weights, as RMSNorm casting to bf16 did in verl-omni #637), so that one
unit is decisively first whatever the CPU's kernels: measured on the 2-core AMD EPYC VM, with AVX-512 and
with ``ATEN_CPU_CAPABILITY=avx2`` alike, ``model.layers.0`` has share 0.97 (the next unit 0.38) and its
``self_attn`` 0.74 (the next child 0.50).

| rollout copy                       | named                                   | how                      |
|------------------------------------|-----------------------------------------|--------------------------|
| entirely bf16                      | ``model.layers.0`` or its ``self_attn`` | share >= 0.5             |
| only ``lm_head`` bf16              | ``lm_head`` (its share alone is 0.2)     | token by token (1.00)    |
| the model after the attribution    | parameters, buffers, grads, RNG, flags bit-identical; the next step too |
| the capsule (tied lm_head), in a fresh process | the same module              | ``nanwatch replay``      |
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support import tiny_qwen3

from nanwatch.cli.replay_verdict import main as replay_main
from nanwatch.hooks.forensics.capsule import CapsuleWriter
from nanwatch.hooks.rollout.attribution import RolloutAttributor, attribute_mismatch, units_of

pytest.importorskip("transformers")

B, P, C = 8, 8, 24


def _trainer(**config) -> torch.nn.Module:
    model = tiny_qwen3("sdpa", seed=0, **config)
    with torch.no_grad():
        attn = model.model.layers[0].self_attn
        attn.q_norm.weight.mul_(4.0)
        attn.k_norm.weight.mul_(4.0)
    return model


def _lowered(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """``module`` alone computes in ``dtype`` inside an otherwise fp32 copy (as a rollout engine keeping some
    modules in fp32 and the rest in bf16 does)."""
    module.to(dtype)
    module.register_forward_pre_hook(lambda m, args: tuple(a.to(dtype) if a.is_floating_point() else a
                                                           for a in args))
    module.register_forward_hook(lambda m, args, out: out.float())


def _rollout(trainer: torch.nn.Module, only: str | None, *, stale: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(sequences ``[B, P + C]``, the sampler's logprobs of the completion ``[B, C]``) from a separate copy
    of the trainer: entirely bf16 (``only=None``) or with module ``only`` in bf16; ``stale``: its weights
    moved by noise of that size (weights the trainer no longer holds: a sync that did not happen)."""
    engine = copy.deepcopy(trainer).eval()
    if stale:
        with torch.no_grad():
            gen = torch.Generator().manual_seed(3)
            for p in engine.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * stale)
    if only is None:
        engine.to(torch.bfloat16)
    else:
        _lowered(engine.get_submodule(only), torch.bfloat16)
    prompt = torch.randint(0, 128, (B, P), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(2)
    out = engine.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=C, min_new_tokens=C,
                          do_sample=True, top_k=0, top_p=1.0, output_scores=True, return_dict_in_generate=True,
                          pad_token_id=0, eos_token_id=None)
    scores = torch.stack(out.scores, dim=1).float()
    logprobs = torch.log_softmax(scores, dim=-1).gather(-1, out.sequences[:, -C:, None]).squeeze(-1)
    return out.sequences, logprobs


def test_a_bf16_rollout_is_attributed_to_the_block_made_sensitive_and_its_size_matches():
    trainer = _trainer()
    ids, rollout = _rollout(trainer, None)
    a = attribute_mismatch(trainer, ids, rollout, rollout_dtype=torch.bfloat16, cause="drift", step=7)
    assert a.module in ("model.layers.0", "model.layers.0.self_attn"), a
    assert a.sequences == B and a.step == 7 and a.cause == "drift" and a.rollout_dtype == "bfloat16"
    assert a.observed_abs_mean > 0 and a.lowered_abs_mean > 0
    assert a.lowered_abs_mean / 3 < a.observed_abs_mean < 3 * a.lowered_abs_mean, a
    shares = {m.module: m.share for m in a.modules}
    assert shares["model.layers.0"] == max(shares[n] for n, _ in units_of(trainer))
    assert {"model.embed_tokens", "model.layers.1", "model.norm", "lm_head", "model.layers.0.mlp"} <= set(shares)
    assert a.seconds > 0


def test_b_only_lm_head_in_bf16_names_lm_head():
    trainer = _trainer()
    ids, rollout = _rollout(trainer, "lm_head")
    a = attribute_mismatch(trainer, ids, rollout)
    assert a.module == "lm_head", a
    # by size alone the first block would be named: the rollout's own Δlogp, token by token, names lm_head
    assert {m.module: m.share for m in a.modules}["lm_head"] < 0.5
    assert "token by token" in a.note


def test_stale_weights_are_not_attributed_to_a_module():
    """#36: with weights the trainer no longer holds, lowering every module explains a sliver of the mismatch;
    the attribution is withheld, and its note leads with the share explained."""
    trainer = _trainer()
    ids, rollout = _rollout(trainer, None, stale=0.05)
    a = attribute_mismatch(trainer, ids, rollout, rollout_dtype=torch.bfloat16, cause="drift", step=9)
    assert a.lowered_abs_mean < 0.5 * a.observed_abs_mean, a
    assert a.module is None and a.note.startswith("withheld: lowering every module to bfloat16 explains "), a.note
    assert a.modules  # the shares are still there to read


def _state(model: torch.nn.Module) -> dict:
    return {"tensors": {n: (t.dtype, t.data_ptr(), t.detach().clone())
                        for n, t in [*model.named_parameters(), *model.named_buffers()]},
            "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
            "training": [m.training for m in model.modules()], "rng": torch.get_rng_state()}


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> None:
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def test_c_the_model_is_bit_identical_after_and_the_training_step_sees_nothing():
    trainer = _trainer()
    ids, rollout = _rollout(trainer, None)
    twin = copy.deepcopy(trainer)
    trainer.train()
    trainer.model.layers[1].eval()  # mixed flags: each module's own is restored
    trainer(input_ids=ids, labels=ids).loss.backward()  # gradients in place, as mid-accumulation
    before = _state(trainer)
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    a = attribute_mismatch(trainer, ids, rollout)
    assert a.module is not None
    after = _state(trainer)
    assert torch.equal(torch.get_rng_state(), rng)
    assert after["training"] == before["training"]
    for n, (dtype, ptr, t) in before["tensors"].items():
        d2, p2, t2 = after["tensors"][n]
        assert (dtype, ptr) == (d2, p2) and torch.equal(t.view(torch.uint8), t2.view(torch.uint8)), n
    assert before["grads"].keys() == after["grads"].keys()
    assert all(torch.equal(g, after["grads"][n]) for n, g in before["grads"].items())
    # the next training steps, with and without the attribution before them, are the same bit for bit
    trainer.zero_grad()
    for model in (trainer, twin):
        model.train()
        model.zero_grad()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (trainer, twin)]
    for n in range(2):
        torch.manual_seed(n)
        _step(trainer, opts[0], ids)
        torch.manual_seed(n)
        _step(twin, opts[1], ids)
    for (n, p), q in zip(trainer.named_parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q), n


def test_a_sharded_model_is_refused_without_a_forward(monkeypatch):
    trainer = _trainer()
    ids, rollout = _rollout(trainer, "lm_head")
    calls = []
    trainer.register_forward_pre_hook(lambda m, a: calls.append(1))
    monkeypatch.setattr("nanwatch.hooks.rollout.attribution.collective_forward",
                        lambda m: "FSDP2 (fully_shard) all-gathers parameters in every forward")
    a = attribute_mismatch(trainer, ids, rollout)
    assert a.module is None and a.lowered_abs_mean is None and "FSDP2" in a.note and "hang" in a.note
    assert calls == []


def test_the_attributor_runs_once_on_request_and_never_raises(caplog):
    trainer = _trainer()
    ids, rollout = _rollout(trainer, "lm_head")
    att = RolloutAttributor()
    assert att.run_requested(trainer) is None  # nothing kept, nothing asked
    att.keep(input_ids=ids, rollout_logprobs=rollout)
    assert att.run_requested(trainer) is None  # nothing asked
    assert att.request("drift", 3)
    first = att.run_requested(trainer)
    assert first is not None and first.module == "lm_head" and first.step == 3
    assert not att.request("drift", 4)  # once per run
    assert att.run_requested(trainer) is None
    assert att.request("outliers", 5, again=True)
    att.keep(input_ids=ids, rollout_logprobs=rollout[:, :3].T)  # malformed: warned, None
    assert att.run_requested(trainer) is None
    assert "rollout attribution failed" in caplog.text


def test_d_the_capsule_replays_to_the_same_module_in_a_fresh_process(tmp_path: Path, monkeypatch, capsys):
    trainer = _trainer(tie_word_embeddings=True)  # Qwen3's small checkpoints tie lm_head to the embedding
    assert trainer.lm_head.weight is trainer.model.embed_tokens.weight
    ids, rollout = _rollout(trainer, None)
    writer = CapsuleWriter(run_id="attr", rank=0, directory=str(tmp_path), max_count=4, max_bytes=256 << 20)
    att = RolloutAttributor(capsules=writer)
    with torch.no_grad():
        trainer_lp = torch.log_softmax(trainer(ids).logits[:, -C - 1:-1], -1).gather(-1, ids[:, -C:, None])[..., 0]
    att.keep(input_ids=ids, rollout_logprobs=rollout, logprobs=trainer_lp, completion_mask=torch.ones_like(rollout))
    att.request("drift", 9)
    a = att.run_requested(trainer)
    writer.join()
    assert a is not None and a.module in ("model.layers.0", "model.layers.0.self_attn") and a.capsule
    assert os.path.exists(a.capsule)
    code = "import sys; from nanwatch.cli import main; sys.exit(main(sys.argv[1:]))"
    p = subprocess.run([sys.executable, "-c", code, "replay", a.capsule, "--json"], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": ""}, cwd=tmp_path, timeout=300)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["module"] == out["recorded_module"] == a.module and out["same"]
    assert out["attribution"]["observed_abs_mean"] == pytest.approx(a.observed_abs_mean)
    assert out["attribution"]["lowered_abs_mean"] == pytest.approx(a.lowered_abs_mean, rel=1e-3)
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY"):  # replay sets them
        monkeypatch.setenv(var, os.environ.get(var, "0"))
    assert replay_main([a.capsule]) == 0
    assert f"module   {a.module} (recorded: {a.module}; the same)" in capsys.readouterr().out
