"""Rollout against trainer: the sampler's logprobs of the tokens it drew and the trainer's of the same tokens,
compared on the device.

Δlogp = trainer − rollout, over the unmasked tokens where both are finite (the rollout's own non-finite values
are counted by ``record_rlhf``, never replaced). Everything is a sum or a maximum in the step's slot buffer, so
several calls in a step accumulate and a job report reduces the slots exactly across ranks before decoding:

* sums (one block, one device add): token and sequence counts; Σ Δ, Σ |Δ|, Σ Δ²; Σ k3 with
  k3 = r − 1 − log r, r = exp(Δ) (the estimate of KL(rollout ‖ trainer) from tokens the rollout sampled, as
  verl's ``rollout_corr`` computes it); the truncated tokens (r outside [1/c, c]); the moments of the two
  token-probability vectors (for their Pearson correlation) and of the two logprob vectors (for the slope of
  rollout on trainer: 1/T when the sampler alone divides the logits by a temperature T); the outlier
  sequences; and a histogram of |Δ| in :data:`EDGES` (for the 99th percentile);
* maxima (one block): max |Δ|, the largest and smallest sequence log-ratio Σ Δ, the worst sequence's mean
  |Δ|, and log c (so the decode knows the cap).

The percentile is read from the histogram: 64 log-spaced bins from 1e-6 to 100, interpolated in log space
within the bin where the cumulative count crosses 99 %, so it is within one bin (a factor 10**(8/64) ≈ 1.33)
of the exact value, and exact across ranks (counts add). Below 1e-6 it reads 0 to 1e-6 linearly; above 100,
the maximum.
"""

from __future__ import annotations

import math

import torch

from nanwatch.hooks.measure.recorder import Recorder
from nanwatch.wire import MAX_ROLLOUT_COUNT, MAX_ROLLOUT_FIGURE, RolloutStat

__all__ = ["EDGES", "OUTLIER_FACTOR", "OUTLIER_FLOOR", "ROLLOUT_SLOTS", "decode_rollout", "record_rollout"]

#: |Δlogp| histogram edges: bin 0 is [0, 1e-6), bin i is [EDGES[i-1], EDGES[i]), the last bin [100, inf).
_PER_DECADE = 8
EDGES = tuple(10.0 ** (-6 + i / _PER_DECADE) for i in range(8 * _PER_DECADE + 1))
#: A sequence is an outlier when its mean |Δ| exceeds this many times the median sequence's, and the floor.
OUTLIER_FACTOR, OUTLIER_FLOOR = 8.0, 0.05
_QUANTILE = 0.99

_SUMS = ("n", "seqs", "d", "abs", "sq", "k3", "trunc", "outliers",
         "px", "py", "pxx", "pyy", "pxy", "x", "y", "xx", "xy")
_HIST = tuple(f"h{i:02d}" for i in range(len(EDGES) + 1))
_MAXES = ("abs_max", "seq_max", "neg_seq_min", "seq_abs_max", "log_cap")
#: Every slot the comparison writes, as (kind, name), for ``RLHF_SLOTS`` (the job report's reduction).
ROLLOUT_SLOTS: tuple[tuple[str, str], ...] = (*(("sum", "ro_" + k) for k in (*_SUMS, *_HIST)),
                                              *(("max", "ro_" + k) for k in _MAXES))
_SUM_KEYS = tuple(("rlhf", "ro_" + k) for k in (*_SUMS, *_HIST))
_MAX_KEYS = tuple(("rlhf", "ro_" + k) for k in _MAXES)


def record_rollout(rec: Recorder, lp: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, cap: float) -> None:
    """Launch the comparison of ``lp`` (the trainer's logprobs, float32) with ``rollout`` over ``mask`` (bool,
    ``lp``'s shape; ``[B, T]``: one row a sequence). Device ops only: two block writes into the slot buffer."""
    if lp.dim() < 2:
        lp, rollout, mask = lp.reshape(1, -1), rollout.reshape(1, -1), mask.reshape(1, -1)
    acc = rec.acc_dtype
    r = rollout.detach().to(lp.dtype)
    ok = mask & torch.isfinite(lp) & torch.isfinite(r)
    zero = torch.zeros((), dtype=lp.dtype, device=lp.device)
    x, y = torch.where(ok, lp, zero), torch.where(ok, r, zero)
    d = x - y
    a = d.abs()
    okf = ok.to(acc)
    d64 = d.to(acc)
    k3 = torch.where(ok, torch.expm1(d64) - d64, 0.0)
    log_c = math.log(cap)
    px, py = torch.where(ok, torch.exp(x), zero), torch.where(ok, torch.exp(y), zero)
    seq_n = okf.sum(1)
    has = seq_n > 0
    seq_d = d64.sum(1)
    seq_abs = a.to(acc).sum(1) / seq_n.clamp(min=1.0)
    typical = torch.where(has, seq_abs, math.nan).nanmedian()  # NaN when no sequence has a token: no outlier
    outlier = has & (seq_abs > torch.clamp(OUTLIER_FACTOR * typical, min=OUTLIER_FLOOR))
    # the bin by arithmetic, not searchsorted (10 ms for 400 values on a CPU): 8 bins a decade from 1e-6
    index = ((torch.log10(a) + 6.0) * _PER_DECADE + 1.0).floor_().clamp_(0, len(EDGES)).long()
    hist = torch.zeros(len(_HIST), dtype=acc, device=a.device).scatter_add_(0, index.reshape(-1), okf.reshape(-1))

    def s(v: torch.Tensor) -> torch.Tensor:
        return v.sum(dtype=acc)

    sums = torch.stack([
        okf.sum(), s(has), s(d64), s(a), s(d64 * d64), s(k3), s(ok & (a > log_c)), s(outlier),
        s(px), s(py), s(px * px), s(py * py), s(px * py), s(x), s(y), s(x * x), s(x * y)])
    none = torch.full((), -math.inf, dtype=acc, device=a.device)
    maxes = torch.stack([
        torch.where(ok, a.to(acc), none).amax(), torch.where(has, seq_d, none).amax(),
        torch.where(has, -seq_d, none).amax(), torch.where(has, seq_abs, none).amax(),
        torch.full((), log_c, dtype=acc, device=a.device)])
    rec.slot(_SUM_KEYS, torch.cat([sums, hist]), many=True)
    rec.slot(_MAX_KEYS, maxes, how="max", many=True)


