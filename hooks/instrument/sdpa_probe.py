"""What happens inside an attention call: the SDPA wrapper's body (directive path, backend, output
finiteness, logit bound, mask facts) and the eager scores probe. ``nanwatch.hooks.instrument.patching`` routes the
patched functions here, with the :class:`~nanwatch.hooks.instrument.probes.Probes` of the Monitor that owns the call.

Under autocast the wrapper does autocast's cast itself, before predicting: the backend, the reason and
the dtype recorded are those of the tensors SDPA actually runs on, and the ``fp32`` directive can run
the call with autocast off (otherwise autocast would cast the upcast inputs straight back).
"""

from __future__ import annotations

import torch

from nanwatch.hooks.failsafe import contained, probe_failed
from nanwatch.hooks.instrument.probes import Frame, Probes, recomputing
from nanwatch.hooks.measure.dtypes import HALF
from nanwatch.hooks.measure.inputs import dead_rows
from nanwatch.hooks.measure.logit import exact_max_logit
from nanwatch.hooks.measure.recorder import ForwardMeta, Recorder
from nanwatch.hooks.measure.sdpa_backend import confirmed_backend, lse_at_recompute, lse_of, predict
from nanwatch.policy import QUERY_SUFFIX
from nanwatch.wire import dtype_name

__all__ = ["autocast_dtype", "scores_probe", "sdpa_call"]

#: (device type, autocast dtype) -> whether autocast casts SDPA's inputs to that dtype on that device
_CASTS: dict[tuple[str, torch.dtype], bool] = {}


