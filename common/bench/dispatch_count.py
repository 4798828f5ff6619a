"""Counting what a step launches on the device: a ``TorchDispatchMode`` that sees every ATen op and tallies,
per phase of the step, the *kernels* it launches, the *bytes* those kernels read and the *host syncs* it
forces; for nanwatch's own ops, also by the nanwatch function that issued them. The engine of
``nanwatch bench kernels`` (:mod:`nanwatch.bench.kernels`); a benchmark tool only: the design forbids a
dispatch mode in nanwatch's default path (about 7.5 us an op, and no ``torch.compile``).

What counts as what (a model of a CUDA device, the same on every device this runs on):

* a **kernel** is an op that launches device work. Not kernels: views and aliases (any op whose schema
  returns an alias of an input without writing it), allocations (``empty*``), ``detach``/``alias``/
  ``lift_fresh`` and other metadata ops (:data:`NOT_KERNELS`), and the syncs below. A multi-tensor op
  (``_foreach_*``, ``_fused_adamw_``) counts as one kernel: on CUDA it is a few launches of long-running
  blocks whose time is in its bytes, not in its launches;
* **bytes read** are, per kernel, the sum of ``numel * element_size`` over its distinct tensor inputs
  (lists too; an ``out=`` tensor is written, not read, and does not count; a broadcast view counts its
  logical elements; a fill or a factory like ``new_zeros(t)`` reads nothing (:data:`WRITE_ONLY`), and
  ``dst.copy_(src)`` reads ``src``). Writes are not counted: a reduction writes little, and an elementwise op's writes
  are about its reads;
* beside a model on ``meta`` or CUDA, an op on CPU tensors alone is host work and is not counted (on the
  ``cpu`` device the two cannot be told apart: everything counts);
* a **host sync** is an op that makes the host wait for the device: ``_local_scalar_dense`` (``item()``,
  ``bool(t)``, ``tolist()`` of a device tensor), an op whose output shape depends on the data
  (:data:`DATA_DEPENDENT`), or a copy from the model's device to the CPU unless it is non-blocking into
  pinned memory. On the CPU device these are counted as they would be on CUDA (there they cost nothing).
  On the ``meta`` device nothing has a value: ``_local_scalar_dense`` is answered with a stand-in (True
  for the result of ``all``, False for ``any``, else 0), a copy to the CPU is counted and fills the
  destination with zeros, and the one copy nanwatch's reporter makes at each step end is counted as it runs
  on CUDA (``nanwatch.hooks.report.reporter``: pinned host buffer, ``non_blocking=True``; on meta it can
  pin nothing). That is the whole seam: nanwatch's code is run unchanged.

Example usage::

    counter = OpCounter(nanwatch_dirs=nanwatch_sources())
    with counter:
        counter.phase = "forward"
        model(ids)
    counter.totals["forward"].kernels
"""

from __future__ import annotations

import os
import sys
import weakref
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["DATA_DEPENDENT", "NOT_KERNELS", "WRITE_ONLY", "Counts", "OpCounter", "nanwatch_sources"]

_aten = torch.ops.aten
#: metadata and allocation ops: no device work (besides views, found from their schema)
NOT_KERNELS = frozenset({
    _aten.detach.default, _aten.alias.default, _aten.lift_fresh.default, _aten.empty.memory_format,
    _aten.empty_strided.default, _aten.empty_like.default, _aten.set_.source_Tensor, _aten.resize_.default,
    _aten.set_.source_Storage_storage_offset, _aten._reshape_alias.default, _aten.sym_size.int,
    _aten.sym_stride.int, _aten.sym_numel.default, _aten.sym_storage_offset.default, _aten.is_same_size.default,
    _aten.new_empty.default, _aten.new_empty_strided.default, _aten.record_stream.default,
    _aten._fused_sdp_choice.default, _aten.is_pinned.default,  # host queries: no device work
})
#: ops whose output shape depends on the values: the host must wait for them
DATA_DEPENDENT = frozenset({
    "nonzero", "nonzero_static", "masked_select", "unique", "_unique", "_unique2", "unique_dim",
    "unique_consecutive", "unique_dim_consecutive", "bincount", "repeat_interleave",
})
#: ops that write a fresh or existing tensor without reading its values: no bytes read (a copy reads its source)
WRITE_ONLY = frozenset({
    "new_zeros", "new_ones", "new_full", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like",
    "fill_", "zero_", "zeros", "ones", "full", "scalar_tensor", "arange", "rand", "randn", "randint",
})
_SYNC = _aten._local_scalar_dense.default
_COPIES = (_aten.copy_.default, _aten._to_copy.default)
#: the model's SDPA, called from inside nanwatch's SDPA wrapper: the model's work, not nanwatch's
_MODEL_CALLS = {("sdpa_probe.py", "sdpa_call.<locals>.call")}
_REPORTER = ("reporter.py", "Reporter.capture")
#: code that is the model's or the optimizer's even when nanwatch calls it (the weight guard runs the step)
_MODEL_CODE = (os.sep + os.path.join("torch", "optim") + os.sep, os.sep + "transformers" + os.sep,
               os.sep + os.path.join("torch", "nn", "modules") + os.sep)


