"""One rank of the cross-rank weight-guard tests (started by torchrun from test_dist_guard.py, gloo, 2 ranks):
a tiny Qwen3, a NaN injected on rank 1 only at step K (a forward hook on one MLP, run before nanwatch's),
trained under each wrapper named on the command line in turn, in one process group. Every step's
report fields and the weights' (or local shards') finiteness go to ``<out>/<wrapper>.rank<r>.json``.

Wrappers: ``ddp`` (DistributedDataParallel, 2 micro-batches per step, the NaN in the first, under
``no_sync``), ``fsdp2`` (``fully_shard`` per layer and root, CPU defaults: replay on), ``accelerate``
(``Accelerator(cpu=True)``), ``trainer`` (HF ``Trainer`` + ``NanwatchCallback``, gradient accumulation 2),
``zero1``/``zero2`` (DeepSpeed ZeRO stage 1/2 on the CPU), ``ddp_sync`` (a non-fused optimizer, guarded
at one host read per step), ``subgroups`` (no wrapper, each rank its own
``process_group``), ``ddp_closure``/``ddp_closure_sgd`` (DDP stepped by ``opt.step(closure)``, the forward and
backward inside the step: fused AdamW, plain SGD).
"""

import contextlib
import datetime
import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support import SMALL, step_reports, tiny_qwen3, token_ids  # noqa: E402

import nanwatch  # noqa: E402

K, STEPS = 2, 5
LAYER = "model.layers.0.mlp"
VOCAB = 64
CONFIG = dict(SMALL, vocab_size=VOCAB, use_cache=False)


class Fault:
    """Turns one MLP's output NaN on rank 1 in the forwards fed ``bad`` (so a replay of that micro-batch
    meets it again, and the others do not); registered first, so nanwatch measures the NaN."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.bad: torch.Tensor | None = None
        self._fed: torch.Tensor | None = None
        self.handles = [model.register_forward_pre_hook(self._feed, with_kwargs=True, prepend=True),
                        model.get_submodule(LAYER).register_forward_hook(self._hook, prepend=True)]

    def _feed(self, module, args, kwargs):
        self._fed = kwargs.get("input_ids", args[0] if args else None)

    def _hook(self, module, args, output):
        hit = self.bad is not None and self._fed is not None and self._fed.data_ptr() == self.bad.data_ptr()
        return output * float("nan") if hit and dist.get_rank() == 1 else None

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _finite(model: torch.nn.Module) -> bool:
    return all(bool(torch.isfinite(p.to_local() if hasattr(p, "to_local") else p).all())
               for p in model.parameters())


def _row(n: int, r, model) -> dict:
    inc = r.incident
    return {"step": n, "skipped": r.step_skipped, "nonfinite_rank": r.nonfinite_rank, "first": r.first_offender,
            "incident": None if inc is None else {"cls": inc.cls, "note": inc.note, "birth": inc.birth},
            "params_checked": r.coverage.params_checked, "finite": _finite(model)}


def _loop(model, opt, train, *, micro: int = 1, no_sync=None, step=None, **options) -> list[dict]:
    """STEPS steps of ``micro`` micro-batches (``train(ids)``: forward and backward, then ``step()``, by
    default ``opt``'s step and zero_grad; ``options``: MonitorConfig fields); the fault
    is on for the first micro-batch of step K."""
    fault, rows = Fault(model if not hasattr(model, "module") else model.module), []
    with nanwatch.attach(model, run_id="dist-guard", **options) as mon:
        mon.guard(opt)
        for n in range(STEPS):
            with mon.step(n):
                for m in range(micro):
                    ids = token_ids(2, 16, seed=100 * n + 10 * m + dist.get_rank(), vocab=VOCAB)
                    if n == K and m == 0:
                        fault.bad = ids
                    with no_sync() if no_sync is not None and m < micro - 1 else contextlib.nullcontext():
                        train(ids)
                if step is not None:
                    step()
                else:
                    opt.step()
                    opt.zero_grad()
            rows.append(_row(n, mon.last_report(), model))
    fault.remove()
    return rows


def ddp() -> list[dict]:
    model = torch.nn.parallel.DistributedDataParallel(tiny_qwen3("sdpa", **CONFIG))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    return _loop(model, opt, lambda ids: model(input_ids=ids, labels=ids).loss.backward(), micro=2,
                 no_sync=model.no_sync)


def ddp_sync() -> list[dict]:
    """A non-fused AdamW, guarded at one host read per step: the host reads the job's flag, not the rank's."""
    model = torch.nn.parallel.DistributedDataParallel(tiny_qwen3("sdpa", **CONFIG))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return _loop(model, opt, lambda ids: model(input_ids=ids, labels=ids).loss.backward())


def _closure_loop(fused: bool) -> list[dict]:
    """DDP, ``opt.step(closure)``: the closure's forward and backward run inside the guarded step, and
    ``step()`` returns the closure's loss, skipped or not."""
    model = torch.nn.parallel.DistributedDataParallel(tiny_qwen3("sdpa", **CONFIG))
    opt = (torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True) if fused
           else torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    batch: list[torch.Tensor] = []

    def closure():
        opt.zero_grad()
        loss = model(input_ids=batch[-1], labels=batch[-1]).loss
        loss.backward()
        return loss

    def step():
        loss = opt.step(closure)
        assert isinstance(loss, torch.Tensor), loss

    return _loop(model, opt, batch.append, step=step)


def ddp_closure() -> list[dict]:
    return _closure_loop(fused=True)


def ddp_closure_sgd() -> list[dict]:
    return _closure_loop(fused=False)


def subgroups() -> list[dict]:
    """Independent models, each rank its own ``process_group``: the ranks share no gradients, so rank 0
    must not skip for rank 1 (the option reaches the guard)."""
    groups = [dist.new_group([r]) for r in range(dist.get_world_size())]  # every rank makes every group
    model = tiny_qwen3("sdpa", **CONFIG)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    return _loop(model, opt, lambda ids: model(input_ids=ids, labels=ids).loss.backward(),
                 process_group=groups[dist.get_rank()])


def fsdp2() -> list[dict]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = tiny_qwen3("sdpa", **CONFIG)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    # the rotating sweep passed explicitly (off by default): what it reads of DTensor parameters is this
    # test's point (test_dist_guard: the local shards)
    return _loop(model, opt, lambda ids: model(input_ids=ids, labels=ids).loss.backward(), param_check_every=8)


def accelerate() -> list[dict]:
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    model = tiny_qwen3("sdpa", **CONFIG)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True))

    return _loop(model, opt, lambda ids: acc.backward(model(input_ids=ids, labels=ids).loss))


