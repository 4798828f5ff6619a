"""What a clean step costs on an accelerator's path, as counts (issue #35): every ATen dispatch of a training
step of a tiny Qwen3 counted under a ``TorchDispatchMode`` (kernels, bytes read from parameter and
optimizer-state storage, host syncs), with nanwatch at its defaults and the accelerator's path forced on the
CPU (the rerun decided a step later; the optimizer check amortised), against the same steps bare. Reading
every weight after every update (the optimizer check), and a share of every parameter and optimizer-state
tensor at each step start (the rotating sweep), were the largest reads of a GPU step; neither is needed to
name a non-finite tensor (``tests/hooks/test_optimizer_guard.py``), so after the first step nanwatch reads
no parameter or state byte, and deciding the rerun costs no host sync."""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from support import tiny_qwen3, token_ids
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import nanwatch
from nanwatch.hooks.forensics import rerun as rerun_module

pytest.importorskip("transformers")

STEPS = 6
SYNCS = (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default)


class _Count(TorchDispatchMode):
    """Kernels, host syncs, and bytes read from the storages in ``watched`` (views read nothing)."""

    def __init__(self, watched: set[int]) -> None:
        super().__init__()
        self.watched = watched
        self.kernels = self.syncs = self.watched_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.kernels += 1
        self.syncs += func in SYNCS
        if not func.is_view and func is not torch.ops.aten.detach.default:
            tensors = {id(t): t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            self.watched_bytes += sum(t.numel() * t.element_size() for t in tensors.values()
                                      if t.untyped_storage().data_ptr() in self.watched)
        return func(*args, **kwargs)


def _steps(monkeypatch, attach: dict | None) -> list[tuple[int, int, int]]:
    """Per step (kernels, host syncs, bytes read from parameters and optimizer state); ``attach``: the
    Monitor's options, None for no nanwatch."""
    monkeypatch.setattr(rerun_module, "defers", lambda device: True)  # the accelerator's path, on the CPU
    torch.manual_seed(0)
    model = tiny_qwen3("sdpa", vocab_size=64, use_cache=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mon = None if attach is None else nanwatch.attach(model, run_id="reads", optimizer=opt,
                                                          directive_source="off", **attach)
        for n in range(STEPS):
            watched = {p.untyped_storage().data_ptr() for p in model.parameters()}
            watched |= {v.untyped_storage().data_ptr() for s in opt.state.values() for v in s.values()
                        if isinstance(v, torch.Tensor) and v.dim()}
            count = _Count(watched)
            ids = token_ids(2, 32, seed=n, vocab=64)
            with count, mon.step(n) if mon is not None else contextlib.nullcontext():
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad()
            rows.append((count.kernels, count.syncs, count.watched_bytes))
        if mon is not None:
            mon.close()
    return rows


def test_after_the_first_step_the_accelerator_path_reads_no_weight_and_syncs_nothing(monkeypatch):
    bare = _steps(monkeypatch, None)
    on = _steps(monkeypatch, {"optimizer_check_every": 16})
    params = sum(p.numel() * p.element_size() for p in tiny_qwen3("sdpa", vocab_size=64, use_cache=False).parameters())
    extra_bytes = [o[2] - b[2] for o, b in zip(on, bare, strict=True)]
    # step 0: the optimizer check reads every parameter once (the first update is always checked)
    assert params <= extra_bytes[0] < 1.1 * params, (extra_bytes[0], params)
    # then nothing: no check (one step in 16), no sweep, the rerun's flag copied without touching them
    assert extra_bytes[1:] == [0] * (STEPS - 1), extra_bytes
    assert [o[1] - b[1] for o, b in zip(on, bare, strict=True)] == [0] * STEPS  # no host sync: the rerun is deferred
    # what keeping the rerun costs a clean step: its flag's few small kernels (computed, copied)
    off = _steps(monkeypatch, {"optimizer_check_every": 16, "rerun": False})
    assert 0 < on[2][0] - off[2][0] <= 24, (on[2][0], off[2][0])
