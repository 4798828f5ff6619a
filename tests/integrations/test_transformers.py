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
from support import CollectorProcess, step_reports, tiny_qwen3

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
                                   callbacks=[now, NanwatchCallback(run_id="trainer", on_report=step_reports(reports))])
    class Peek(transformers.TrainerCallback):  # what was attached, seen while training
        def on_step_end(self, args, state, control, **kwargs):
            _ATTACHED_HOOKS.extend(model.model.layers[0].self_attn._forward_hooks.values())

    trainer.add_callback(Peek())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    return [r for r in reports if r.stage == "train"], real_calls, trainer, reports


_ATTACHED_HOOKS: list = []


def test_trainer_steps_are_reported_once_per_optimizer_step(faulted_run):
    reports, _, trainer, _ = faulted_run
    # numbered as HF logs them: the global_step each optimizer step ends at
    assert [r.step for r in reports] == [1, 2, 3, 4]
    assert [h["step"] for h in trainer.state.log_history if "loss" in h] == [1, 2, 3, 4]
    # detached when training ended: no nanwatch hook is left on the model or its parameters
    def ours(hook) -> bool:
        return getattr(getattr(hook, "func", hook), "__module__", "").startswith("nanwatch")

    modules = list(trainer.model.modules())
    assert not [h for m in modules for d in (m._forward_pre_hooks, m._forward_hooks) for h in d.values() if ours(h)]
    assert not [h for p in trainer.model.parameters() for h in (p._backward_hooks or {}).values() if ours(h)]
    assert any(ours(h) for h in _ATTACHED_HOOKS)  # the check above can see nanwatch's hooks


def test_a_fault_at_a_known_layer_and_step_is_named_there(faulted_run):
    reports, _, _, _ = faulted_run
    assert [r.first_offender for r in reports[:2]] == [None, None]
    r = reports[2]
    # CPU flash hides a NaN query in its output with AVX-512 and propagates it with AVX2 alone: the query is
    # read first, so the layer is named at its query on either (both kernels are emulated on any CPU in
    # tests/hooks/test_sdpa_backend.py::test_a_nan_query_is_named_first_whatever_the_kernel_does_with_it)
    assert (r.first_offender, r.first_offender_phase, r.first_offender_stage) == (
        "model.layers.1.self_attn.query", "forward", "train")


def test_call_counts_equal_real_attention_calls_under_checkpointing(faulted_run):
    reports, real_calls, _, _ = faulted_run
    for r in reports:
        assert real_calls[r.step - 1] == len(LAYERS) * GA  # the injector counts HF's step before its increment
        assert sum(c.calls for c in r.sdpa if c.stage == "train") == real_calls[r.step - 1]
        c = r.coverage
        every = sum(x.calls for x in r.sdpa)
        assert {x.stage for x in r.sdpa} == {"train"}  # the evaluations are reported on their own
        assert (c.attention_calls, c.attention_probed, c.recomputed_calls) == (every, every, 8), c
        assert sum(s.calls for s in r.sites if (s.site, s.phase, s.stage) == (LAYERS[0], "forward", "train")) == GA


def test_the_logit_bound_is_present_every_step(faulted_run):
    reports, _, _, _ = faulted_run
    for r in reports:
        assert sorted(lg.layer for lg in r.logits) == sorted(LAYERS), r.step
        assert all(lg.source == "lse" for lg in r.logits)
        assert "no_logit_bound" not in r.coverage.unmeasured
    assert all(math.isfinite(lg.bound) and lg.bound > 0 for r in reports[:2] for lg in r.logits)


def test_backend_and_dtype_are_what_ran_under_autocast(faulted_run):
    reports, _, _, _ = faulted_run
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


