"""NanwatchCallback inside a real HF Trainer, with what Trainer turns on: gradient accumulation, gradient
checkpointing (non-reentrant, HF's default) and bf16 autocast (CPU). Tiny Qwen3 from a config."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
import urllib.request
import warnings

import pytest
import torch
import torch.nn.functional as F
from support import CollectorProcess, tiny_qwen3

transformers = pytest.importorskip("transformers")
pytest.importorskip("datasets")

from nanwatch.hooks.integrations.transformers import NanwatchCallback  # noqa: E402

GA, LAYERS = 4, ("model.layers.0.self_attn", "model.layers.1.self_attn")


def _dataset(n: int = 40, s: int = 12):
    from datasets import Dataset

    ids = torch.randint(0, 64, (n, s), generator=torch.Generator().manual_seed(0)).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, gradient_accumulation_steps=GA,
                gradient_checkpointing=True, bf16=True, use_cpu=True, max_steps=4, logging_steps=1,
                save_strategy="no", report_to="none", disable_tqdm=True, learning_rate=1e-3, seed=0)
    return transformers.TrainingArguments(**{**base, **kw})


class _StepOf(transformers.TrainerCallback):
    """Tells the fault injector which optimizer step is running."""

    def __init__(self) -> None:
        self.step = -1

    def on_step_begin(self, args, state, control, **kwargs):
        self.step = state.global_step


def _model():
    return tiny_qwen3("sdpa", vocab_size=64, hidden_size=32, intermediate_size=64, use_cache=False)


@pytest.fixture(scope="module")
def faulted_run(tmp_path_factory):
    """Four optimizer steps of 4 micro-batches; at step 2 layer 1's query projection turns NaN."""
    model, now = _model(), _StepOf()
    real_calls: dict[int, int] = {}

    def poison_query(module, args, out):
        if now.step == 2:
            out = out.clone()
            out[0, 3] = math.nan
            return out

    def count_call(module, args, out):  # ground truth: training attention forwards, not checkpointing re-runs
        if torch._C._current_graph_task_id() == -1 and module.training and torch.is_grad_enabled():  # no replay
            real_calls[now.step] = real_calls.get(now.step, 0) + 1

    model.model.layers[1].self_attn.q_proj.register_forward_hook(poison_query)
    for layer in model.model.layers:
        layer.self_attn.register_forward_hook(count_call)
    reports = []
    tmp = tmp_path_factory.mktemp("trainer")
    trainer = transformers.Trainer(model=model, args=_args(tmp, eval_strategy="steps", eval_steps=2),
                                   train_dataset=_dataset(), eval_dataset=_dataset(4),
                                   callbacks=[now, NanwatchCallback(run_id="trainer", on_report=reports.append)])
    class Peek(transformers.TrainerCallback):  # what was attached, seen while training
        def on_step_end(self, args, state, control, **kwargs):
            _ATTACHED_HOOKS.extend(model.model.layers[0].self_attn._forward_hooks.values())

    trainer.add_callback(Peek())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    return reports, real_calls, trainer


_ATTACHED_HOOKS: list = []


def test_trainer_steps_are_reported_once_per_optimizer_step(faulted_run):
    reports, _, trainer = faulted_run
    assert [r.step for r in reports] == [0, 1, 2, 3]
    # detached when training ended: no nanwatch hook is left on the model or its parameters
    def ours(hook) -> bool:
        return getattr(getattr(hook, "func", hook), "__module__", "").startswith("nanwatch")

    modules = list(trainer.model.modules())
    assert not [h for m in modules for d in (m._forward_pre_hooks, m._forward_hooks) for h in d.values() if ours(h)]
    assert not [h for p in trainer.model.parameters() for h in (p._backward_hooks or {}).values() if ours(h)]
    assert any(ours(h) for h in _ATTACHED_HOOKS)  # the check above can see nanwatch's hooks