@dataclass(slots=True)
class Counts:
    """One tally: kernels launched, bytes they read, host syncs, and host-to-device copies (counted among
    the kernels; a copy from pageable memory in the step is a cost the design avoids)."""

    kernels: float = 0  # float: a mean per step over a cadence's cycle
    bytes: float = 0
    syncs: float = 0
    h2d: float = 0

    def add(self, other: Counts, scale: float = 1.0) -> None:
        self.kernels += other.kernels * scale
        self.bytes += other.bytes * scale
        self.syncs += other.syncs * scale
        self.h2d += other.h2d * scale

    def minus(self, other: Counts) -> Counts:
        return Counts(self.kernels - other.kernels, self.bytes - other.bytes, self.syncs - other.syncs,
                      self.h2d - other.h2d)

    def as_dict(self) -> dict:
        return {"kernels": self.kernels, "bytes": self.bytes, "syncs": self.syncs, "h2d": self.h2d}


def nanwatch_sources() -> tuple[str, ...]:
    """The folder of nanwatch's trainer-side code (``nanwatch.hooks``), whose frames on the stack make an op
    nanwatch's. The shared ``nanwatch`` modules that touch tensors do so through it; the CLI and the benches
    are the user's side (they drive the step)."""
    import nanwatch.hooks

    return (os.path.dirname(nanwatch.hooks.__file__) + os.sep,)


def _is_view(func) -> bool:
    if func.is_view:
        return True
    rets = func._schema.returns
    return bool(rets) and all(r.alias_info is not None and not r.alias_info.is_write for r in rets)


def _tensors(args, kwargs) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}

    def visit(x) -> None:
        if isinstance(x, torch.Tensor):
            seen.setdefault(id(x), x)
        elif isinstance(x, (list, tuple)):
            for y in x:
                visit(y)

    visit(args)
    visit([v for k, v in kwargs.items() if k != "out"])
    return list(seen.values())


def _on_host(args, kwargs) -> bool:
    """Every tensor the op touches is on the CPU (a factory op: it makes one there)."""
    tensors = _tensors(args, kwargs)
    out = kwargs.get("out")
    tensors += [out] if isinstance(out, torch.Tensor) else [t for t in out or () if isinstance(t, torch.Tensor)]
    if tensors:
        return all(t.device.type == "cpu" for t in tensors)
    device = kwargs.get("device")
    return device is None or torch.device(device).type == "cpu"


