"""What happens inside an attention call: the SDPA wrapper's body (directive path, backend, output
finiteness, logit bound, mask facts) and the eager scores probe. ``nanwatch.hooks.attention`` routes the
patched functions here; the Monitor owns the recorder they write into.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from nanwatch.hooks.guard import guarded, probe_failed
from nanwatch.hooks.logit import exact_max_logit
from nanwatch.hooks.sdpa_backend import confirmed_backend, lse_of, predict

if TYPE_CHECKING:  # pragma: no cover
    from nanwatch.hooks.attention import Frame
    from nanwatch.hooks.monitor import Monitor

__all__ = ["scores_probe", "sdpa_call"]

_HALF = (torch.float16, torch.bfloat16)


def sdpa_call(mon: Monitor, frame: Frame, orig, q, k, v, mask, dropout, is_causal, scale, enable_gqa, kw):
    """One SDPA call: apply the directive's attention path, run it, measure it. Exceptions from the
    call itself are the user's and propagate; the measuring is guarded."""
    dtype = q.dtype
    mode = mon.directives.mode
    args = [q, k, v, mask]

    def upcast() -> None:  # directive 'fp32': upcast q/k/v (and a float mask), cast the output back
        if args[0].dtype in _HALF:
            args[:3] = [t.float() for t in args[:3]]
            if args[3] is not None and args[3].is_floating_point():
                args[3] = args[3].float()

    def call():
        return orig(*args, dropout, is_causal, scale=scale, enable_gqa=enable_gqa, **kw)

    if mode == "fp32":
        upcast()
    try:
        predicted, reason = predict(*args, dropout, is_causal, scale, enable_gqa)
    except Exception as exc:
        probe_failed(exc)
        predicted, reason = "unknown", None
    out = mon.directives.fused_call(frame.site, call, upcast) if mode == "fused" else call()
    guarded(_after_sdpa, mon, frame.site, out, args[0], args[1], args[3], is_causal, scale, predicted, reason)
    return out if out.dtype == dtype else out.to(dtype)


def _after_sdpa(mon: Monitor, site, out, q, k, mask, is_causal, scale, predicted, reason) -> None:
    confirmed = confirmed_backend(out)
    backend = confirmed or predicted
    sig = f"q{list(q.shape)} k{list(k.shape)}"
    if mask is not None:
        sig += f" mask:{str(mask.dtype).removeprefix('torch.')}{list(mask.shape)}"
    elif is_causal:
        sig += " causal"
    mon.rec.sdpa(site, backend, predicted, confirmed is not None, q.dtype, sig,
                 None if backend not in ("math", "unknown") else reason)
    mon._site(site, "attention", out)
    lse = lse_of(out)
    if lse is not None:
        mon.rec.logit_heads(site, "lse", lse.reshape(-1, *lse.shape[-2:]).amax(dim=(0, 2)))
    if mon._sampled:
        mon.rec.logit_heads(site, "exact", exact_max_logit(
            q, k, attn_mask=mask, is_causal=is_causal, scale=scale,
            chunk_elems=mon.config.exact_logit_chunk_elems))
    fwd = mon.rec.current_forward()
    if fwd is not None:
        if mask is None:
            fwd.plain_causal |= bool(is_causal) and q.shape[-2] > 1
        else:
            fwd.mask_4d_seen |= mask.dim() == 4
            _count_masked_rows(mon, fwd, mask)


def _count_masked_rows(mon: Monitor, fwd, mask: torch.Tensor) -> None:
    key = (fwd.index, mask.data_ptr(), mask._version)
    if key in mon._masks_seen:  # every layer gets the same mask: count it once per forward
        return
    mon._masks_seen.add(key)
    if mask.dtype == torch.bool:
        rows = ~mask.any(dim=-1)
    else:
        rows = mask.amax(dim=-1) <= torch.finfo(mask.dtype).min / 2
    mon.rec.forward_count(fwd, "masked_rows", rows.sum(dtype=mon.rec.buf.dtype), how="max")


def scores_probe(mon: Monitor, frame: Frame, scores: torch.Tensor) -> None:
    """Eager attention: the softmax input *is* the scaled, masked score matrix [B, H, Q, K]."""
    s = scores.detach()
    rowmax = s.amax(dim=-1)
    mon.rec.logit_heads(frame.site, "scores", rowmax.amax(dim=(0, 2)))
    fwd = mon.rec.current_forward()
    if fwd is not None and s.is_floating_point():
        dead = (rowmax <= torch.finfo(s.dtype).min / 2).all(dim=1)
        mon.rec.forward_count(fwd, "masked_rows", dead.sum(dtype=mon.rec.buf.dtype), how="max")
