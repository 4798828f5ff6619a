"""The weight guard and the fast fallback: an fp16 eager Qwen3 with a real learning rate whose attention
overflows at step K. No weight ever becomes non-finite, the fallback applies by step K+2 at defaults, and the
loss is finite from then on: without a collector (the local policy), with a real collector process, and
across two gloo ranks. Also: GradScaler still scales and skips as before, and the differential replay
classifies the three kinds of failure."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from support import (
    CollectorProcess,
    TinyNet,
    free_port,
    guarded_step,
    overflow_attention,
    tiny_qwen3,
    token_ids,
)

import nanwatch

pytest.importorskip("transformers")

K, STEPS = 3, 8


def _train(collector: str | None = None, *, steps: int = STEPS, fault=overflow_attention, **attach):
    model = tiny_qwen3("eager", dtype=torch.float16, vocab_size=64, use_cache=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.attach(model, run_id="guard", collector=collector, optimizer=opt, **attach) as mon:
            for n in range(steps):
                if n == K:
                    fault(model)
                r, row = guarded_step(mon, model, opt, n)
                rows.append({**row, "incident": r.incident, "first": r.first_offender})
    return rows


def _assert_protected_and_fallen_back(rows, *, by: int) -> int:
    assert all(r["weights_finite"] for r in rows), [r["step"] for r in rows if not r["weights_finite"]]
    assert [r["skipped"] for r in rows[: K + 1]] == [False] * K + [True]  # the NaN step, and only it
    assert not math.isfinite(rows[K]["loss"])
    applied = next(r["step"] for r in rows if r["mode"] == "fp32")
    assert K < applied <= by, applied
    assert all(math.isfinite(r["loss"]) and r["mode"] == "fp32" for r in rows[applied:])
    return applied


def test_without_a_collector_the_local_rules_fall_back_at_the_next_step():
    rows = _train()
    assert _assert_protected_and_fallen_back(rows, by=K + 1) == K + 1
    inc = rows[K]["incident"]  # replayed before the next step: fp16 QK overflow is a precision problem
    assert (inc.cls, inc.same, inc.fp32, inc.site) == ("precision", "nonfinite", "finite", "model.layers.0.self_attn")
    # born in the attention kernel, between self_attn's children (o_proj only received it): self_attn
    assert inc.birth == "model.layers.0.self_attn" and inc.birth_params == {} and inc.birth_elements > 0


@pytest.mark.slow
def test_with_a_collector_the_fallback_applies_within_two_steps(tmp_path):
    with CollectorProcess(db_path=tmp_path / "c.db") as c:
        rows = _train(c.url)
        run = json.loads(__import__("urllib.request").request.urlopen(f"{c.url}/v1/runs/guard").read())
    applied = _assert_protected_and_fallen_back(rows, by=K + 2)
    kinds = [e["kind"] for e in run["events"]]
    assert "incident" in kinds and "directive_set" in kinds and "mode_applied" in kinds
    d = run["directive"]
    assert (d["mode"], d["set_by"]) == ("fp32", "rule:half_attention_nonfinite")
    assert d["apply_at_step"] <= applied  # the collector asked for the next step (one rank), no margin


@pytest.mark.slow
@pytest.mark.parametrize("collector", [False, True])
def test_two_gloo_ranks_switch_at_the_same_step(tmp_path, collector):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "--master_addr=127.0.0.1", str(Path(__file__).with_name("guard_worker.py")), str(tmp_path)]

    def run() -> list[list[dict]]:
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]

    if collector:
        with CollectorProcess(db_path=tmp_path / "c.db") as c:
            env["NANWATCH_COLLECTOR"] = c.url
            r0, r1 = run()
    else:
        r0, r1 = run()
    assert [r["mode"] for r in r0] == [r["mode"] for r in r1]  # every step, the same path on both ranks
    applied = next(r["step"] for r in r0 if r["mode"] == "fp32")
    # The NaN was rank 1's alone. Ranks agree every directive_check_every = 4 steps (steps 0, 4, 8...):
    # the directive applies at the first agreement after a rank has it. Locally rank 1 has it at step
    # K + 1 = 4; through the collector rank 0 hears of it within two steps, so by the agreement at step 8.
    every = 4
    heard_by = K + (1 if not collector else 2)
    assert K < applied <= (heard_by // every + 1) * every and applied % every == 0, applied
    assert all(r["weights_finite"] for r in r0 + r1)
    # the skip is the job's: rank 1's NaN is reduced across ranks before either optimizer reads the flag,
    # from step K until the fp32 path applies (rank 1's half-precision attention fails at every step in
    # between, and never under fp32: the fault is injected, so this holds on any CPU's kernels, #26)
    skipped = [r["skipped"] for r in r1]
    assert [r["skipped"] for r in r0] == skipped and skipped == [K <= n < applied for n in range(len(r1))], skipped


def test_grad_scaler_scales_and_skips_as_before_with_the_guard_on():
    """fp16 weights are not AMP's use; the scaler's contract is: an overflowing step is skipped and the
    scale halves. Same sequence of scales, same weights, with the guard on or off, when nanwatch itself
    sees nothing non-finite (the overflow is in the scaled gradients only)."""

    def run(guarded: bool):
        torch.manual_seed(0)
        model = TinyNet(vocab=64)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
        ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
        scales = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mon = nanwatch.attach(model, run_id="scaler", grads=False) if guarded else None
            if mon is not None:
                mon.guard(opt)
            for n in range(4):
                loss = F.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
                boost = 1e38 if n == 1 else 1.0  # step 1: the scaled gradients overflow fp32
                with (mon.step(n) if mon else torch.enable_grad()):
                    scaler.scale(loss * boost).backward()
                    scaler.step(opt)
                    scaler.update()
                opt.zero_grad()
                scales.append(scaler.get_scale())
            if mon is not None:
                mon.close()
        return scales, [p.detach().clone() for p in model.parameters()]

    plain, guarded = run(False), run(True)
    assert plain[0] == guarded[0] and plain[0][1] == plain[0][0] / 2  # halved after the overflow step
    assert all(torch.equal(a, b) for a, b in zip(plain[1], guarded[1], strict=True))


def test_either_flag_skips_the_step_when_a_scaler_is_in_use():
    torch.manual_seed(0)
    model = TinyNet(vocab=64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler("cpu")
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mon = nanwatch.attach(model, run_id="both", optimizer=opt, grads=False)
    before = [p.detach().clone() for p in model.parameters()]
    with mon, mon.step(0):
        loss = F.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
        mon.watch("loss", loss * math.nan)  # nanwatch sees a NaN; the scaler's gradients are finite
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert mon.last_report().step_skipped is True
    assert scaler.get_scale() == 2.0**16  # the scaler saw no overflow: its scale is untouched


def test_a_non_fused_optimizer_is_guarded_by_default():
    """Non-fused optimizers are guarded at one host read per step, with no warning."""
    model = tiny_qwen3("eager", dtype=torch.float16, vocab_size=64, use_cache=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with nanwatch.attach(model, run_id="sgd-sync", directive_source="off") as mon:
            g = mon.guard(opt)
            assert not g.fused
            overflow_attention(model)
            with mon.step(0):
                ids = token_ids(2, 32, seed=0, vocab=64)
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
            assert mon.last_report().step_skipped is True
    assert all(torch.isfinite(p).all() for p in model.parameters())


def _mask_everything_for_row(model) -> None:
    """From step K the attention mask hides every key from query row 5 (an -inf additive mask in eager
    attention: softmax of all -inf is NaN)."""
    layer = model.model.layers[0].self_attn

    def hook(module, args, kwargs):
        mask = kwargs.get("attention_mask")
        if mask is not None:
            mask = mask.clone()
            mask[..., 5, :] = -math.inf
            kwargs["attention_mask"] = mask
        return args, kwargs

    layer.register_forward_pre_hook(hook, with_kwargs=True)


def test_replay_classifies_a_fully_masked_row_as_data_or_mask():
    rows = _train(fault=_mask_everything_for_row, steps=K + 2)
    inc = rows[K]["incident"]
    assert inc.cls == "data_mask" and inc.same == "nonfinite", inc
    assert rows[K + 1]["mode"] == "none"  # no precision switch: it would not help (the guard skipped the step)


def _one_shot_nan(model) -> None:
    """A NaN written into one forward's activation, once (a bit flip, a race): gone on the re-run."""
    fired = []

    def hook(module, args, out):
        if not fired:
            fired.append(1)
            return out * math.nan
        return out

    model.model.layers[0].mlp.register_forward_hook(hook)


def test_replay_classifies_a_one_shot_nan_as_not_reproducible():
    rows = _train(fault=_one_shot_nan, steps=K + 2)
    inc = rows[K]["incident"]
    assert (inc.cls, inc.same) == ("not_reproducible", "finite"), inc
    assert "rank 0" in inc.host
    assert rows[K + 1]["mode"] == "none"
