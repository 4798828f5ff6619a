"""Rollout against trainer: the sampler's logprobs of the tokens it drew and the trainer's of the same tokens,
compared on the device.

Δlogp = trainer − rollout, over the unmasked tokens where both are finite (the rollout's own non-finite values
are counted by ``record_rlhf``, never replaced). Everything is a sum or a maximum in the step's slot buffer, so
several calls in a step accumulate and a job report reduces the slots exactly across ranks before decoding:

* sums (rows of ``record_rlhf``'s, written with its other sums by one ``index_add_``): token and sequence
  counts; Σ Δ, Σ |Δ|, Σ Δ²; Σ k3 with
  k3 = r − 1 − log r, r = exp(Δ) (the estimate of KL(rollout ‖ trainer) from tokens the rollout sampled, as
  verl's ``rollout_corr`` computes it); the truncated tokens (r outside [1/c, c]); the moments of the two
  token-probability vectors (for their Pearson correlation) and of the two logprob vectors (for the slope of
  rollout on trainer: 1/T when the sampler alone divides the logits by a temperature T); the outlier
  sequences; and a histogram of |Δ| in :data:`EDGES` (for the 99th percentile; one ``index_add_`` by bin);
* maxima (one block, one device op): max |Δ|, the largest and smallest sequence log-ratio Σ Δ, the worst sequence's mean
  |Δ|, and log c (so the decode knows the cap).

The percentile is read from the histogram: 64 log-spaced bins from 1e-6 to 100, interpolated in log space
within the bin where the cumulative count crosses 99 %, so it is within one bin (a factor 10**(8/64) ≈ 1.33)
of the exact value, and exact across ranks (counts add). Below 1e-6 it reads 0 to 1e-6 linearly; above 100,
the maximum.
"""

from __future__ import annotations

import math
import struct

import torch

from nanwatch.hooks.measure.token_rows import TokenRows, device_constant
from nanwatch.wire import MAX_ROLLOUT_COUNT, MAX_ROLLOUT_FIGURE, RolloutStat

__all__ = ["EDGES", "HIST_KEYS", "OUTLIER_FACTOR", "OUTLIER_FLOOR", "ROLLOUT_MAX_KEYS", "ROLLOUT_SLOTS",
           "decode_rollout", "histogram_bins", "rollout_rows", "rollout_sequences"]

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
#: The |Δ| histogram's slots, and the comparison's maxima (one block, in ``_MAXES`` order).
HIST_KEYS = tuple(("rlhf", "ro_" + k) for k in _HIST)
ROLLOUT_MAX_KEYS = tuple(("rlhf", "ro_" + k) for k in _MAXES)


def rollout_rows(rows: TokenRows, lp: torch.Tensor, rollout: torch.Tensor, ok: torch.Tensor, *, acc: torch.dtype,
                 cap: float) -> None:
    """Add the comparison's token rows to ``rows`` (``record_rlhf``'s): ``lp`` the trainer's logprobs, ``rollout``
    the sampler's (float32), ``ok`` the unmasked tokens where both are finite; every row is masked by ``ok``, so
    the values need no masking of their own. Every row is float32, as the rows' stack must be one dtype to be one
    copy on a GPU: Δ, |Δ| and the moments' factors as before (their products in the stack); k3 = expm1(Δ) − Δ is
    taken in float64 (it cancels: in float32 it would lose the small Δ that matter), then rounded once."""
    d = lp - rollout
    a = d.abs()
    d64 = d.to(acc)
    k3 = torch.sub(torch.expm1(d64), d64, out=torch.empty_like(d))
    # |Δ| is exactly a float32, so it is compared with the float32 log c, as it always was
    log_c = struct.unpack("f", struct.pack("f", math.log(cap)))[0]
    trunc = torch.gt(a, log_c, out=torch.empty_like(d))
    px, py = torch.exp(lp), torch.exp(rollout)
    one = rows.const(1, d.dtype)
    for name, value, times in (
            ("n", one, None), ("d", d, None), ("abs", a, None), ("sq", d, d), ("k3", k3, None), ("trunc", trunc, None),
            ("px", px, None), ("py", py, None), ("pxx", px, px), ("pyy", py, py), ("pxy", px, py),
            ("x", lp, None), ("y", rollout, None), ("xx", lp, lp), ("xy", lp, rollout)):
        rows.sum(("rlhf", "ro_" + name), ok, value, times)
    rows.max(ROLLOUT_MAX_KEYS[0], ok, a)