def test_evaluations_are_reported_on_their_own(faulted_run):
    reports, _, trainer, everything = faulted_run
    assert {s.stage for r in reports for s in r.sites} == {"train"}
    evals = [r for r in everything if r.stage == "eval"]
    # eval_steps=2 of 4: after step 2, and the final one after step 4 (before on_train_end), keyed as HF logs them
    assert [r.step for r in evals] == [2, 4]
    assert [h["step"] for h in trainer.state.log_history if "eval_loss" in h] == [2, 4]
    assert [(r.stage, r.step) for r in everything] == [("train", 1), ("train", 2), ("eval", 2), ("train", 3),
                                                         ("train", 4), ("eval", 4)]
    for r in evals:
        assert {s.stage for s in r.sites} == {"eval"} and all(s.phase == "forward" for s in r.sites)
        assert {c.stage for c in r.sdpa} == {"eval"}
        assert r.coverage.forwards == math.ceil(4 / trainer.args.per_device_eval_batch_size)  # 4 eval samples
        assert r.first_offender is None and r.coverage.unmeasured == []


def _poisoned_at_step_1(tmp_path, *, optim: str, callbacks=(), **options):
    """Three steps; at step 1 layer 0's MLP output turns NaN in every forward (a bad batch)."""
    model, now = _model(), _StepOf()
    model.model.layers[0].mlp.register_forward_hook(lambda m, a, out: out * math.nan if now.step == 1 else out)
    reports = []
    cb = NanwatchCallback(run_id="guard", on_report=step_reports(reports), **options)
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
    assert inc is not None and inc.step == reports[1].step == 2 and inc.same == "nonfinite"


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
    # the step that crashed (HF's second: global_step 2) was reported, and the run ended crashed
    assert run["latest_step"] == 2 and run["status"] == "crashed" and run["live_ranks"] == 0
    assert run["crashed_ranks"] == [{"rank": 0, "raised": "FloatingPointError", "step": 2}]
    assert run["first_offender"]["site"] == "model.layers.0.mlp" and run["first_offender"]["step"] == 2
    assert run["nonfinite_total"] > 0


def test_the_monitor_stays_readable_after_train(faulted_run):
    _, _, trainer, reports = faulted_run
    (cb,) = [c for c in trainer.callback_handler.callbacks if isinstance(c, NanwatchCallback)]
    last = cb.monitor.last_report(timeout=1)
    assert last is not None and (last.stage, last.step) == (reports[-1].stage, reports[-1].step) == ("eval", 4)


def test_torch_compile_true_trains_with_the_callback(tmp_path):
    """``TrainingArguments(torch_compile=True)`` made ``on_train_begin`` raise ``TypeError: ... does not support
    len()`` (the compiled wrapper was tested for truthiness), so the model never trained. ``aot_eager``: the
    same dynamo graphs without Inductor's C++ compile, too slow for a 2-core CI."""
    reports = []
    args = _args(tmp_path, torch_compile=True, torch_compile_backend="aot_eager", gradient_checkpointing=False,
                 bf16=False, gradient_accumulation_steps=1, max_steps=2)
    trainer = transformers.Trainer(model=_model(), args=args, train_dataset=_dataset(8),
                                   callbacks=[NanwatchCallback(run_id="compiled", on_report=step_reports(reports))])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    assert [r.step for r in reports] == [1, 2]
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


def _trainer(tmp_path, model, reports, *, callbacks=(), options=None, finals=None, **kw):
    args = _args(tmp_path, **{**dict(gradient_checkpointing=False, gradient_accumulation_steps=1, max_steps=3,
                                     logging_nan_inf_filter=False), **kw})
    cb = NanwatchCallback(run_id="hf", on_report=step_reports(reports, finals), directive_source="local", **(options or {}))
    return transformers.Trainer(model=model, args=args, train_dataset=_dataset(16), eval_dataset=_dataset(4),
                                callbacks=[*callbacks, cb])


def _poison_values(model, when) -> None:
    """Layer 1's attention values turn NaN whenever ``when(module)``: its (bf16) attention output is the first
    non-finite value, born in attention."""
    model.model.layers[1].self_attn.v_proj.register_forward_hook(
        lambda m, a, out: out * math.nan if when(m) else out)