def test_a_fault_at_a_known_layer_and_step_is_named_there(faulted_run):
    reports, _, _ = faulted_run
    assert [r.first_offender for r in reports[:2]] == [None, None]
    r = reports[2]
    # CPU flash hides a NaN query in its output; the query read pins it to the right layer anyway
    assert (r.first_offender, r.first_offender_phase, r.first_offender_stage) == (
        "model.layers.1.self_attn.query", "forward", "train")
    out = next(s for s in r.sites if (s.site, s.phase) == ("model.layers.1.self_attn", "forward"))
    assert out.nan == 0  # the output really was finite: without the query read, this layer looked clean


def test_call_counts_equal_real_attention_calls_under_checkpointing(faulted_run):
    reports, real_calls, _ = faulted_run
    for r in reports:
        assert real_calls[r.step] == len(LAYERS) * GA
        assert sum(c.calls for c in r.sdpa if c.stage == "train") == real_calls[r.step]
        c = r.coverage
        every = sum(x.calls for x in r.sdpa)  # eval's calls too, labelled eval
        assert (c.attention_calls, c.attention_probed, c.recomputed_calls) == (every, every, 8), c
        assert sum(s.calls for s in r.sites if (s.site, s.phase, s.stage) == (LAYERS[0], "forward", "train")) == GA


def test_the_logit_bound_is_present_every_step(faulted_run):
    reports, _, _ = faulted_run
    for r in reports:
        assert sorted(lg.layer for lg in r.logits) == sorted(LAYERS), r.step
        assert all(lg.source == "lse" for lg in r.logits)
        assert "no_logit_bound" not in r.coverage.unmeasured
    assert all(math.isfinite(lg.bound) and lg.bound > 0 for r in reports[:2] for lg in r.logits)


def test_backend_and_dtype_are_what_ran_under_autocast(faulted_run):
    reports, _, _ = faulted_run
    # the NaN at step 2 comes back on every path the replay tries (the query itself is poisoned), so it is
    # classified data/mask and the local policy (no collector here) issues no fp32 fallback: none helps
    assert reports[2].incident.cls == "data_mask" and reports[2].incident.same == "nonfinite"
    assert [r.attention_mode for r in reports] == ["none"] * 4
    for r in reports:
        dtype = "float32" if r.attention_mode == "fp32" else "bfloat16"  # fp32 under autocast really is fp32
        for c in r.sdpa:
            if c.stage == "train":
                assert (c.backend, c.predicted, c.confirmed, c.dtype, c.reason) == (
                    "cpu_flash", "cpu_flash", True, dtype, None), c
    # ground truth, without nanwatch: what autocast hands SDPA (fp32 q/k after the norms, bf16 v) runs
    # as bf16 CPU flash
    q = torch.randn(2, 4, 8, 16, requires_grad=True)
    v = torch.randn(2, 4, 8, 16).bfloat16().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = F.scaled_dot_product_attention(q, q, v, is_causal=True)
    assert type(out.grad_fn).__name__ == "ScaledDotProductFlashAttentionForCpuBackward0"
    assert out.dtype == torch.bfloat16


def test_eval_forwards_are_labelled_and_kept_out_of_the_training_figures(faulted_run):
    reports, _, _ = faulted_run
    stages = {s.stage for r in reports for s in r.sites}
    assert stages == {"train", "eval"}
    evals = [r for r in reports if any(s.stage == "eval" for s in r.sites)]
    assert evals, "the evaluation's forwards were not seen"
    for r in evals:
        assert all(s.phase == "forward" for s in r.sites if s.stage == "eval")
        assert sum(c.calls for c in r.sdpa if c.stage == "train") == len(LAYERS) * GA  # not inflated


