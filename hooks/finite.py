"""Finiteness of one tensor, reduced where it lives: the NaN count, the Inf count and the largest finite
|x|, as 0-d device tensors. No host sync; the caller adds them into the slot buffer."""

from __future__ import annotations

import torch

__all__ = ["finite_stats"]

_SAME_SIZE_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def finite_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """NaN count, Inf count and the largest finite |x|, as 0-d device tensors (no host sync).

    One temporary, reused in place: the finite copy (non-finite entries zeroed; its ``aminmax`` is the
    finite range, so one Inf cannot hide it), then ``x - copy`` (0, NaN or +-inf: its non-zeros are the
    non-finite entries), then the same with NaN zeroed (its non-zeros are the Infs). ``count_nonzero``
    reads the tensor as it is; avoided on purpose: CPU's isnan/isinf (a slow path for half types) and any
    ``sum(dtype=...)`` (it first converts the whole tensor: the top cost in a profile of the bench step).
    """
    x = x.detach()
    if x.numel() == 0:
        zero = torch.zeros((), dtype=torch.int64, device=x.device)
        return zero, zero, zero.to(x.dtype)
    t = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
    lo, hi = torch.aminmax(t)
    amax = torch.maximum(hi, -lo)
    torch.sub(x, t, out=t)  # finite entries give +0.0 exactly (x - x), so no -0.0 bit pattern appears
    bits = t.view(_SAME_SIZE_INT[t.element_size()])  # integer count_nonzero: 2x faster on CPU than float
    bad = torch.count_nonzero(bits)
    t.nan_to_num_(nan=0.0)
    inf = torch.count_nonzero(bits)
    return bad - inf, inf, amax