def test_a_nan_at_hf_step_k_is_reported_at_step_k(tmp_path):
    model, now, reports = _model(), _StepOf(), []
    model.model.layers[0].mlp.register_forward_hook(lambda m, a, out: out * math.nan if now.step == 1 else out)
    trainer = _trainer(tmp_path, model, reports, callbacks=[now], bf16=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    (hit,) = [r for r in reports if r.first_offender is not None]
    # HF's running loss stays NaN once it held one (NaN - NaN): its first NaN is the step's
    logged = next(h["step"] for h in trainer.state.log_history if "loss" in h and math.isnan(h["loss"]))
    assert hit.step == logged == 2


@pytest.mark.parametrize("stage", ["eval", "train"])
def test_an_eval_only_nan_is_the_evaluations_and_asks_for_no_remedy(tmp_path, stage):
    """bf16 attention turns NaN in every eval forward: the evaluations' reports (after step 2, and the final
    one) name it, no training report has a first offender, and the local rules ask for no fp32. The control
    (``train``: the same NaN in training step 2, rerun off) does get fp32: the stage is what decides."""
    model, now, reports = _model(), _StepOf(), []

    _poison_values(model, (lambda m: not m.training) if stage == "eval" else (lambda m: m.training and now.step == 1))
    trainer = _trainer(tmp_path, model, reports, callbacks=[now], options={"rerun": False}, max_steps=4,
                       eval_strategy="steps", eval_steps=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    train = [r for r in reports if r.stage == "train"]
    evals = [r for r in reports if r.stage == "eval"]
    assert [r.step for r in train] == [1, 2, 3, 4] and [r.step for r in evals] == [2, 4]
    eval_losses = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
    if stage == "eval":
        assert all(math.isnan(x) for x in eval_losses)
        assert [(r.first_offender, r.first_offender_stage) for r in evals] == [("model.layers.1.self_attn", "eval")] * 2
        assert [r.first_offender for r in train] == [None] * 4
        assert [r.attention_mode for r in reports] == ["none"] * 6
    else:
        assert [(r.first_offender, r.first_offender_stage) for r in train] == [
            (None, None), ("model.layers.1.self_attn", "train"), (None, None), (None, None)]
        assert [r.attention_mode for r in train] == ["none", "none", "fp32", "fp32"]


def test_standalone_and_final_evaluations_are_reported(tmp_path):
    model, reports, finals = _model(), [], []
    _poison_values(model, lambda m: not m.training)
    trainer = _trainer(tmp_path, model, reports, max_steps=2, eval_strategy="no", finals=finals)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        before = trainer.evaluate()  # no train() yet: the callback attaches for the evaluation
        trainer.train()
        after = trainer.evaluate()  # the final evaluation, after train() detached
    assert math.isnan(before["eval_loss"]) and math.isnan(after["eval_loss"])
    # each of the three Monitors (evaluate, train, evaluate) ends normally: its incarnation's final report
    assert [(r.stage, r.step, r.final) for r in finals] == [("train", 0, True), ("train", 2, True), ("train", 2, True)]
    assert [(r.stage, r.step) for r in reports] == [("eval", 0), ("train", 1), ("train", 2), ("eval", 2)]
    for r in (reports[0], reports[3]):
        assert (r.first_offender, r.first_offender_stage, r.coverage.forwards) == (
            "model.layers.1.self_attn", "eval", 1)
    assert [r.first_offender for r in reports[1:3]] == [None, None]
    # detached after each: no nanwatch hook is left on the model
    assert not [h for m in model.modules() for h in m._forward_hooks.values()
                if getattr(h, "__module__", "").startswith("nanwatch")]


def test_a_step_that_raises_says_so_and_claims_nothing_unmeasured(tmp_path):
    model, now, reports = _model(), _StepOf(), []

    def explode(module, args, out):
        if now.step == 1:
            raise FloatingPointError("sampler saw a NaN probability")

    model.model.layers[0].mlp.register_forward_hook(explode)
    trainer = _trainer(tmp_path, model, reports, callbacks=[now])
    with warnings.catch_warnings(), pytest.raises(FloatingPointError):
        warnings.simplefilter("ignore")
        trainer.train()
    assert [(r.step, r.raised) for r in reports] == [(1, None), (2, "FloatingPointError")]
    crashed = reports[-1]
    assert crashed.coverage.unmeasured == [] and not crashed.coverage.logits  # no "no_logits ... ran compiled"
    assert any("raised FloatingPointError" in w for w in crashed.warnings)
    assert "training_step" not in trainer.__dict__  # detached before the exception left train()


def test_a_normal_train_ends_with_a_final_report(tmp_path):
    """(A train() that raised sends none: test_a_step_that_raises_says_so_and_claims_nothing_unmeasured.)"""
    model, reports, finals = _model(), [], []
    trainer = _trainer(tmp_path, model, reports, bf16=False, finals=finals)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    assert [(r.final, r.step) for r in finals] == [(True, 3)] and reports[-1].step == 3
    (cb,) = [c for c in trainer.callback_handler.callbacks if isinstance(c, NanwatchCallback)]
    assert not cb.monitor.last_report().final  # last_report() stays the last step's


def test_each_tensorboard_row_describes_its_own_steps(tmp_path):
    """Every training row's ``nanwatch/*`` covers exactly the steps up to the row's own: the NaN step's row
    counts it (not the next one), and the first row has them. A slow ``on_report`` (0.3 s a report) keeps the
    reporter behind the training thread, as a busy one is: the row must wait for its step's report."""
    pytest.importorskip("tensorboard")
    import time

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    model, now, reports = _model(), _StepOf(), []
    model.model.layers[0].mlp.register_forward_hook(
        lambda m, a, out: out.index_fill(1, torch.tensor([0]), math.nan) if now.step == 1 else None)
    args = _args(tmp_path, report_to="tensorboard", gradient_checkpointing=False, bf16=False,
                 gradient_accumulation_steps=1, max_steps=4, optim="adamw_torch_fused")

    def slow(report):
        reports.append(report)
        time.sleep(0.3)

    trainer = transformers.Trainer(model=model, args=args, train_dataset=_dataset(8),
                                   callbacks=[now, NanwatchCallback(run_id="rows", on_report=slow)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    (events,) = {p.parent for p in tmp_path.rglob("events.out.tfevents.*")}
    acc = EventAccumulator(str(events))
    acc.Reload()
    train = [r for r in reports if r.stage == "train" and not r.final]
    assert [r.step for r in train] == [1, 2, 3, 4]
    rows = {e.step for e in acc.Scalars("train/loss")}
    assert rows == {1, 2, 3, 4}
    for tag, counted in (("nonfinite_steps", lambda r: r.first_offender is not None),
                         ("skipped_steps", lambda r: r.step_skipped)):
        got = {e.step: e.value for e in acc.Scalars(f"train/nanwatch/{tag}") if e.step in rows}
        want = {s: float(sum(counted(r) for r in train if r.step <= s)) for s in rows}
        assert want == {1: 0.0, 2: 1.0, 3: 1.0, 4: 1.0}
        assert got == want, tag


def test_the_callback_feeds_the_loss_and_a_loss_jump_is_a_spike(tmp_path):
    """``training_step``'s loss is watched as the site ``loss``: a loss ×20 at HF step 7 is a loss spike there."""

    class JumpingLoss(transformers.Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, **kw):
            loss = super().compute_loss(model, inputs, return_outputs=return_outputs, **kw)
            return loss * 20.0 if self.state.global_step == 6 and not return_outputs else loss

    reports = []
    cb = NanwatchCallback(run_id="hf", on_report=step_reports(reports), spike_warmup=3)
    trainer = JumpingLoss(model=_model(), args=_args(tmp_path, gradient_checkpointing=False, gradient_accumulation_steps=1,
                                                     bf16=False, max_steps=9), train_dataset=_dataset(16),
                          callbacks=[cb])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.train()
    train = [r for r in reports if r.stage == "train"]
    assert all(any(s.site == "loss" for s in r.sites) for r in train)
    spiked = {r.step: {(s.site, s.phase) for s in r.spikes} for r in train if r.spikes}
    assert [step for step, v in spiked.items() if ("loss", "forward") in v] == [7], spiked