def autocast_dtype(orig, q: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast would run this SDPA call in, or None when autocast leaves it alone. Whether
    SDPA is on autocast's cast list for the device is asked once, of ``orig`` itself, on a tiny input."""
    device = q.device.type
    if not torch.is_autocast_enabled(device):
        return None
    dtype = torch.get_autocast_dtype(device)
    key = (device, dtype)
    if key not in _CASTS:
        x = torch.zeros(1, 1, 1, 8, device=q.device)
        _CASTS[key] = orig(x, x, x).dtype == dtype
    return dtype if _CASTS[key] else None


def sdpa_call(probes: Probes, frame: Frame, orig, q, k, v, mask, dropout, is_causal, scale, enable_gqa, kw):
    """One SDPA call: apply the directive's attention path, run it, measure it. Exceptions from the
    call itself are the user's and propagate; the measuring's are contained (``failsafe.contained``)."""
    directive_state = probes.directive_state
    mode = directive_state.mode
    autocast = autocast_dtype(orig, q)
    out_dtype = autocast or q.dtype  # what the caller would have got without nanwatch
    args = [q, k, v, mask]
    if autocast is not None and mode != "fp32":  # autocast's own cast, done here so everything below sees it
        args = [t if t is None or not t.is_floating_point() else t.to(autocast) for t in args]

    def upcast() -> None:  # directive 'fp32': q/k/v (and a float mask) in fp32, the output cast back
        if any(t.dtype in HALF for t in args[:3]):
            args[:3] = [t.float() for t in args[:3]]
            if args[3] is not None and args[3].is_floating_point():
                args[3] = args[3].float()

    def call():
        if autocast is None:
            return orig(*args, dropout, is_causal, scale=scale, enable_gqa=enable_gqa, **kw)
        with torch.autocast(q.device.type, enabled=False):  # already cast (or upcast on purpose)
            return orig(*args, dropout, is_causal, scale=scale, enable_gqa=enable_gqa, **kw)

    if mode == "fp32":
        upcast()
    recompute = recomputing()
    if not (probes.rerun.rerunning or recompute):  # the call's first run: predict its backend
        try:
            predicted, reason = predict(*args, dropout, is_causal, scale, enable_gqa)
        except Exception as exc:
            probe_failed(exc)
            predicted, reason = "unknown", None
    out = directive_state.fused_call(frame.site, call, upcast) if mode == "fused" else call()
    if probes.rerun.rerunning:  # the differential rerun: the forced path; only whether it stayed finite
        probes.rerun.saw(args[0], out)
    elif recompute:
        # Activation checkpointing re-runs this call in backward (same path, so the recompute matches):
        # it was counted and measured in the first forward; only the logit bound is read now.
        probes.rec.cover(recomputed=1)
        contained(_logit_at_recompute, probes, frame.site, out)
        contained(probes.site, frame.site, "attention", out)  # places the gradient hook only (reentrant)
    else:
        contained(_after_sdpa, probes, frame.site, out, args[0], args[1], args[3], is_causal, scale,
                  predicted, reason)
    return out if out.dtype == out_dtype else out.to(out_dtype)


@torch.no_grad()  # nothing may be saved for backward during a recompute
def _logit_at_recompute(probes: Probes, site: str, out: torch.Tensor) -> None:
    lse = lse_at_recompute(out)
    if lse is not None:
        probes.rec.logit_heads(site, "lse", lse.reshape(-1, *lse.shape[-2:]), dim=(0, 2))


def _after_sdpa(probes: Probes, site, out, q, k, mask, is_causal, scale, predicted, reason) -> None:
    confirmed = confirmed_backend(out)
    backend = confirmed or predicted
    sig = f"q{list(q.shape)} k{list(k.shape)}"
    if mask is not None:
        sig += f" mask:{dtype_name(mask.dtype)}{list(mask.shape)}"
    elif is_causal:
        sig += " causal"
    rec = probes.rec
    stage = probes.stage()
    rec.cover(attention=1, probed=1, layer=site if stage == "train" else None)
    rec.sdpa(site, backend, predicted, confirmed is not None, q.dtype, sig,
             None if backend not in ("math", "unknown") else reason, stage=stage)
    if backend not in ("math", "unknown"):
        # A fused kernel can return a finite output for a NaN in the query (CPU flash does on a CPU with
        # AVX-512, measured on torch 2.13: the NaN only shows in the gradients, one layer too late; with AVX2
        # alone it propagates). Read the query too, and before the output: the input of a call comes first
        # in execution order, so a NaN in q is named at the query whatever the kernel does with it.
        rec.tensor(site + QUERY_SUFFIX, "attention", "forward", q, stage)
    probes.site(site, "attention", out)
    lse = lse_of(out)
    if lse is not None:  # the per-head bound: one reduction, straight into its row
        rec.logit_heads(site, "lse", lse.reshape(-1, *lse.shape[-2:]), dim=(0, 2))
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
    _count_max(probes.rec, fwd.key("masked_rows"), dead_rows(mask))


def _count_max(rec: Recorder, key, flags: torch.Tensor) -> None:
    """One call's count of the true elements of ``flags`` for the figure ``key`` (a forward's fully masked rows,
    the max over its layers): one ``sum`` into a fresh row of ``rec.maxes``, in the accumulation dtype."""
    row = rec.maxes.row(key, 1, rec.acc_dtype, flags.device)
    torch.sum(flags, dim=tuple(range(flags.dim())), dtype=rec.acc_dtype, out=row.reshape(()))


def scores_probe(probes: Probes, frame: Frame, scores: torch.Tensor) -> None:
    """Eager attention: the softmax input *is* the scaled, masked score matrix [B, H, Q, K]."""
    if probes.rerun.rerunning or recomputing():
        return  # read in the first forward already (or a rerun, which measures nothing)
    rec = probes.rec
    s = scores.detach()
    rowmax = s.amax(dim=-1)  # [B, H, Q]
    rec.logit_heads(frame.site, "scores", rowmax, dim=(0, 2))
    fwd = rec.current_forward()
    if fwd is not None and s.is_floating_point():
        # a row dead in every head: its max over the heads is (a NaN row is not dead, as with ``all``); the
        # max over heads reads the row maxima once, where ``(rowmax <= c).all(dim=1)`` wrote and read a mask
        dead = rowmax.amax(dim=1) <= torch.finfo(s.dtype).min / 2
        _count_max(rec, fwd.key("masked_rows"), dead)
