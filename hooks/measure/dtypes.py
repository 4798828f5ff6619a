"""Torch's side of the wire's dtype facts. The half-precision set is defined once, in ``nanwatch.wire``
(by name); this module turns it into torch dtypes and caches each dtype's largest finite value."""

from __future__ import annotations

import torch

from nanwatch.wire import HALF_DTYPES, dtype_name

__all__ = ["HALF", "finfo_max"]

#: fp16 and bf16 as torch dtypes (from ``nanwatch.wire.HALF_DTYPES``).
HALF: tuple[torch.dtype, ...] = tuple(getattr(torch, name) for name in sorted(HALF_DTYPES))

_FINFO_MAX: dict[str, float] = {}


def finfo_max(dtype: torch.dtype) -> float:
    """The largest finite value of ``dtype`` (integer dtypes: their max), the denominator of headroom."""
    name = dtype_name(dtype)
    if name not in _FINFO_MAX:
        fp = dtype.is_floating_point or dtype.is_complex
        _FINFO_MAX[name] = float(torch.finfo(dtype).max if fp else torch.iinfo(dtype).max)
    return _FINFO_MAX[name]
