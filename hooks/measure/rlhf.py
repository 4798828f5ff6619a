"""Policy-gradient health (PPO/GRPO): logprobs, importance ratios, KL and advantages, on the device.

Non-finite values are the signal, so they are counted, never filtered: inside the mask and, separately,
outside it (a NaN in a padded position still poisons a loss computed as ``(x * mask).sum()``, since
``0 * NaN`` is NaN). The other statistics are taken over finite, unmasked entries so that they stay
readable while the counts say how much was left out.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from nanwatch.hooks.failsafe import contained
from nanwatch.hooks.measure.recorder import Recorder
from nanwatch.hooks.measure.rollout import ROLLOUT_SLOTS, decode_rollout, record_rollout
from nanwatch.wire import RlhfStat

__all__ = ["RLHF_SLOTS", "RLHF_TENSORS", "checked_kl", "decode_rlhf", "record_rlhf", "rlhf_probe",
           "rlhf_slots"]

RLHF_TENSORS = ("logprobs", "ref_logprobs", "old_logprobs", "advantages", "rollout_logprobs")
_SUMS = ("tokens", "ratio_n", "clipped", "k1_sum", "k3_sum", "kl_n", "k3r_sum", "k3r_n", "adv_n", "adv_sum",
         "adv_sq")
_MAXES = ("neg_logprob_min", "ratio_max", "k1_max", "k3_max")
#: Every slot ``decode_rlhf`` reads, as (kind, name): what a job report reduces across ranks (sums summed,
#: maxima maxed) before decoding once, so its means are token-weighted and its std pooled exactly.
RLHF_SLOTS: tuple[tuple[str, str], ...] = (
    *(("sum", k) for k in (*_SUMS, *(t + pad for t in RLHF_TENSORS for pad in ("", "_pad")))),
    *(("max", k) for k in _MAXES), *ROLLOUT_SLOTS)


def _count(rec: Recorder, name: str, x: torch.Tensor) -> None:
    rec.slot(("rlhf", name), x.sum(dtype=rec.acc_dtype))


def _where(ok: torch.Tensor, x: torch.Tensor, fill: float) -> torch.Tensor:
    return torch.where(ok, x, torch.full((), fill, dtype=x.dtype, device=x.device))


#: ``record_rlhf``'s keyword arguments that ``Monitor.rlhf`` passes through.
_ARGUMENTS = ("ref_logprobs", "old_logprobs", "advantages", "mask", "clip_eps", "rollout_logprobs", "rollout_cap")


def checked_kl(kl_optimised: str | None, warn: Callable[[str], None]) -> str | None:
    """``kl_optimised`` if it names an estimator nanwatch reports (k1, k3, k3_ratio), else None, warned."""
    if kl_optimised not in (None, "k1", "k3", "k3_ratio"):
        warn(f"rlhf(kl_optimised={kl_optimised!r}) ignored: use 'k1', 'k3' or 'k3_ratio'")
        return None
    return kl_optimised


def rlhf_probe(rec: Recorder, *, site: Callable[[str, str, torch.Tensor], None], warn: Callable[[str], None],
               logprobs: torch.Tensor, kl_optimised: str | None = None, **tensors: Any) -> dict[str, Any]:
    """``Monitor.rlhf``'s body: ``logprobs`` measured as the site ``rlhf.logprobs`` (``site``, the probes'),
    then :func:`record_rlhf` (``tensors``: its other arguments), ``kl_optimised`` checked first (a name
    nanwatch does not report is warned about and dropped), a ``rollout_logprobs`` of another shape and an
    unknown argument too. Each part that fails only warns. Returns what the attribution keeps: the
    sequences (``input_ids``, ``attention_mask``) with both logprob sets and the mask."""
    kl_optimised = checked_kl(kl_optimised, warn)
    kept = {k: tensors.pop(k, None) for k in ("input_ids", "attention_mask")}
    for name in set(tensors) - set(_ARGUMENTS):
        warn(f"rlhf({name}=) ignored: not an argument of Monitor.rlhf")
        del tensors[name]
    rollout = tensors.get("rollout_logprobs")
    if rollout is not None and getattr(rollout, "shape", None) != logprobs.shape:
        warn(f"rlhf(rollout_logprobs=) ignored: its shape {tuple(getattr(rollout, 'shape', ()))} is not "
             f"logprobs' {tuple(logprobs.shape)} (the sampler's logprobs of the same tokens, aligned)")
        tensors["rollout_logprobs"] = rollout = None
    contained(site, "rlhf.logprobs", "logprob", logprobs)
    contained(record_rlhf, rec, logprobs=logprobs, kl_optimised=kl_optimised, **tensors)
    return {**kept, "logprobs": logprobs, "rollout_logprobs": rollout, "mask": tensors.get("mask")}


def record_rlhf(rec: Recorder, *, logprobs: torch.Tensor, ref_logprobs: torch.Tensor | None = None,
                old_logprobs: torch.Tensor | None = None, advantages: torch.Tensor | None = None,
                mask: torch.Tensor | None = None, clip_eps: float = 0.2, kl_optimised: str | None = None,
                rollout_logprobs: torch.Tensor | None = None, rollout_cap: float = 2.0) -> None:
    """Launch the device ops for one batch; several calls in a step accumulate. ``kl_optimised`` names
    the KL estimator the trainer's loss uses (``k3_ratio``: k3 weighted by the importance ratio, TRL's
    GRPO default); it is reported as such, and ``k3_ratio`` is computed too. ``advantages`` may be per
    token (the mask's shape) or per sequence (``[B]``, as GRPO's are). ``rollout_logprobs``: the sampler's
    logprobs of the same tokens (``logprobs``' shape), compared by ``nanwatch.hooks.measure.rollout`` with
    the truncation cap ``rollout_cap``."""
    if (advantages is not None and mask is not None and advantages.dim() == 1 and mask.dim() == 2
            and advantages.shape[0] == mask.shape[0]):
        advantages = advantages.unsqueeze(1).expand_as(mask)
    rec.mark_rlhf(kl_optimised)
    lp = logprobs.detach().float()
    m = torch.ones_like(lp, dtype=torch.bool) if mask is None else mask.detach().to(torch.bool)
    tensors = {"logprobs": lp, "ref_logprobs": ref_logprobs, "old_logprobs": old_logprobs,
               "advantages": advantages, "rollout_logprobs": rollout_logprobs}
    for name, t in tensors.items():
        if t is None:
            continue
        t = t.detach()
        bad = ~torch.isfinite(t)
        if t.shape == m.shape:
            _count(rec, name, bad & m)
            _count(rec, name + "_pad", bad & ~m)
        else:
            _count(rec, name, bad)
    ok = m & torch.isfinite(lp)
    _count(rec, "tokens", m)
    if rollout_logprobs is not None and rollout_logprobs.shape == lp.shape:
        record_rollout(rec, lp, rollout_logprobs, m, rollout_cap)
    rec.slot(("rlhf", "neg_logprob_min"), _where(ok, -lp, -math.inf).amax(), how="max")
    if old_logprobs is not None:
        ratio = torch.exp(lp - old_logprobs.detach().float())
        rok = ok & torch.isfinite(ratio)
        _count(rec, "ratio_n", rok)
        _count(rec, "clipped", rok & ((ratio - 1.0).abs() > clip_eps))
        rec.slot(("rlhf", "ratio_max"), _where(rok, ratio, -math.inf).amax(), how="max")
    if ref_logprobs is not None:
        d = ref_logprobs.detach().float() - lp  # log(ref/policy)
        k1 = -d
        k3 = torch.exp(d) - d - 1.0
        kok = ok & torch.isfinite(k3)
        _count(rec, "kl_n", kok)
        rec.slot(("rlhf", "k1_sum"), _where(kok, k1, 0.0).sum(dtype=rec.acc_dtype))
        rec.slot(("rlhf", "k3_sum"), _where(kok, k3, 0.0).sum(dtype=rec.acc_dtype))
        rec.slot(("rlhf", "k1_max"), _where(kok, k1, -math.inf).amax(), how="max")
        rec.slot(("rlhf", "k3_max"), _where(kok, k3, -math.inf).amax(), how="max")
        if kl_optimised == "k3_ratio":  # ratio 1 where there are no old logprobs (TRL: one iteration)
            k3r = k3 if old_logprobs is None else k3 * ratio  # the ratio computed above
            rok = kok & torch.isfinite(k3r)
            _count(rec, "k3r_n", rok)
            rec.slot(("rlhf", "k3r_sum"), _where(rok, k3r, 0.0).sum(dtype=rec.acc_dtype))
    if advantages is not None:
        a = advantages.detach().float()
        aok = torch.isfinite(a) & (m if a.shape == m.shape else True)
        _count(rec, "adv_n", aok)
        rec.slot(("rlhf", "adv_sum"), _where(aok, a, 0.0).sum(dtype=rec.acc_dtype))
        rec.slot(("rlhf", "adv_sq"), _where(aok, a * a, 0.0).sum(dtype=rec.acc_dtype))


def rlhf_slots(get) -> dict[tuple[str, str], float]:
    """The RLHF slots a step wrote (``get`` as for ``decode_rlhf``); a slot never written is left out."""
    out = {}
    for kind, name in RLHF_SLOTS:
        v = get(kind, ("rlhf", name), None)
        if v is not None:
            out[(kind, name)] = v
    return out


def decode_rlhf(get, kl_optimised: str | None = None) -> RlhfStat:
    """Build the wire stats from decoded slot values (``get(kind, key, default)``)."""
    s = {k: get("sum", ("rlhf", k), 0.0) for k in _SUMS}
    x = {k: get("max", ("rlhf", k), -math.inf) for k in _MAXES}

    def some(v: float) -> float | None:
        return None if v == -math.inf else v

    def mean(total: str, n: str) -> float | None:
        return s[total] / s[n] if s[n] else None

    adv_std = None
    if s["adv_n"] > 1:
        mu = s["adv_sum"] / s["adv_n"]
        adv_std = math.sqrt(max(0.0, s["adv_sq"] / s["adv_n"] - mu * mu))
    neg_min = some(x["neg_logprob_min"])
    return RlhfStat(
        nonfinite={k: int(get("sum", ("rlhf", k), 0.0)) for t in RLHF_TENSORS for k in (t, t + "_pad")
                   if get("sum", ("rlhf", k), -1.0) >= 0},
        tokens=int(s["tokens"]),
        logprob_min=None if neg_min is None else -neg_min,
        ratio_max=some(x["ratio_max"]),
        clip_fraction=mean("clipped", "ratio_n"),
        kl_k1_mean=mean("k1_sum", "kl_n"), kl_k1_max=some(x["k1_max"]),
        kl_k3_mean=mean("k3_sum", "kl_n"), kl_k3_max=some(x["k3_max"]),
        kl_k3_ratio_mean=mean("k3r_sum", "k3r_n"), kl_optimised=kl_optimised,
        advantage_std=adv_std, rollout=decode_rollout(get),
    )
