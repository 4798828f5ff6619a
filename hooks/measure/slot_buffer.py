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

    def block(self, kind: str, keys: tuple[Hashable, ...], values: torch.Tensor) -> None:
        """Add (``kind="sum"``) or max (``"max"``) ``values`` (1-D, one per key) into the slots ``keys``, which
        are allocated together, consecutively, on first use: one device op for many slots. A key written by
        ``block`` is only ever written with the same ``keys``."""
        first = self._slots.get((kind, keys[0]))
        if first is None:
            with self._lock:
                first = self._slots.get((kind, keys[0]))
                if first is None:
                    first = len(self._kinds)
                    for k in keys:
                        self._new_slot((kind, k), kind)
        cells = self.data[first : first + len(keys)]
        if kind == "sum":
            cells.add_(values.reshape(len(keys)).to(self.dtype))
        else:
            torch.maximum(cells, values.reshape(len(keys)).to(self.dtype), out=cells)

    def index(self, kind: str, key: Hashable) -> int | None:
        """Slot index of an existing key, or None (host-only lookup, used when decoding)."""
        return self._slots.get((kind, key))

    def reset(self) -> None:
        """Zero the sums and set the maxes to -inf for a new step: one device op (a ``where`` that reads the
        kinds' mask and writes every slot once), no sync."""
        n = self.size
        if n:
            torch.where(self._max_mask[:n], self._unset, self._zero, out=self.data[:n])