def rollout_sequences(rows: TokenRows, per_seq: torch.Tensor) -> torch.Tensor:
    """The per-sequence figures, from ``per_seq`` (``rows.by_sequence``, float64): the sequence and outlier counts
    as sequence sums (added up by ``rows.totals``); returns the sequence maxima in float64 (the largest and the
    negated smallest log-ratio Σ Δ, which the decode exponentiates, then the worst sequence's mean |Δ|):
    ``ROLLOUT_MAX_KEYS[1:4]``."""
    seq_n, seq_d, seq_abs = (per_seq[rows.row(("rlhf", "ro_" + k))] for k in ("n", "d", "abs"))
    has = seq_n > 0
    seq_abs = seq_abs / seq_n  # NaN (0/0) for a sequence without tokens: left out of the median and the outliers
    typical = seq_abs.nanmedian()  # NaN when no sequence has a token: no outlier
    outlier = torch.gt(seq_abs, torch.clamp(OUTLIER_FACTOR * typical, min=OUTLIER_FLOOR), out=torch.empty_like(seq_n))
    rows.sequence_sum(("rlhf", "ro_seqs"), torch.gt(seq_n, 0, out=torch.empty_like(seq_n)))
    rows.sequence_sum(("rlhf", "ro_outliers"), outlier)
    none = device_constant(-math.inf, seq_n.dtype, seq_n.device)
    return torch.where(has, torch.stack([seq_d, -seq_d, seq_abs]), none).reshape(3, -1).amax(1)


def histogram_bins(a: torch.Tensor) -> torch.Tensor:
    """The |Δ| histogram bin of each token of ``a`` (|Δ| where counted, 0 elsewhere: bin 0, weight 0), 8 bins a
    decade from 1e-6: by arithmetic, ``(log10 a + 6) · 8 + 1`` as one ``add``, not ``searchsorted`` (10 ms for
    400 values on a loaded CPU, where it goes parallel)."""
    # clamped first, so the cast's truncation is the floor (the values are >= 0); log10(0) = -inf gives bin 0
    bins = torch.add(device_constant(1.0 + 6.0 * _PER_DECADE, a.dtype, a.device), torch.log10(a), alpha=_PER_DECADE)
    return bins.clamp_(0, len(EDGES)).long()


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
    slope = residual = None
    if n > 1 and (var_x := v["xx"] - v["x"] ** 2 / n) > 0:
        cov = v["xy"] - v["x"] * v["y"] / n
        slope = cov / var_x
        # Σy² from the sums already kept: y = x − d, so Σy² = 2Σxy − Σx² + Σd²
        var_y = 2 * v["xy"] - v["xx"] + v["sq"] - v["y"] ** 2 / n
        residual = math.sqrt(max(0.0, var_y - cov * cov / var_x) / n)

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
        logprob_slope=_figure(slope, low=-MAX_ROLLOUT_FIGURE), fit_residual_rms=_figure(residual),
        seq_abs_mean_max=_figure(some["seq_abs_max"]),
        outlier_sequences=_count(v["outliers"]))


def _figure(value: float | None, *, low: float = 0.0) -> float | None:
    """A figure within the wire's bounds (1.13: finite, ``MAX_ROLLOUT_FIGURE`` at most): an overflowed k3 or a
    slope over a vanishing variance is clamped, so that the step's report is never refused for it; a NaN (no
    finite token gave it) is no figure."""
    if value is None or value != value:
        return None
    return min(max(value, low), MAX_ROLLOUT_FIGURE)


def _count(value: float) -> int:
    return min(int(value), MAX_ROLLOUT_COUNT)
