"""The run's latest rollout mismatch (wire 1.8 ``RlhfStat.rollout``): the job report's, or its ranks' combined.

A job report's ``RolloutStat`` is already the job's, reduced exactly across ranks by the trainer. Per-rank
reports each hold one rank's; the collector combines the live ranks' latest (``combine``) by what each
figure is, so that the gauge means what the job report's would where it can:

* exact, weighted by each rank's ``tokens``: ``abs_mean``, ``mean``, ``k3_mean``, ``truncated_fraction``
  (token means), and ``rms`` (the root of the token-weighted mean of the squares);
* exact extremes: ``abs_max``, ``seq_ratio_max``, ``seq_abs_mean_max`` (max), ``seq_ratio_min`` (min);
* bounds, where ranks' figures cannot be merged without their data: ``abs_p99`` is the largest rank's (the
  99th percentile of a union is never above its parts' largest), ``prob_correlation`` the smallest rank's
  (the worst agreement), ``logprob_slope`` the rank's farthest from 1 (the worst, on either side),
  ``fit_residual_rms`` the largest rank's (what the line leaves: the least temperature-like).

One rank cannot hide another's drift (#36), nor take a render down (#37):

* the wire bounds every figure and count (1.13: finite, ``abs_*``/``rms``/``k3_mean`` >= 0, fractions in
  [0, 1]), so a NaN or a negative figure is refused at ingest;
* a count that must be believed as a weight is not when the ranks' counts are more than ``TOKEN_SPREAD``
  times apart (the ranks of one data-parallel job score batches of one size; a made-up rank claiming 2^32
  tokens at 0, or one token, could otherwise dilute a real rank's 0.05 to nothing): the token means are
  then the worst rank's (``mean`` the one farthest from 0), and ``Combined.distrusted`` says so;
* the arithmetic is plain float arithmetic that cannot raise (``math.fsum`` raised ``OverflowError`` on
  1e308 + 1e308 and ``ValueError`` on inf + -inf), and a summed count beyond ``MAX_INT`` is clamped
  (``Combined.clamped``); the result is built without re-validation (a sum is no rank's report).

NaN still wins every extreme (news is not averaged away). ``nanwatch.monitor.data.metric_table.ROLLOUT_MISMATCH``
exports ``STATS`` (a fixed list: bounded cardinality); ``GET /v1/runs/{id}`` shows the whole stat.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

from nanwatch.monitor.data.liveness import live_job, live_ranks
from nanwatch.monitor.data.state import CollectorState, RankState, RunState
from nanwatch.wire import MAX_INT, RolloutStat

__all__ = ["STATS", "TOKEN_SPREAD", "Combined", "combine", "combined", "latest", "measured_views"]

#: the figures exported as ``nanwatch_rollout_mismatch{stat}``: RolloutStat fields, a fixed list
STATS = ("abs_mean", "abs_max", "abs_p99", "mean", "rms", "k3_mean", "seq_ratio_max", "seq_ratio_min",
         "truncated_fraction", "prob_correlation", "logprob_slope", "seq_abs_mean_max")
#: ranks' token counts further apart than this factor are not believed as weights (the outlier factor of
#: ``nanwatch.hooks.rollout.compare``: honest ranks' counts differ by the lengths of their completions)
TOKEN_SPREAD = 8

_WEIGHTED = ("abs_mean", "mean", "k3_mean", "truncated_fraction")
_COUNTS = ("tokens", "sequences", "outlier_sequences")


def _nan_first(pick: Callable[[list[float]], float]) -> Callable[[list[float]], float]:
    return lambda values: math.nan if any(v != v for v in values) else pick(values)


_EXTREME: dict[str, Callable[[list[float]], float]] = {
    "abs_max": _nan_first(max), "seq_ratio_max": _nan_first(max), "seq_abs_mean_max": _nan_first(max),
    "abs_p99": _nan_first(max), "seq_ratio_min": _nan_first(min), "prob_correlation": _nan_first(min),
    "logprob_slope": _nan_first(lambda vs: max(vs, key=lambda v: abs(v - 1.0))),
    "fit_residual_rms": _nan_first(max),
}
#: the worst rank's figure, where the counts are not believed as weights
_WORST: dict[str, Callable[[list[float]], float]] = {
    "abs_mean": _nan_first(max), "k3_mean": _nan_first(max), "truncated_fraction": _nan_first(max),
    "mean": _nan_first(lambda vs: max(vs, key=abs)),
}


class Combined(NamedTuple):
    """``combine``'s stat, and what it had to do: ``distrusted``, the ranks' counts were more than
    ``TOKEN_SPREAD`` apart (the token means are the worst rank's); ``clamped``, a summed count was cut to
    ``MAX_INT``."""

    stat: RolloutStat | None
    distrusted: bool = False
    clamped: bool = False


def _weight(n: int) -> float:
    """A count as a float weight, whatever it holds (a huge int would raise in ``int * float``)."""
    return float(min(max(n, 0), MAX_INT))


def _weighted(pairs: list[tuple[int, float]]) -> float | None:
    """The token-weighted mean (plain float arithmetic: an overflow is inf, inf - inf is NaN, never raised)."""
    if not pairs:
        return None
    total = sum(_weight(n) for n, _ in pairs)
    if not total:  # no token counted anywhere: the plain mean of what the ranks said
        return sum(v for _, v in pairs) / len(pairs)
    return sum(_weight(n) * v for n, v in pairs) / total


def _root(square: float | None) -> float | None:
    return None if square is None else math.sqrt(square) if square >= 0 else math.nan  # NaN >= 0 is False


def combine(stats: Sequence[RolloutStat]) -> RolloutStat | None:
    """One ``RolloutStat`` for several ranks' (see the module docstring); None for none; one is itself."""
    return combined(stats).stat


def combined(stats: Sequence[RolloutStat]) -> Combined:
    """``combine``, saying whether the counts were believed and whether a sum was clamped."""
    if len(stats) <= 1:
        return Combined(stats[0] if stats else None)
    out: dict[str, object] = {"cap": max(s.cap for s in stats)}
    clamped = False
    for name in _COUNTS:
        total = sum(getattr(s, name) for s in stats)
        clamped |= total > MAX_INT
        out[name] = min(total, MAX_INT)
    counted = [s.tokens for s in stats if s.tokens > 0]
    distrusted = bool(counted) and max(counted) > TOKEN_SPREAD * min(counted)
    for name in _WEIGHTED:
        pairs = [(s.tokens, v) for s in stats if (v := getattr(s, name)) is not None]
        out[name] = _WORST[name]([v for _, v in pairs]) if distrusted and pairs else _weighted(pairs)
    rms = [(s.tokens, s.rms) for s in stats if s.rms is not None]
    out["rms"] = (_nan_first(max)([v for _, v in rms]) if distrusted and rms
                  else _root(_weighted([(n, v * v) for n, v in rms])))
    for name, pick in _EXTREME.items():
        values = [v for s in stats if (v := getattr(s, name)) is not None]
        out[name] = pick(values) if values else None
    return Combined(RolloutStat.model_construct(**out), distrusted, clamped)


def measured_views(views: Sequence[RankState], job: RankState | None) -> list[RolloutStat]:
    """The rollout stats a run's latest step holds: the job view's if it has one, else those of the ranks'
    own reports (``rank`` scope; a detail report's figures are in its job report)."""
    if job is not None and job.rlhf is not None and job.rlhf.rollout is not None:
        return [job.rlhf.rollout]
    return [st.rlhf.rollout for st in views if st.scope == "rank" and st.rlhf is not None
            and st.rlhf.rollout is not None]


def latest(state: CollectorState, run: RunState, now: float) -> RolloutStat | None:
    """The run's latest rollout mismatch over its live views (None: no live view measured one)."""
    return combine(measured_views(live_ranks(state, run, now), live_job(state, run, now)))
