"""Per-token statistics reduced together: each statistic a row over the tokens, every row stacked and reduced
by one op, and written into the slot buffer by one op.

Why: on a GPU a small kernel costs about 5 µs to launch whatever its size, and ``Monitor.rlhf`` once took a
``sum`` or an ``amax`` and a slot write for each figure (~160 kernels a call, ~585 ops a 4x255 batch). As rows,
all of a call's sums cost a stack of masks, a stack of values, a ``where`` and a ``sum``; its maxima the same
with ``amax``.

A row is a (mask, value) pair over the tokens (the logprobs' shape, the first dimension its sequences): its sum
is Σ value where mask (0 elsewhere: a NaN the mask leaves out stays out), its maximum the max of value where
mask (-inf elsewhere, so a row that never holds reads "unset"). A sum row may be the product of two values (a
moment such as Σ x·y), multiplied in the stack's dtype. The callers give every value row one dtype (float32;
a count's value is a float32 one, not its bool mask): CUDA's ``cat`` copies the inputs of a stack in one kernel
only when they share a dtype, else one copy each. Sums accumulate in the slot buffer's dtype (float64).

On a CPU the same stacks cost host time rather than launches (its ``cat`` copies a strided input, such as an
expanded constant, on its own), so a call is not cheaper there; the GPU's launch count is what this is for.

Constants (True, False, a fill value) are 0-d device tensors made once per device and kept, so a call copies
nothing from the host.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

__all__ = ["TokenRows", "device_constant"]

_CONSTANTS: dict[tuple, torch.Tensor] = {}


def device_constant(value: float | bool, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 0-d tensor holding ``value`` on ``device``, made once (a fill, not a copy) and kept: never write to it."""
    key = (value, dtype, device)
    t = _CONSTANTS.get(key)
    if t is None:
        t = _CONSTANTS[key] = torch.full((), value, dtype=dtype, device=device)
    return t


class TokenRows:
    """The rows of one call, over tokens of ``shape``; ``sum``/``max`` add rows, ``totals``/``maxima`` (after
    ``by_sequence`` where per-sequence sums are wanted) reduce them all.

    Example usage::

        rows = TokenRows(lp.shape, lp.device)
        rows.sum("tokens", mask, mask)                  # a count: the mask is its own value
        rows.max("neg_min", ok, -lp)
        keys, totals = rows.totals(torch.float64)       # one value a sum row, in row order
        keys, maxima = rows.maxima(torch.float64)  # float64 out of float32 rows: no cast for the slot write
    """

    def __init__(self, shape: torch.Size, device: torch.device) -> None:
        self.shape = torch.Size(shape)
        self.device = device
        self._sums: list[tuple[Hashable, torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
        self._maxes: list[tuple[Hashable, torch.Tensor, torch.Tensor]] = []
        self._by_sequence: list[tuple[Hashable, torch.Tensor]] = []
        self._per_seq: torch.Tensor | None = None
        self._weighted: torch.Tensor | None = None

    def const(self, value: float | bool, dtype: torch.dtype = torch.bool) -> torch.Tensor:
        """``value`` over every token (an expanded view of a kept device constant: no kernel)."""
        return device_constant(value, dtype, self.device).expand(self.shape)

    def sum(self, key: Hashable, mask: torch.Tensor, value: torch.Tensor, times: torch.Tensor | None = None) -> None:
        """A sum row: Σ value (· times) over the tokens where ``mask``; a bool value counts."""
        self._sums.append((key, mask, value, times))

    def max(self, key: Hashable, mask: torch.Tensor, value: torch.Tensor) -> None:
        """A max row: max of ``value`` over the tokens where ``mask``, -inf where none."""
        self._maxes.append((key, mask, value))

    def spread(self, per_sequence: torch.Tensor) -> torch.Tensor:
        """A per-sequence value (as ``by_sequence`` gives) over its sequence's tokens (a view)."""
        if len(self.shape) < 2:
            return per_sequence.reshape(()).expand(self.shape)
        return per_sequence.unsqueeze(1).expand(self.shape)

    def _reduced(self, acc: torch.dtype, dims: tuple[int, ...]) -> torch.Tensor:
        # a product row's two values are multiplied alone when there are one or two, in one op on a second
        # stack when there are more (the stack and the op cost two kernels, whatever the count)
        products = sum(t is not None for *_, t in self._sums)
        masks = torch.stack([m.expand(self.shape) for _, m, _, _ in self._sums])
        values = torch.stack([(v if t is None or products > 2 else v * t).expand(self.shape)
                              for _, _, v, t in self._sums])
        if products > 2:
            one = self.const(1, values.dtype)
            values = values * torch.stack([one if t is None else t.expand(self.shape) for *_, t in self._sums])
        self._weighted = torch.where(masks, values, device_constant(0, values.dtype, self.device))
        return self._weighted.sum(dims, dtype=acc)

    def weighted(self, key: Hashable) -> torch.Tensor:
        """After a reduction: the sum row ``key`` over the tokens as it was summed (its value where its mask
        holds, 0 elsewhere), in the stack's dtype."""
        return self._weighted[self.row(key)]

    def by_sequence(self, acc: torch.dtype) -> torch.Tensor:
        """The sum rows reduced over each sequence (the tokens' dimension 1): ``[rows, *sequence shape]`` (one
        sequence for 1-D tokens). Then ``totals`` adds them up, with any ``sequence_sum`` rows."""
        if len(self.shape) < 2:
            self._per_seq = self._reduced(acc, (1,)).unsqueeze(1)
        else:
            self._per_seq = self._reduced(acc, (2,))
        return self._per_seq

    def row(self, key: Hashable) -> int:
        """The position of the sum row ``key`` in ``by_sequence``'s result."""
        return next(i for i, (k, *_) in enumerate(self._sums) if k == key)

    def sequence_sum(self, key: Hashable, per_sequence: torch.Tensor) -> None:
        """A sum over sequences (``by_sequence``'s shape, e.g. a flag a sequence): added up by ``totals``."""
        self._by_sequence.append((key, per_sequence))

    def totals(self, acc: torch.dtype) -> tuple[tuple[Hashable, ...], torch.Tensor]:
        """Every sum, one value a row in ``acc``: the sum rows, then the ``sequence_sum`` rows."""
        keys = tuple(k for k, *_ in self._sums)
        if self._per_seq is None:
            return keys, self._reduced(acc, tuple(range(1, len(self.shape) + 1)))
        per_seq = self._per_seq
        if self._by_sequence:
            per_seq = torch.cat([per_seq, *(v.unsqueeze(0) for _, v in self._by_sequence)])
            keys += tuple(k for k, _ in self._by_sequence)
        return keys, per_seq.reshape(len(keys), -1).sum(1, dtype=acc)

    def maxima(self, acc: torch.dtype) -> tuple[tuple[Hashable, ...], torch.Tensor]:
        """Every max row's maximum, in row order, in ``acc`` or the stack's dtype if wider (-inf for a row whose
        mask never holds)."""
        masks = torch.stack([m.expand(self.shape) for _, m, _ in self._maxes])
        values = torch.stack([v.expand(self.shape) for _, _, v in self._maxes])
        # a 1-element -inf, not a 0-d one: it takes part in type promotion, so ``where`` yields ``acc`` itself
        # and the slot write needs no cast of its own
        none = device_constant(-torch.inf, acc, self.device).reshape(1)
        out = torch.where(masks, values, none).amax(tuple(range(1, len(self.shape) + 1)))
        return tuple(k for k, *_ in self._maxes), out
