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
from nanwatch.hooks.measure.token_rows import TokenRows, device_constant
from nanwatch.hooks.rollout.compare import (
    HIST_KEYS,
    ROLLOUT_MAX_KEYS,
    ROLLOUT_SLOTS,
    decode_rollout,
    histogram_bins,
    rollout_rows,
    rollout_sequences,
)
from nanwatch.wire import RlhfStat

__all__ = ["RLHF_SLOTS", "RLHF_TENSORS", "checked_kl", "decode_rlhf", "record_rlhf", "rlhf_probe",
           "rlhf_slots"]

RLHF_TENSORS = ("logprobs", "ref_logprobs", "old_logprobs", "advantages", "rollout_logprobs")
_SUMS = ("tokens", "ratio_n", "clipped", "k1_sum", "k3_sum", "kl_n", "k3r_sum", "k3r_n", "adv_n", "adv_sum",
         "adv_sq")
_MAXES = ("neg_logprob_min", "ratio_max", "k1_max", "k3_max")
_MAX_KEYS = tuple(("rlhf", k) for k in _MAXES)
#: Every slot ``decode_rlhf`` reads, as (kind, name): what a job report reduces across ranks (sums summed,
#: maxima maxed) before decoding once, so its means are token-weighted and its std pooled exactly.
RLHF_SLOTS: tuple[tuple[str, str], ...] = (
    *(("sum", k) for k in (*_SUMS, *(t + pad for t in RLHF_TENSORS for pad in ("", "_pad")))),
    *(("max", k) for k in _MAXES), *ROLLOUT_SLOTS)


def _finite(x: torch.Tensor) -> torch.Tensor:
    # two kernels where ``torch.isfinite`` decomposes into four (== self, abs, != inf, and); NaN < inf is False
    return x.abs() < math.inf


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


def _advantage_rows(rows: TokenRows, a: torch.Tensor, aok: torch.Tensor, one: torch.Tensor) -> None:
    """Per-token advantages: their count, sum and sum of squares (a pooled std across ranks)."""
    for name, value, times in (("adv_n", one, None), ("adv_sum", a, None), ("adv_sq", a, a)):
        rows.sum(("rlhf", name), aok, value, times)


def record_rlhf(rec: Recorder, *, logprobs: torch.Tensor, ref_logprobs: torch.Tensor | None = None,
                old_logprobs: torch.Tensor | None = None, advantages: torch.Tensor | None = None,
                mask: torch.Tensor | None = None, clip_eps: float = 0.2, kl_optimised: str | None = None,
                rollout_logprobs: torch.Tensor | None = None, rollout_cap: float = 2.0) -> None:
    """Launch the device ops for one batch; several calls in a step accumulate. ``kl_optimised`` names
    the KL estimator the trainer's loss uses (``k3_ratio``: k3 weighted by the importance ratio, TRL's
    GRPO default); it is reported as such, and ``k3_ratio`` is computed too. ``advantages`` may be per
    token (the mask's shape) or per sequence (``[B]``, as GRPO's are). ``rollout_logprobs``: the sampler's
    logprobs of the same tokens (``logprobs``' shape), compared by ``nanwatch.hooks.rollout.compare`` with
    the truncation cap ``rollout_cap``.

    Few kernels whatever was passed (``nanwatch.hooks.measure.token_rows``): the inputs stacked and checked
    for finiteness at once, each figure a row, every sum row reduced by one ``sum`` and written by one
    ``index_add_``, every maximum by one ``amax`` and one write; the rollout adds its elementwise ops, a pass
    over its sequences and its histogram's ``index_add_``. 63 device ops with every argument, 18 for logprobs
    and a mask (``tests/hooks/test_rlhf_kernels.py``; ~230 and 26 when each figure was its own reduction and
    write). Only the slots of what was passed are written, as before: a non-finite count's slot existing is how
    the decode knows the tensor was given."""
    if (advantages is not None and mask is not None and advantages.dim() == 1 and mask.dim() == 2
            and advantages.shape[0] == mask.shape[0]):
        advantages = advantages.unsqueeze(1).expand_as(mask)
    rec.mark_rlhf(kl_optimised)
    acc = rec.acc_dtype
    lp = logprobs.detach()
    shape = lp.shape if mask is None else torch.broadcast_shapes(lp.shape, mask.shape)
    rows = TokenRows(shape, lp.device)
    m = rows.const(True) if mask is None else mask.detach().to(torch.bool).expand(shape)
    # stacked in this order: old, policy and ref side by side, so both log-differences are one op (_policy_rows)
    given = {name: t.detach() for name, t in (("old_logprobs", old_logprobs), ("logprobs", lp),
                                              ("ref_logprobs", ref_logprobs), ("advantages", advantages),
                                              ("rollout_logprobs", rollout_logprobs)) if t is not None}
    apart = given.pop("advantages") if "advantages" in given and given["advantages"].shape != shape else None
    values, fin, at = _inputs(rec, rows, given, m)
    lp = values[at["logprobs"]]
    ok = m & fin[at["logprobs"]]
    one = rows.const(1, values.dtype)  # a count's value: every value row is float32, for one-copy stacks
    rows.sum(("rlhf", "tokens"), m, one)
    rows.max(("rlhf", "neg_logprob_min"), ok, -lp)
    _policy_rows(rows, lp, ok, values, at, clip_eps=clip_eps, k3_ratio=kl_optimised == "k3_ratio")
    if "advantages" in at:
        _advantage_rows(rows, values[at["advantages"]], m & fin[at["advantages"]], one)
    # compared only when aligned with the logprobs (``rlhf_probe`` drops one that is not), counted either way
    rollout = "rollout_logprobs" in at and given["rollout_logprobs"].shape == logprobs.shape
    if rollout:
        both = ok & fin[at["rollout_logprobs"]]
        rollout_rows(rows, lp, values[at["rollout_logprobs"]], both, acc=acc, cap=rollout_cap)
        sequences = rollout_sequences(rows, rows.by_sequence(acc))
        rec.slot(HIST_KEYS, rows.weighted(("rlhf", "ro_n")), many=True,
                 at=histogram_bins(rows.weighted(("rlhf", "ro_abs"))))
    keys, totals = rows.totals(acc)
    rec.slot(keys, totals, many=True)
    _, maxima = rows.maxima(acc)
    rec.slot(_MAX_KEYS, maxima[: len(_MAX_KEYS)], how="max", many=True)
    if rollout:  # the comparison's own block: its slots exist only once it was asked for
        log_c = device_constant(math.log(rollout_cap), acc, lp.device).reshape(1)  # float64: the decode's cap
        rec.slot(ROLLOUT_MAX_KEYS, torch.cat([maxima[len(_MAX_KEYS):], sequences, log_c]), how="max", many=True)
    if apart is not None:
        _advantages_apart(rec, apart)


