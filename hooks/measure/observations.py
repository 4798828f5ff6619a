"""The hot path's only device work: one ``aminmax`` per measured tensor, written straight into a row of a
preallocated buffer (``out=``), so measuring a site costs one read of it and nothing else.

One row per call: (min, max) in the tensor's own dtype, which holds both exactly. The host assigns rows in
execution order, so a row's place in the step is its ordinal. Everything else is read off the two
numbers on the host, after the step: NaN propagates through min and max, an Inf shows as +-inf, and
max(|min|, |max|) is the largest magnitude. NaN and Inf are *observed*, per call, not counted per element
(counting is another full pass; the incident drill-down counts the elements where it matters).

Buffers are per (device, dtype) and per log (training calls apart from the rest, so the weight guard's flag
is a slice, never a gather); they double when full (a device copy, no sync).
"""

from __future__ import annotations

import torch

__all__ = ["ObservationLog"]

BufKey = tuple[torch.device, torch.dtype]


def _dense(x: torch.Tensor) -> torch.Tensor:
    """``x`` with its dimensions in memory order when that makes it contiguous (a transposed view: SDPA's query
    and output, ``[B, H, S, D]`` over ``[B, S, H, D]`` memory), else ``x``: the extremes of every element do not
    depend on the order, and a strided read measured 1.6x (bf16) to 2x (fp32) slower than a contiguous one
    (``aminmax`` of a 4x8x256x32 query, 2 threads, torch 2.13 CPU)."""
    order = sorted(range(x.dim()), key=lambda d: (x.stride(d), x.size(d)), reverse=True)
    y = x.permute(order)
    return y if y.is_contiguous() else x


class ObservationLog:
    def __init__(self, *, capacity: int = 256) -> None:
        self._capacity = capacity
        self._bufs: dict[BufKey, torch.Tensor] = {}
        #: each row's (min, max) cells as 0-d views, made once per buffer: indexing a row anew at every call
        #: cost two ``select`` ops, as much host time as the ``aminmax`` launch itself
        self._cells: dict[BufKey, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._used: dict[BufKey, int] = {}

    def observe(self, x: torch.Tensor) -> tuple[BufKey, int]:
        """Write ``x``'s (min, max) into the next row; returns where (for the host's bookkeeping)."""
        key = (x.device, x.dtype)
        i = self._used.get(key, 0)
        cells = self._cells.get(key)
        if cells is None or i >= len(cells):
            cells = self._grow(key)
        torch.aminmax(x if x.is_contiguous() else _dense(x), out=cells[i])
        self._used[key] = i + 1
        return key, i

    def _grow(self, key: BufKey) -> list[tuple[torch.Tensor, torch.Tensor]]:
        old = self._bufs.get(key)
        rows = self._capacity if old is None else 2 * old.shape[0]
        buf = torch.empty(rows, 2, dtype=key[1], device=key[0])
        if old is not None:
            buf[: old.shape[0]].copy_(old)
        self._bufs[key] = buf
        cells = self._cells[key] = list(zip(buf[:, 0].unbind(), buf[:, 1].unbind(), strict=True))
        return cells

    def used(self) -> list[torch.Tensor]:
        """The used rows of every buffer, flattened (views: no device op), for the weight guard's flag."""
        return [self._bufs[k][:n].reshape(-1) for k, n in self._used.items() if n]

    def segments(self) -> tuple[list[torch.Tensor], list[tuple[BufKey, int]]]:
        """The used rows of every buffer, flattened, in their own dtype and device (views: no device op), and
        their layout (buffer key, rows) for decoding a host copy (``Recorder.flat`` converts them)."""
        keys = [(key, n) for key, n in self._used.items() if n]
        return [self._bufs[key][:n].reshape(-1) for key, n in keys], keys

    def reset(self) -> None:
        """A new step: rows are reused from the start (their values are overwritten, never read stale)."""
        self._used = dict.fromkeys(self._used, 0)
