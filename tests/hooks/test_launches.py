"""What nanwatch launches per step, as counts (never seconds): on a GPU its cost is kernels launched and bytes
read, and the launches are counted here on the CPU, op by op, under a ``TorchDispatchMode`` (test-only: the
default path never runs one). A launch is an ATen op that does device work: views, ``detach`` and
allocations are not; ``_local_scalar_dense`` is a host sync, counted apart.

A tiny Qwen3 at the defaults (every site read every step), a fused AdamW (the weight guard on the device):

* an SDPA call on a fused backend: 3 launches (the query's and the output's ``aminmax``, one ``amax`` of the
  saved log-sum-exp straight into the bound's row); was 5 (the bound was reduced, converted, maxed into slots);
* an eager attention call: 5 in the scores probe (was 8);
* a plain site: 1 (its ``aminmax``);
* the step boundary (the guard's flag, the flattened copy, the reset): 8, the same for 2 and 4 layers (was
  20: ``isfinite`` is four kernels, the copy converted each part on its own, the reset took two);
* 0 host syncs in a step.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading

import pytest
import torch
from support import tiny_qwen3, token_ids
from torch.utils._python_dispatch import TorchDispatchMode

import nanwatch
from nanwatch.hooks.instrument import sdpa_probe
from nanwatch.hooks.measure.recorder import Recorder

pytest.importorskip("transformers")

#: ops that launch nothing: allocations and metadata (views are told by their schema)
_NO_LAUNCH = frozenset({"detach", "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided",
                        "lift_fresh", "set_", "resize_", "is_pinned", "_fused_sdp_choice"})
_SYNCS = frozenset({"_local_scalar_dense", "is_nonzero", "item"})


class Launches(TorchDispatchMode):
    """Counts launches (all of them under "step", and under each part they ran inside) and host syncs."""

    def __init__(self) -> None:
        super().__init__()
        self.by: collections.Counter[str] = collections.Counter()
        self.calls: collections.Counter[str] = collections.Counter()
        self.syncs = 0
        self._parts = threading.local()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._overloadpacket.__name__
        if name in _SYNCS:
            self.syncs += 1
        elif not func.is_view and name not in _NO_LAUNCH:
            self.by["step"] += 1
            for part in set(getattr(self._parts, "stack", ())):  # a site read inside an SDPA call: both
                self.by[part] += 1
        return out

    def wrap(self, name: str, fn):
        """``fn``, its launches counted under ``name`` and its calls counted."""

        @functools.wraps(fn)
        def part(*args, **kwargs):
            stack = getattr(self._parts, "stack", None)
            if stack is None:
                stack = self._parts.stack = []
            stack.append(name)
            self.calls[name] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                stack.pop()

        return part


def _counted_step(monkeypatch, impl: str, layers: int, *, attached: bool = True) -> Launches:
    """The third step of a tiny Qwen3 (the first two warm every cache up), counted."""
    counter = Launches()
    monkeypatch.setattr(sdpa_probe, "_after_sdpa", counter.wrap("sdpa", sdpa_probe._after_sdpa))
    monkeypatch.setattr(sdpa_probe, "scores_probe", counter.wrap("scores", sdpa_probe.scores_probe))
    monkeypatch.setattr(Recorder, "tensor", counter.wrap("site", Recorder.tensor))
    for boundary in ("nonfinite_flag", "flat", "swap"):
        monkeypatch.setattr(Recorder, boundary, counter.wrap("boundary", getattr(Recorder, boundary)))
    # HF's default use_cache=True: without a cache its packed-sequence check reads a tensor on the host
    model = tiny_qwen3(impl, num_hidden_layers=layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = token_ids(2, 16)
    # rerun=False: on a CPU the differential rerun's default reads the step's flag on the host (free there);
    # on a GPU, where syncs cost, it is off by default
    mon = nanwatch.attach(model, run_id="launches", optimizer=opt, rerun=False) if attached else None
    try:
        for step in range(3):
            counter.calls.clear()
            with counter if step == 2 else contextlib.nullcontext():
                with mon.step(step) if mon is not None else contextlib.nullcontext():
                    model(ids, labels=ids).loss.backward()
                    opt.step()
                    opt.zero_grad()
    finally:
        if mon is not None:
            mon.close()
    return counter


def _per_call(counter: Launches, part: str) -> float:
    return counter.by[part] / counter.calls[part]


def test_an_sdpa_call_launches_three(monkeypatch):
    c = _counted_step(monkeypatch, "sdpa", 2)
    assert c.calls["sdpa"] == 2  # one per layer
    # the query's aminmax, the output's aminmax, the bound's one amax (not amax + convert + maximum)
    assert _per_call(c, "sdpa") == 3


def test_an_eager_attention_call_launches_five_in_the_scores_probe(monkeypatch):
    c = _counted_step(monkeypatch, "eager", 2)
    assert c.calls["scores"] == 2
    # row maxima, the per-head figure into its row, the max over heads, the compare, the count into its row
    assert _per_call(c, "scores") == 5


def test_a_plain_site_launches_one(monkeypatch):
    c = _counted_step(monkeypatch, "sdpa", 2)
    assert c.calls["site"] > 10 and c.by["site"] <= c.calls["site"]  # a repeated read of one tensor is free
    assert _per_call(c, "site") == pytest.approx(1.0, abs=0.2)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_the_step_boundary_is_a_small_constant(monkeypatch, impl):
    two = _counted_step(monkeypatch, impl, 2)
    four = _counted_step(monkeypatch, impl, 4)
    assert two.by["boundary"] == four.by["boundary"]  # independent of the layers
    # the flag (cat, mul, any, to float32), the copy (one cat and one conversion for the float32 parts, one
    # cat of everything), the slots' reset (one where): 20 before
    assert two.by["boundary"] <= 8


def test_a_layer_costs_what_its_reads_cost(monkeypatch):
    """Two more layers add their sites' reads and their attention calls, and nothing else."""
    extra = {}
    for layers in (2, 4):
        attached = _counted_step(monkeypatch, "sdpa", layers)
        bare = _counted_step(monkeypatch, "sdpa", layers, attached=False)
        extra[layers] = attached.by["step"] - bare.by["step"]
    assert extra[4] > extra[2]
    per_layer = (extra[4] - extra[2]) / 2
    assert per_layer <= 23  # 25 before: the SDPA bound's convert and maximum


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_a_monitored_step_never_syncs(monkeypatch, impl):
    c = _counted_step(monkeypatch, impl, 2)
    assert c.by["step"] > 100 and c.calls["site"]  # the counter saw the step, measured
    assert c.syncs == 0