def _inputs(rec: Recorder, rows: TokenRows, given: dict[str, torch.Tensor], m: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor, dict[str, int]]:
    """The per-token inputs stacked (one dtype, the widest given) and checked for finiteness at once, their
    non-finite counts (inside the mask and in the padding) added as rows. Returns the stack as float32 (what
    the figures read), its finiteness there, and each input's row."""
    shape = rows.shape
    at = {name: i for i, name in enumerate(given)}
    stacked = torch.stack([t.expand(shape) for t in given.values()])
    fin = _finite(stacked)
    values = stacked.float()
    bad = torch.logical_not(fin, out=torch.empty_like(values))  # float32 0/1, a value row
    if values is not stacked:  # the figures read float32 (a float64 beyond its range is inf there)
        fin = _finite(values)
    not_m = ~m
    for name, i in at.items():
        if given[name].shape == shape:
            rows.sum(("rlhf", name), m, bad[i])
            rows.sum(("rlhf", name + "_pad"), not_m, bad[i])
        else:  # broadcast to the tokens for the figures, counted over its own elements (no padding to tell)
            rec.slot(("rlhf", name), (~_finite(given[name])).sum(dtype=rec.acc_dtype))
    return values, fin, at


def _policy_rows(rows: TokenRows, lp: torch.Tensor, ok: torch.Tensor, values: torch.Tensor, at: dict[str, int], *,
                 clip_eps: float, k3_ratio: bool) -> None:
    """The ratio's and the KL's rows. Their maxima always (a max row whose mask never holds writes -inf,
    "unset", as an unwritten slot reads), so that the four are one block; their sums only when given."""
    never, one = rows.const(False), rows.const(1, values.dtype)
    i, old, ref = at["logprobs"], at.get("old_logprobs"), at.get("ref_logprobs")
    if old is not None and ref is not None:  # stacked [old, policy, ref]: [lp − old, ref − lp], then both exps
        diffs = values[i : i + 2] - values[i - 1 : i + 1]
        (ratio, exp_d), d = torch.exp(diffs), diffs[1]
    else:
        ratio = None if old is None else torch.exp(lp - values[old])
        d = None if ref is None else values[ref] - lp  # log(ref/policy)
        exp_d = None if d is None else torch.exp(d)
    # exp is >= 0 or NaN, so ``< inf`` is its finiteness in one op (``_finite`` takes two)
    if ratio is not None:
        rok = ok & (ratio < math.inf)
        rows.sum(("rlhf", "ratio_n"), rok, one)
        rows.sum(("rlhf", "clipped"), rok, torch.gt((ratio - 1.0).abs(), clip_eps, out=torch.empty_like(ratio)))
        rows.max(("rlhf", "ratio_max"), rok, ratio)
    else:
        rows.max(("rlhf", "ratio_max"), never, lp)
    if d is None:
        rows.max(("rlhf", "k1_max"), never, lp)
        rows.max(("rlhf", "k3_max"), never, lp)
        return
    k1 = -d
    k3 = exp_d - d - 1.0
    kok = ok & (k3 < math.inf)  # never -inf: exp(d) >= 0, and -d is -inf only where exp(d) is inf (NaN then)
    for name, value in (("kl_n", one), ("k1_sum", k1), ("k3_sum", k3)):
        rows.sum(("rlhf", name), kok, value)
    rows.max(("rlhf", "k1_max"), kok, k1)
    rows.max(("rlhf", "k3_max"), kok, k3)
    if k3_ratio:  # ratio 1 where there are no old logprobs (TRL: one iteration)
        k3r = k3 if ratio is None else k3 * ratio
        rok = kok & _finite(k3r)
        rows.sum(("rlhf", "k3r_n"), rok, one)
        rows.sum(("rlhf", "k3r_sum"), rok, k3r)


def _advantages_apart(rec: Recorder, a: torch.Tensor) -> None:
    """Advantages that are not per token (per sequence with no 2-D mask to spread them over): counted and
    summed over their own elements, unmasked."""
    a = a.float()
    aok = _finite(a)
    rec.slot(("rlhf", "advantages"), (~aok).sum(dtype=rec.acc_dtype))
    sums = torch.stack([aok, torch.where(aok, a, 0.0), torch.where(aok, a * a, 0.0)]).flatten(1)
    rec.slot(tuple(("rlhf", k) for k in ("adv_n", "adv_sum", "adv_sq")), sums.sum(1, dtype=rec.acc_dtype),
             many=True)


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