def _poisoned_at_step_1(tmp_path, *, optim: str, callbacks=(), **options):
    """Three steps; at step 1 layer 0's MLP output turns NaN in every forward (a bad batch)."""
    model, now = _model(), _StepOf()
    model.model.layers[0].mlp.register_forward_hook(lambda m, a, out: out * math.nan if now.step == 1 else out)
    reports = []
    cb = NanwatchCallback(run_id="guard", on_report=reports.append, **options)
    trainer = transformers.Trainer(model=model, args=_args(tmp_path, max_steps=3, optim=optim),
                                   train_dataset=_dataset(), callbacks=[now, cb, *(c(cb) for c in callbacks)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        trainer.train()
    return model, reports, trainer


def test_the_weight_guard_keeps_a_nan_step_out_of_the_weights(tmp_path):
    # HF's default optimizer is fused AdamW: the guard hands it nanwatch's flag, no host sync
    model, reports, trainer = _poisoned_at_step_1(tmp_path, optim="adamw_torch_fused")
    assert [r.step_skipped for r in reports] == [False, True, False]
    # gradient clipping had made every gradient NaN: without the guard every weight would be NaN now
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert "step" not in type(trainer.optimizer.optimizer).__dict__ or "step" not in trainer.optimizer.optimizer.__dict__
    inc = reports[1].incident  # classified by the replay before the next step (CPU: free)
    assert inc is not None and inc.step == 1 and inc.same == "nonfinite"


@pytest.mark.parametrize("optim", ["adamw_torch", "sgd"])
def test_a_non_fused_optimizer_is_guarded_by_default(tmp_path, optim):
    # no fused kernel to take the flag: the guard reads it on the host, once per optimizer step
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # guarded without a word: nothing to ask of the user
        model, reports, trainer = _poisoned_at_step_1(tmp_path, optim=optim)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert [r.step_skipped for r in reports] == [False, True, False]
    assert "step" not in trainer.optimizer.optimizer.__dict__  # the guard is gone with the callback


def test_guard_off_through_the_callback_leaves_a_non_fused_optimizer_unguarded(tmp_path):
    model, reports, _ = _poisoned_at_step_1(tmp_path, optim="adamw_torch", guard="off")
    assert not all(torch.isfinite(p).all() for p in model.parameters())
    assert [r.step_skipped for r in reports] == [None, None, None]


_CRASH = textwrap.dedent("""
    import sys, warnings
    import torch, transformers
    sys.path.insert(0, {tests!r})
    from support import tiny_qwen3
    from datasets import Dataset
    from nanwatch.hooks.integrations.transformers import NanwatchCallback
    warnings.simplefilter("ignore")
    model = tiny_qwen3("sdpa", vocab_size=64, hidden_size=32, intermediate_size=64, use_cache=False)
    ids = torch.randint(0, 64, (16, 8), generator=torch.Generator().manual_seed(0)).tolist()
    calls = []
    def explode(module, args, out):  # like TRL's sampler raising on a NaN probability
        calls.append(1)
        if len(calls) == 6:  # step 1, second micro-batch
            raise FloatingPointError("sampler saw a NaN probability")
        return out * float("nan") if len(calls) >= 5 else out
    model.model.layers[0].mlp.register_forward_hook(explode)
    args = transformers.TrainingArguments(output_dir={out!r}, per_device_train_batch_size=2,
        gradient_accumulation_steps=4, use_cpu=True, max_steps=3, save_strategy="no", report_to="none",
        disable_tqdm=True)
    transformers.Trainer(model=model, args=args, train_dataset=Dataset.from_dict({{"input_ids": ids, "labels": ids}}),
        callbacks=[NanwatchCallback(run_id="crash", collector={url!r})]).train()
""")


@pytest.mark.slow
def test_a_crashing_steps_report_reaches_the_collector(tmp_path):
    tests = str(__import__("pathlib").Path(__file__).resolve().parents[1])
    with CollectorProcess(db_path=tmp_path / "c.db") as c:
        script = _CRASH.format(tests=tests, out=str(tmp_path / "out"), url=c.url)
        proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
        assert proc.returncode != 0 and "sampler saw a NaN probability" in proc.stderr, proc.stderr[-2000:]
        with urllib.request.urlopen(f"{c.url}/v1/runs/crash", timeout=10) as resp:
            run = json.loads(resp.read())
    assert run["latest_step"] == 1  # the step that crashed was reported, at interpreter exit
    assert run["first_offender"]["site"] == "model.layers.0.mlp" and run["first_offender"]["step"] == 1
    assert run["nonfinite_total"] > 0


def test_the_old_import_path_still_works_and_says_it_moved():
    import importlib
    import sys

    from nanwatch.hooks.integrations import trl as new_trl

    for name in ("nanwatch.integrations.transformers", "nanwatch.integrations.trl"):
        sys.modules.pop(name, None)
    with pytest.warns(DeprecationWarning, match="nanwatch.hooks.integrations.transformers"):
        old = importlib.import_module("nanwatch.integrations.transformers")
    with pytest.warns(DeprecationWarning, match="nanwatch.hooks.integrations.trl"):
        old_trl = importlib.import_module("nanwatch.integrations.trl")
    assert old.NanwatchCallback is NanwatchCallback and old_trl.instrument is new_trl.instrument


def test_the_monitor_stays_readable_after_train(faulted_run):
    reports, _, trainer = faulted_run
    (cb,) = [c for c in trainer.callback_handler.callbacks if isinstance(c, NanwatchCallback)]
    last = cb.monitor.last_report(timeout=1)
    assert last is not None and last.step == reports[-1].step == 3


def test_torch_compile_true_trains_with_the_callback(tmp_path):
    """``TrainingArguments(torch_compile=True)`` made ``on_train_begin`` raise ``TypeError: ... does not support
    len()`` (the compiled wrapper was tested for truthiness), so the model never trained. ``aot_eager``: the
    same dynamo graphs without Inductor's C++ compile, too slow for a 2-core CI."""
    reports = []
    args = _args(tmp_path, torch_compile=True, torch_compile_backend="aot_eager", gradient_checkpointing=False,
                 bf16=False, gradient_accumulation_steps=1, max_steps=2)
    trainer = transformers.Trainer(model=_model(), args=args, train_dataset=_dataset(8),
                                   callbacks=[NanwatchCallback(run_id="compiled", on_report=reports.append)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    assert [r.step for r in reports] == [0, 1]
    assert all(r.coverage.forwards > 0 for r in reports)


def test_tensorboard_gets_the_nanwatch_scalars_through_the_trainers_own_logs(tmp_path):
    """``report_to="tensorboard"``: the event file HF's TensorBoard integration writes holds ``nanwatch/*``
    scalars, a NaN step and its skip counted (the guard on a fused AdamW)."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model, now = _model(), _StepOf()
    model.model.layers[0].mlp.register_forward_hook(
        lambda m, a, out: out.index_fill(1, torch.tensor([0]), math.nan) if now.step == 1 else None)
    args = _args(tmp_path, report_to="tensorboard", gradient_checkpointing=False,
                 bf16=False, gradient_accumulation_steps=1, max_steps=3, optim="adamw_torch_fused")
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_dataset(8),
                                   callbacks=[now, NanwatchCallback(run_id="tb")])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    (events,) = {p.parent for p in tmp_path.rglob("events.out.tfevents.*")}
    acc = EventAccumulator(str(events))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/nanwatch/nonfinite_steps", "train/nanwatch/skipped_steps", "train/nanwatch/logit_max",
            "train/nanwatch/headroom_max"} <= tags, tags
    assert [e.value for e in acc.Scalars("train/nanwatch/nonfinite_steps")][-1] == 1.0
    assert [e.value for e in acc.Scalars("train/nanwatch/skipped_steps")][-1] == 1.0
    assert "log" not in trainer.__dict__  # the wrap is undone when training ends