def _quantile(hist: list[float], n: float, abs_max: float | None, q: float = _QUANTILE) -> float | None:
    if n <= 0:
        return None
    target, seen = q * n, 0.0
    for i, count in enumerate(hist):
        if count and seen + count >= target:
            frac = (target - seen) / count
            if i == 0:
                return EDGES[0] * frac
            if i == len(EDGES):
                return abs_max
            lo, hi = math.log(EDGES[i - 1]), math.log(EDGES[i])
            return min(math.exp(lo + frac * (hi - lo)), abs_max if abs_max is not None else math.inf)
        seen += count
    return abs_max


def _pearson(n: float, sx: float, sy: float, sxx: float, syy: float, sxy: float) -> float | None:
    vx, vy = sxx - sx * sx / n, syy - sy * sy / n
    if vx <= 0 or vy <= 0:
        return None
    return max(-1.0, min(1.0, (sxy - sx * sy / n) / math.sqrt(vx * vy)))


def decode_rollout(get) -> RolloutStat | None:
    """The comparison's figures from decoded slots (``get(kind, key, default)``, as ``decode_rlhf``'s), or None
    when no step call passed rollout logprobs."""
    cap = get("max", ("rlhf", "ro_log_cap"), -math.inf)
    if cap is None or cap == -math.inf:
        return None
    v = {k: get("sum", ("rlhf", "ro_" + k), 0.0) for k in _SUMS}
    x = {k: get("max", ("rlhf", "ro_" + k), -math.inf) for k in _MAXES}
    some = {k: (None if x[k] == -math.inf else x[k]) for k in _MAXES}
    n = v["n"]
    mean = (lambda key: v[key] / n) if n else (lambda key: None)  # noqa: E731
    slope = None
    if n > 1 and (var_x := v["xx"] - v["x"] ** 2 / n) > 0:
        slope = (v["xy"] - v["x"] * v["y"] / n) / var_x

    def ratio(log_ratio: float | None) -> float | None:
        return None if log_ratio is None else math.exp(min(log_ratio, 709.0))

    return RolloutStat(
        tokens=_count(n), sequences=_count(v["seqs"]), cap=_figure(math.exp(cap), low=1.0 + 1e-9),
        abs_mean=_figure(mean("abs")), abs_max=_figure(some["abs_max"]),
        abs_p99=_figure(_quantile([get("sum", ("rlhf", "ro_" + h), 0.0) for h in _HIST], n, some["abs_max"])),
        mean=_figure(mean("d"), low=-MAX_ROLLOUT_FIGURE), rms=_figure(math.sqrt(max(0.0, v["sq"] / n)) if n else None),
        k3_mean=_figure(mean("k3")),
        seq_ratio_max=ratio(some["seq_max"]),
        seq_ratio_min=ratio(None if some["neg_seq_min"] is None else -some["neg_seq_min"]),
        truncated_fraction=mean("trunc"),
        prob_correlation=_pearson(n, v["px"], v["py"], v["pxx"], v["pyy"], v["pxy"]) if n > 1 else None,
        logprob_slope=_figure(slope, low=-MAX_ROLLOUT_FIGURE), seq_abs_mean_max=_figure(some["seq_abs_max"]),
        outlier_sequences=_count(v["outliers"]))


def _figure(value: float | None, *, low: float = 0.0) -> float | None:
    """A figure within the wire's bounds (1.12: finite, ``MAX_ROLLOUT_FIGURE`` at most): an overflowed k3 or a
    slope over a vanishing variance is clamped, so that the step's report is never refused for it; a NaN (no
    finite token gave it) is no figure."""
    if value is None or value != value:
        return None
    return min(max(value, low), MAX_ROLLOUT_FIGURE)


def _count(value: float) -> int:
    return min(int(value), MAX_ROLLOUT_COUNT)
