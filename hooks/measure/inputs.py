"""Input fingerprint: what each forward was fed. Shapes are read on the host; counts stay on the device.

It automates the first checks after a NaN: the position_ids layout (2-D, 3-D mRoPE, 4-D), the mask kind,
fully masked query rows, and whether a packed batch (position_ids restarting inside a row) met plain
causal attention, which is HF's cross-document leak when a cache is built during training.
"""

from __future__ import annotations

import inspect

import torch

from nanwatch.hooks.measure.recorder import ForwardMeta, Recorder

__all__ = ["dead_rows", "position_layout", "record_forward_inputs", "mask_kind"]

_LAYOUTS = {2: "2d", 3: "3d_mrope", 4: "4d"}


def mask_kind(mask) -> str:
    if mask is None:
        return "none"
    if isinstance(mask, torch.Tensor):
        return {2: "padding_2d", 4: "4d"}.get(mask.dim(), "other")
    return "other"


def dead_rows(mask: torch.Tensor) -> torch.Tensor:
    """``mask[..., q, :]`` leaves query row ``q`` nothing to attend to: a boolean mask with no True in the
    row, or an additive one whose row is all at the dtype's minimum (HF's masked value). Shape: the mask's
    without its last dimension."""
    if mask.dtype == torch.bool:
        return ~mask.any(dim=-1)
    return mask.amax(dim=-1) <= torch.finfo(mask.dtype).min / 2


def position_layout(rec: Recorder, fwd: ForwardMeta, pos: torch.Tensor,
                    mask2d: torch.Tensor | None = None) -> None:
    """Record the layout of ``pos`` and count position restarts (packing) on the device."""
    fwd.position_ids = _LAYOUTS.get(pos.dim(), "other")
    # mRoPE ids are [3 or 4, B, S]; their first row is the temporal/text position.
    text = pos if pos.dim() == 2 else pos[0] if pos.dim() == 3 else None
    if text is None or text.shape[-1] < 2 or text.is_floating_point():
        return
    restart = torch.diff(text, dim=-1) != 1
    if mask2d is not None and mask2d.shape == text.shape:
        real = mask2d.to(torch.bool)
        restart = restart & real[..., 1:] & real[..., :-1]  # padding is not a document boundary
    rec.slot(fwd.key("resets"), restart.sum(dtype=rec.acc_dtype))
    fwd.packed_checked = True


def record_forward_inputs(rec: Recorder, sig: inspect.Signature, args: tuple, kwargs: dict) -> None:
    """Root-module pre-hook body: open a new forward and fingerprint its inputs."""
    try:
        bound = sig.bind_partial(*args, **kwargs).arguments
    except TypeError:
        bound = {}
    pos = kwargs.get("position_ids", bound.get("position_ids"))
    mask = kwargs.get("attention_mask", bound.get("attention_mask"))
    fwd = rec.forward_begin("none", mask_kind(mask))
    if isinstance(pos, torch.Tensor):
        m2 = mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
        position_layout(rec, fwd, pos, m2)