def zero(stage: int) -> list[dict]:
    """DeepSpeed ZeRO-``stage`` (1 or 2) on the CPU, torch's fused AdamW as the client optimizer."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")  # the process group is there already: it is used
    model = tiny_qwen3("sdpa", **CONFIG)
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
           "zero_allow_untested_optimizer": True}
    engine, opt, _, _ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True), config=cfg)

    def train(ids):
        engine.backward(engine(input_ids=ids, labels=ids).loss)

    # the engine steps the ZeRO optimizer, which steps the guarded torch optimizer inside it
    return _loop(engine.module, opt, train, step=engine.step)


def trainer(out: Path) -> list[dict]:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from nanwatch.hooks.integrations.transformers import NanwatchCallback

    model = tiny_qwen3("sdpa", **CONFIG)
    fault = Fault(model)
    reports: list = []

    class Inject(TrainerCallback):  # the first micro-batch of step K: the Trainer's root forward sees it
        def on_step_begin(self, args, state, control, **kw):
            self.left = 1 if state.global_step == K else 0

    inject = Inject()

    def mark(module, args, kwargs):
        if inject.left:
            inject.left -= 1
            fault.bad = kwargs.get("input_ids")

    rows = [token_ids(1, 16, seed=i, vocab=VOCAB)[0] for i in range(2 * 2 * 2 * STEPS)]
    data = [{"input_ids": r, "labels": r} for r in rows]
    args = TrainingArguments(output_dir=str(out / "trainer"), use_cpu=True, ddp_backend="gloo", max_steps=STEPS,
                             per_device_train_batch_size=2, gradient_accumulation_steps=2, learning_rate=1e-3,
                             report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True,
                             dataloader_num_workers=0)
    cb = NanwatchCallback(run_id="dist-guard-trainer", on_report=step_reports(reports))
    model.register_forward_pre_hook(mark, with_kwargs=True, prepend=True)
    Trainer(model=model, args=args, train_dataset=data, callbacks=[inject, cb]).train()
    fault.remove()
    finite = _finite(model)
    # the callback numbers steps as HF logs them (global_step after the step, from 1): rows count from 0 here
    return [{**_row(r.step - 1, r, model), "finite": finite} for r in reports]


def main(out_dir: str, *wrappers: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))  # a hang raises, not waits
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    out = Path(out_dir)
    for name in wrappers:
        rows = (trainer(out) if name == "trainer" else zero(int(name[-1])) if name.startswith("zero")
                else globals()[name]())
        Path(out, f"{name}.rank{dist.get_rank()}.json").write_text(json.dumps(rows))
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
