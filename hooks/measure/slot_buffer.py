"""The device-side slot buffer: one preallocated tensor that hooks write into without ever syncing with
the host.

A scalar that is not a site read has a named slot, either a *sum* slot (counts, sums) or a *max* slot
(flags, maxima; a minimum is stored as the max of its negation). Hooks only launch small device ops that
add into or max into a slot; the host reads the whole buffer once per step, asynchronously. A figure
written once per call and maxed over the step (a layer's per-head logit figure) does not come here: it
costs one op into a row of ``nanwatch.hooks.measure.max_rows``, where maxing into slots cost three.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Hashable

import torch

__all__ = ["SlotBuffer"]

_F64 = torch.float64


def _acc_dtype(device: torch.device) -> torch.dtype:
    # float64 counts stay exact far beyond 2**24 elements; MPS has no float64.
    return torch.float32 if device.type == "mps" else _F64


class SlotBuffer:
    """Named sum/max slots in one preallocated device tensor.

    Slots are assigned on the host the first time a key is seen and keep their index for the life of the
    buffer, so a step's snapshot is decoded by position. When the capacity runs out the buffer doubles
    (a device-side copy, no sync).
    """

    def __init__(self, device: torch.device | str, *, capacity: int = 512) -> None:
        if capacity < 2:
            raise ValueError(f"capacity must be >= 2, got {capacity}")
        self.device = torch.device(device)
        self.dtype = _acc_dtype(self.device)
        self._slots: dict[tuple[str, Hashable], int] = {}
        self._lock = threading.Lock()
        self._kinds: list[str] = []  # "sum" or "max", by slot index
        #: ``scatter_add``'s device index of each key tuple it wrote, and its first slot when consecutive
        self._indices: dict[tuple[Hashable, ...], tuple[torch.Tensor, int | None]] = {}
        #: a fresh step's values, chosen by ``_max_mask`` (``reset``: one ``where`` into the slots)
        self._unset = torch.full((), -math.inf, dtype=self.dtype, device=self.device)
        self._zero = torch.zeros((), dtype=self.dtype, device=self.device)
        self._alloc(capacity)

    def _alloc(self, capacity: int) -> None:
        data = torch.zeros(capacity, dtype=self.dtype, device=self.device)
        max_mask = torch.zeros(capacity, dtype=torch.bool, device=self.device)
        if hasattr(self, "data"):
            n = self.data.numel()
            data[:n].copy_(self.data)
            max_mask[:n].copy_(self._max_mask)
        self.data, self._max_mask = data, max_mask

    @property
    def size(self) -> int:
        """Slots in use; a snapshot's first ``size`` values are meaningful."""
        return len(self._kinds)

    def slot(self, kind: str, key: Hashable) -> int:
        """Index of the slot for ``key`` (allocated on first use). ``kind`` is "sum" or "max".

        The lookup is lock-free; allocation takes a lock, since autograd runs gradient hooks on one
        thread per device when a process drives several GPUs."""
        k = (kind, key)
        idx = self._slots.get(k)
        if idx is None:
            with self._lock:
                idx = self._slots.get(k)
                if idx is None:
                    idx = self._new_slot(k, kind)
        return idx

    def _new_slot(self, k: tuple[str, Hashable], kind: str) -> int:
        idx = len(self._kinds)
        if idx >= self.data.numel():
            self._alloc(2 * self.data.numel())
        if kind == "max":
            # slice fills, not ``data[idx] = x``: a scalar item assignment on CUDA is a blocking H2D copy
            self.data[idx : idx + 1].fill_(-math.inf)
            self._max_mask[idx : idx + 1].fill_(True)
        self._kinds.append(kind)
        self._slots[k] = idx
        return idx

    def add(self, key: Hashable, value: torch.Tensor) -> None:
        i = self.slot("sum", key)
        self.data[i : i + 1].add_(value.reshape(1))

    def maximize(self, key: Hashable, value: torch.Tensor) -> None:
        i = self.slot("max", key)
        cell = self.data[i : i + 1]
        torch.maximum(cell, value.reshape(1).to(self.dtype), out=cell)

    def assign(self, key: Hashable, value: torch.Tensor) -> None:
        """Set the slot ``key`` to ``value`` (a 0-d device value): the last write of the step wins. A max-kind
        slot, so that a step that never wrote it reads -inf (unset) after ``reset``."""
        i = self.slot("max", key)
        self.data[i : i + 1].copy_(value.reshape(1))

    def cells(self, kind: str, keys: tuple[Hashable, ...]) -> torch.Tensor:
        """The cells of the slots ``keys``, allocated together, consecutively, on first use: a view to write into
        with one device op. A key reached through ``cells`` is only ever reached with the same ``keys``. The
        view is only good until the next slot is allocated (the buffer may grow)."""
        first = self._slots.get((kind, keys[0]))
        if first is None:
            with self._lock:
                first = self._slots.get((kind, keys[0]))
                if first is None:
                    first = len(self._kinds)
                    for k in keys:
                        self._new_slot((kind, k), kind)
        return self.data[first : first + len(keys)]

    def block(self, kind: str, keys: tuple[Hashable, ...], values: torch.Tensor) -> None:
        """Add (``kind="sum"``) or max (``"max"``) ``values`` (1-D, one per key) into ``cells(kind, keys)``: one
        device op for many slots."""
        cells = self.cells(kind, keys)
        if kind == "sum":
            cells.add_(values.reshape(len(keys)).to(self.dtype))
        else:
            torch.maximum(cells, values.reshape(len(keys)).to(self.dtype), out=cells)

    def scatter_add(self, keys: tuple[Hashable, ...], values: torch.Tensor, *, at: torch.Tensor | None = None) -> None:
        """Add ``values`` into the sum slots ``keys``, wherever they lie, in one ``index_add_``: one value a key
        (``values`` 1-D), or, with ``at`` (a device index into ``keys``), ``values[i]`` into ``keys[at[i]]`` (a
        histogram). Unlike ``block``, any keys, old or new, in any combination: a slot is allocated only when a
        tuple naming it is first written, so which slots exist still says what was ever written. The device
        index of a tuple is built the first time it is written (a host->device copy then, never after)."""
        entry = self._indices.get(keys)
        if entry is None:
            with self._lock:  # new keys are allocated under one hold: consecutive, so ``at`` needs no gather
                slots = [self._slots.get(("sum", k)) for k in keys]
                for i, k in enumerate(keys):
                    if slots[i] is None:
                        slots[i] = self._new_slot(("sum", k), "sum")
            consecutive = slots == list(range(slots[0], slots[0] + len(slots)))
            entry = (torch.tensor(slots, dtype=torch.long).to(self.device), slots[0] if consecutive else None)
            self._indices[keys] = entry
        index, first = entry
        values = values.to(self.dtype)
        if at is None:
            self.data.index_add_(0, index, values.reshape(len(keys)))
        elif first is not None:
            self.data[first : first + len(keys)].index_add_(0, at.reshape(-1), values.reshape(-1))
        else:
            self.data.index_add_(0, index[at.reshape(-1)], values.reshape(-1))

    def index(self, kind: str, key: Hashable) -> int | None:
        """Slot index of an existing key, or None (host-only lookup, used when decoding)."""
        return self._slots.get((kind, key))

    def reset(self) -> None:
        """Zero the sums and set the maxes to -inf for a new step: one device op (a ``where`` that reads the
        kinds' mask and writes every slot once), no sync."""
        n = self.size
        if n:
            torch.where(self._max_mask[:n], self._unset, self._zero, out=self.data[:n])
