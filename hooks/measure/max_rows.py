"""Per-call rows of the figures whose step value is a max over calls: a layer's per-head logit figure (the
log-sum-exp bound, the eager scores' max, the exact max) and a forward's fully masked rows.

Each call gets a fresh row of a preallocated buffer and writes it with the one op that computes it
(``torch.amax(lse, dim=..., out=row)``); the max over the step's calls is taken on the host, at decode, since
the rows are copied anyway. Maxing into slots of the SlotBuffer instead cost three launches per attention
call (the reduction, a conversion to the slot dtype, ``torch.maximum(out=)``) where this costs one, and at
step end they join the copy's conversion of their dtype (``Recorder.flat``), nothing per call. The rows add
``heads`` values per call to the step's host copy (a few hundred bytes per layer), never a read of an
activation.

Buffers are per (device, dtype): an ``out=`` reduction writes in its input's dtype, which holds the value
exactly (as the slot's float64 did). They double when full (a device copy, no sync).

Example usage::

    rows = MaxRows()
    row = rows.row(("lse", "model.layers.0.self_attn", 4), 4, torch.float32, lse.device)
    torch.amax(lse, dim=(0, 2), out=row)       # one launch; the decode maxes the rows of a key
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

__all__ = ["MaxRows"]

BufKey = tuple[torch.device, torch.dtype]


class MaxRows:
    def __init__(self, *, capacity: int = 512) -> None:
        self._capacity = capacity
        self._bufs: dict[BufKey, torch.Tensor] = {}
        self._used: dict[BufKey, int] = {}
        #: this step's rows of each figure, by key: (buffer, offset); ``Recorder.flat`` hands it to the step's
        #: record (``StepState.maxes``) and ``reset`` starts a new one
        self.figures: dict[Hashable, list[tuple[BufKey, int]]] = {}

    def row(self, key: Hashable, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A fresh row of ``n`` cells for one call's value of the figure ``key``, as a 1-D view for the caller
        to write with one ``out=`` op. Host bookkeeping and a view: no device op unless the buffer grows."""
        bufkey = (device, dtype)
        i = self._used.get(bufkey, 0)
        buf = self._bufs.get(bufkey)
        if buf is None or i + n > buf.numel():
            buf = self._grow(bufkey, i + n)
        self._used[bufkey] = i + n
        self.figures.setdefault(key, []).append((bufkey, i))
        return buf[i : i + n]

    def _grow(self, key: BufKey, need: int) -> torch.Tensor:
        old = self._bufs.get(key)
        size = self._capacity if old is None else 2 * old.numel()
        while size < need:
            size *= 2
        buf = torch.empty(size, dtype=key[1], device=key[0])
        if old is not None:
            buf[: old.numel()].copy_(old)
        self._bufs[key] = buf
        return buf

    def segments(self) -> tuple[list[torch.Tensor], list[tuple[BufKey, int]]]:
        """The used cells of every buffer, in their own dtype and device (views: no device op), and their
        layout (buffer key, cells) for decoding a host copy (``Recorder.flat`` converts them)."""
        keys = [(key, n) for key, n in self._used.items() if n]
        return [self._bufs[key][:n] for key, n in keys], keys

    def reset(self) -> None:
        """A new step: cells are reused from the start (overwritten before they are read)."""
        self._used = dict.fromkeys(self._used, 0)
        self.figures = {}
