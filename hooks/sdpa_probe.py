"""What happens inside an attention call: the SDPA wrapper's body (directive path, backend, output
finiteness, logit bound, mask facts) and the eager scores probe. ``nanwatch.hooks.patching`` routes the
patched functions here, with the :class:`~nanwatch.hooks.probes.Probes` of the Monitor that owns the call.
"""

from __future__ import annotations

import torch

from nanwatch.hooks.dtypes import HALF
from nanwatch.hooks.failsafe import guarded, probe_failed
from nanwatch.hooks.logit import exact_max_logit
from nanwatch.hooks.probes import Frame, Probes
from nanwatch.hooks.recorder import ForwardMeta
from nanwatch.hooks.sdpa_backend import confirmed_backend, lse_of, predict
from nanwatch.wire import dtype_name

__all__ = ["scores_probe", "sdpa_call"]


def sdpa_call(probes: Probes, frame: Frame, orig, q, k, v, mask, dropout, is_causal, scale, enable_gqa, kw):
    """One SDPA call: apply the directive's attention path, run it, measure it. Exceptions from the
    call itself are the user's and propagate; the measuring is guarded."""
    dtype = q.dtype
    directives = probes.directives
    mode = directives.mode
    args = [q, k, v, mask]

    def upcast() -> None:  # directive 'fp32': upcast q/k/v (and a float mask), cast the output back
        if args[0].dtype in HALF:
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
    out = directives.fused_call(frame.site, call, upcast) if mode == "fused" else call()
    guarded(_after_sdpa, probes, frame.site, out, args[0], args[1], args[3], is_causal, scale, predicted, reason)
    return out if out.dtype == dtype else out.to(dtype)


def _after_sdpa(probes: Probes, site, out, q, k, mask, is_causal, scale, predicted, reason) -> None:
    confirmed = confirmed_backend(out)
    backend = confirmed or predicted
    sig = f"q{list(q.shape)} k{list(k.shape)}"
    if mask is not None:
        sig += f" mask:{dtype_name(mask.dtype)}{list(mask.shape)}"
    elif is_causal:
        sig += " causal"
    rec = probes.rec
    rec.sdpa(site, backend, predicted, confirmed is not None, q.dtype, sig,
             None if backend not in ("math", "unknown") else reason)
    probes.site(site, "attention", out)
    lse = lse_of(out)
    if lse is not None:
        rec.logit_heads(site, "lse", lse.reshape(-1, *lse.shape[-2:]).amax(dim=(0, 2)))
    if probes.sampled:
        rec.logit_heads(site, "exact", exact_max_logit(
            q, k, attn_mask=mask, is_causal=is_causal, scale=scale, chunk_elems=probes.exact_chunk_elems))
    fwd = rec.current_forward()
    if fwd is not None:
        if mask is None:
            fwd.plain_causal |= bool(is_causal) and q.shape[-2] > 1
        else:
            fwd.mask_4d_seen |= mask.dim() == 4
            if probes.mask_is_new(fwd, mask):
                _count_masked_rows(probes, fwd, mask)


def _count_masked_rows(probes: Probes, fwd: ForwardMeta, mask: torch.Tensor) -> None:
    if mask.dtype == torch.bool:
        rows = ~mask.any(dim=-1)
    else:
        rows = mask.amax(dim=-1) <= torch.finfo(mask.dtype).min / 2
    probes.rec.forward_count(fwd, "masked_rows", rows.sum(dtype=probes.rec.buf.dtype), how="max")


def scores_probe(probes: Probes, frame: Frame, scores: torch.Tensor) -> None:
    """Eager attention: the softmax input *is* the scaled, masked score matrix [B, H, Q, K]."""
    rec = probes.rec
    s = scores.detach()
    rowmax = s.amax(dim=-1)
    rec.logit_heads(frame.site, "scores", rowmax.amax(dim=(0, 2)))
    fwd = rec.current_forward()
    if fwd is not None and s.is_floating_point():
        dead = (rowmax <= torch.finfo(s.dtype).min / 2).all(dim=1)
        rec.forward_count(fwd, "masked_rows", dead.sum(dtype=rec.buf.dtype), how="max")
