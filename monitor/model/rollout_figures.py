"""The run's latest rollout mismatch (wire 1.8 ``RlhfStat.rollout``): the job report's, or its ranks' combined.

A job report's ``RolloutStat`` is already the job's, reduced exactly across ranks by the trainer. Per-rank
reports each hold one rank's; the collector combines the live ranks' latest (``combine``) by what each
figure is, so that the gauge means what the job report's would where it can:

* exact, weighted by each rank's ``tokens``: ``abs_mean``, ``mean``, ``k3_mean``, ``truncated_fraction``
  (token means), and ``rms`` (the root of the token-weighted mean of the squares);
* exact extremes: ``abs_max``, ``seq_ratio_max``, ``seq_abs_mean_max`` (max), ``seq_ratio_min`` (min);
* bounds, where ranks' figures cannot be merged without their data: ``abs_p99`` is the largest rank's (the
  99th percentile of a union is never above its parts' largest), ``prob_correlation`` the smallest rank's
  (the worst agreement), ``logprob_slope`` the rank's farthest from 1 (the worst, on either side).

NaN wins every combination (news is not averaged away). ``nanwatch.monitor.read.metric_names.ROLLOUT_MISMATCH``
exports ``STATS`` (a fixed list: bounded cardinality); ``GET /v1/runs/{id}`` shows the whole stat.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from nanwatch.monitor.model.state import CollectorState, RankState, RunState
from nanwatch.wire import RolloutStat

__all__ = ["STATS", "combine", "latest", "measured_views"]

#: the figures exported as ``nanwatch_rollout_mismatch{stat}``: RolloutStat fields, a fixed list
STATS = ("abs_mean", "abs_max", "abs_p99", "mean", "rms", "k3_mean", "seq_ratio_max", "seq_ratio_min",
         "truncated_fraction", "prob_correlation", "logprob_slope", "seq_abs_mean_max")

_WEIGHTED = ("abs_mean", "mean", "k3_mean", "truncated_fraction")


def _nan_first(pick: Callable[[list[float]], float]) -> Callable[[list[float]], float]:
    return lambda values: math.nan if any(v != v for v in values) else pick(values)


_EXTREME: dict[str, Callable[[list[float]], float]] = {
    "abs_max": _nan_first(max), "seq_ratio_max": _nan_first(max), "seq_abs_mean_max": _nan_first(max),
    "abs_p99": _nan_first(max), "seq_ratio_min": _nan_first(min), "prob_correlation": _nan_first(min),
    "logprob_slope": _nan_first(lambda vs: max(vs, key=lambda v: abs(v - 1.0))),
}


def _weighted(pairs: list[tuple[int, float]]) -> float | None:
    total = sum(n for n, _ in pairs)
    if not pairs:
        return None
    if not total:  # no token counted anywhere: the plain mean of what the ranks said
        return math.fsum(v for _, v in pairs) / len(pairs)
    return math.fsum(n * v for n, v in pairs) / total


def combine(stats: Sequence[RolloutStat]) -> RolloutStat | None:
    """One ``RolloutStat`` for several ranks' (see the module docstring); None for none; one is itself."""
    if len(stats) <= 1:
        return stats[0] if stats else None
    out: dict[str, object] = {"tokens": sum(s.tokens for s in stats), "sequences": sum(s.sequences for s in stats),
                              "cap": max(s.cap for s in stats),
                              "outlier_sequences": sum(s.outlier_sequences for s in stats)}
    for name in _WEIGHTED:
        out[name] = _weighted([(s.tokens, v) for s in stats if (v := getattr(s, name)) is not None])
    squares = _weighted([(s.tokens, s.rms * s.rms) for s in stats if s.rms is not None])
    out["rms"] = None if squares is None else math.sqrt(squares) if squares == squares else math.nan
    for name, pick in _EXTREME.items():
        values = [v for s in stats if (v := getattr(s, name)) is not None]
        out[name] = pick(values) if values else None
    return RolloutStat.model_validate(out)


def measured_views(views: Sequence[RankState], job: RankState | None) -> list[RolloutStat]:
    """The rollout stats a run's latest step holds: the job view's if it has one, else those of the ranks'
    own reports (``rank`` scope; a detail report's figures are in its job report)."""
    if job is not None and job.rlhf is not None and job.rlhf.rollout is not None:
        return [job.rlhf.rollout]
    return [st.rlhf.rollout for st in views if st.scope == "rank" and st.rlhf is not None
            and st.rlhf.rollout is not None]


def latest(state: CollectorState, run: RunState, now: float) -> RolloutStat | None:
    """The run's latest rollout mismatch over its live views (None: no live view measured one)."""
    return combine(measured_views(state.live_ranks(run, now), state.live_job(run, now)))