class OpCounter(TorchDispatchMode):
    """Tallies every op under it into ``totals[phase]`` (set :attr:`phase` between the parts of a step), and,
    with ``nanwatch_dirs``, nanwatch's own ops also into ``by_function["entry > leaf"]`` (the outermost and
    innermost nanwatch frames that issued it). ``device``: the model's device (for the copies to the CPU)."""

    def __init__(self, *, device: torch.device | str, nanwatch_dirs: tuple[str, ...] | None = None) -> None:
        super().__init__()
        self.device = torch.device(device)
        self._phase = "begin"
        #: on CUDA, the warnings ``torch.cuda.set_sync_debug_mode("warn")`` raised, by phase (see ``watch_cuda``)
        self.cuda_syncs: dict[str, int] | None = None
        self._caught: list | None = None
        self._seen = 0
        self.totals: dict[str, Counts] = defaultdict(Counts)
        self.by_function: dict[str, Counts] = defaultdict(Counts)
        self.sync_sites: list[str] = []  # where each host sync came from (phase: op, frame)
        self._dirs = nanwatch_dirs
        self._standins: dict[int, tuple[weakref.ref, bool]] = {}  # meta: results of all/any

    @property
    def phase(self) -> str:
        """The part of the step being counted now; set it between the parts."""
        return self._phase

    @phase.setter
    def phase(self, value: str) -> None:
        self._take_cuda_syncs()
        self._phase = value

    def watch_cuda(self, caught: list) -> None:
        """Count CUDA's own sync warnings (``caught``: the list of a ``warnings.catch_warnings(record=True)``
        under ``set_sync_debug_mode("warn")``) into :attr:`cuda_syncs`, by phase."""
        self._caught, self._seen, self.cuda_syncs = caught, len(caught), {}

    def _take_cuda_syncs(self) -> None:
        if self._caught is None:
            return
        new = [w for w in self._caught[self._seen:] if "synchroniz" in str(w.message)]
        self._seen = len(self._caught)
        if new:
            self.cuda_syncs[self._phase] = self.cuda_syncs.get(self._phase, 0) + len(new)

    def __exit__(self, *exc):
        self._take_cuda_syncs()
        return super().__exit__(*exc)

    # ---- classification ------------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in NOT_KERNELS or func.namespace == "profiler" or _is_view(func):  # record_function marks
            return func(*args, **kwargs)
        meta = self.device.type == "meta"
        if func not in _COPIES and self.device.type != "cpu" and _on_host(args, kwargs):
            return func(*args, **kwargs)  # host work beside a device model (a CPU scalar's item()): not counted
        if func is _SYNC:
            self._count(func, args, kwargs, kernel=False, sync=True)
            if meta and args[0].device.type == "meta":
                return self._standin(args[0])
            return func(*args, **kwargs)
        if func in _COPIES:
            return self._copy(func, args, kwargs)
        name = func.overloadpacket.__name__
        self._count(func, args, kwargs, kernel=True, sync=name in DATA_DEPENDENT)
        out = func(*args, **kwargs)
        if meta and name in ("all", "any") and isinstance(out, torch.Tensor):
            if len(self._standins) > 4096:
                self._standins = {k: v for k, v in self._standins.items() if v[0]() is not None}
            self._standins[id(out)] = (weakref.ref(out), name == "all")
        return out

    def _standin(self, t: torch.Tensor):
        ref = self._standins.get(id(t))
        if ref is not None and ref[0]() is t:
            return ref[1]
        return False if t.dtype == torch.bool else (0.0 if t.is_floating_point() else 0)

    def _copy(self, func, args, kwargs):
        src = args[1] if func is _aten.copy_.default else args[0]
        if func is _aten.copy_.default:
            dst_dev, non_blocking = args[0].device, bool(args[2] if len(args) > 2 else kwargs.get("non_blocking"))
        else:
            dst_dev = kwargs.get("device") or src.device
            non_blocking = bool(kwargs.get("non_blocking", False))
        d2h = src.device.type != "cpu" and torch.device(dst_dev).type == "cpu"
        h2d = src.device.type == "cpu" and torch.device(dst_dev).type != "cpu"
        if self.device.type != "cpu" and src.device.type == "cpu" and not h2d:
            return func(*args, **kwargs)  # a host copy beside a device model: not device work
        if not d2h:
            self._count(func, args, kwargs, kernel=True, sync=False, h2d=h2d)
            return func(*args, **kwargs)
        if src.device.type != "meta":
            pinned = func is _aten.copy_.default and args[0].is_pinned()
            self._count(func, args, kwargs, kernel=True, sync=not (non_blocking and pinned))
            return func(*args, **kwargs)
        # meta -> CPU: nothing to copy; the reporter's step-end copy counts as it runs on CUDA
        reporter = self._issued_by(_REPORTER)
        self._count(func, args, kwargs, kernel=True, sync=not reporter)
        if func is _aten.copy_.default:
            return args[0].zero_()
        return torch.zeros(src.shape, dtype=kwargs.get("dtype") or src.dtype)

    def _count(self, func, args, kwargs, *, kernel: bool, sync: bool, h2d: bool = False) -> None:
        c = Counts(kernels=int(kernel), syncs=int(sync), h2d=int(h2d))
        name = func.overloadpacket.__name__
        if kernel and name not in WRITE_ONLY:
            read = [args[1]] if func is _aten.copy_.default else _tensors(args, kwargs)
            c.bytes = sum(t.numel() * t.element_size() for t in read)
        self.totals[self.phase].add(c)
        owner = self._owner() if self._dirs is not None else None
        if owner is not None:
            self.by_function[owner].add(c)
        if sync:
            self.sync_sites.append(f"{self.phase}: {func} ({owner or 'model'})")

    # ---- attribution -------------------------------------------------------------------------------
    def _frames(self):
        f = sys._getframe(1)
        while f is not None:
            yield f
            f = f.f_back

    def _issued_by(self, where: tuple[str, str]) -> bool:
        return any(os.path.basename(f.f_code.co_filename) == where[0] and f.f_code.co_qualname == where[1]
                   for f in self._frames())

    def _owner(self) -> str | None:
        """``"entry > leaf"``: the outermost and innermost nanwatch functions on the stack, or None for the
        model's op: no nanwatch frame; or the first frame above the op (past torch's own helpers) is the
        model's or the optimizer's code that nanwatch called (the guard calling the optimizer's step); or
        it is the model's SDPA called from nanwatch's wrapper (a builtin: no frame of its own)."""
        leaf = entry = None
        for f in self._frames():
            path = f.f_code.co_filename
            if leaf is None and any(m in path for m in _MODEL_CODE):
                return None
            if not path.startswith(self._dirs):
                continue
            key = (os.path.basename(path), f.f_code.co_qualname)
            if leaf is None:
                if key in _MODEL_CALLS:
                    return None
                leaf = key
            entry = key
        if leaf is None:
            return None
        name = lambda k: f"{k[0][:-3]}.{k[1]}"  # noqa: E731
        return name(entry) if entry == leaf else f"{name(entry)} > {name(leaf)}"
