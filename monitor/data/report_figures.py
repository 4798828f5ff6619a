"""Report figures: the metrics the table names by a wire path (``MetricSpec.path``), read off a report and
combined over a run's views by their table entry alone, so that a new per-run figure needs one entry and no
code here, in the fold or in the exporter (#38).

The fold (``nanwatch.monitor.write``) reads a training report's gauge figures into its view (:func:`read`:
``RankState.figures``, by path) and adds each run-level report's counter figures (:func:`counted`); the exporter
combines the views' figures (:func:`combined`). Pure functions of plain data: the state is ``write/``'s.

Example usage::

    view_figures = read(report)                       # {"loss_scale": 65536.0, "moe.tokens_rerouted": 3.0, ...}
    combined(LOSS_SCALE, shown_views, job_view)        # min over the live views: the gauge's value, or None
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence

from nanwatch.monitor.data.metric_table import REPORT_FIGURES, MetricSpec
from nanwatch.monitor.data.state import RankState
from nanwatch.wire import StepReport

__all__ = ["GAUGE_FIGURES", "COUNTER_FIGURES", "combined", "counted", "read", "value_at"]

#: the gauges read into a training view, and the counters each run-level report adds to
GAUGE_FIGURES = tuple(s for s in REPORT_FIGURES if s.type == "gauge")
COUNTER_FIGURES = tuple(s for s in REPORT_FIGURES if s.type == "counter")
#: every path a view keeps: the gauges' figures and their denominators
_VIEW_PATHS = tuple(dict.fromkeys(p for s in GAUGE_FIGURES for p in (s.path, s.over) if p is not None))


def value_at(report: object, path: str) -> float | None:
    """The number at ``path`` in ``report`` (attributes of sub-models, keys of mappings), or None where a part of
    it is absent or it is not a number."""
    obj = report
    for part in path.split("."):
        if obj is None:
            return None
        obj = obj.get(part) if isinstance(obj, Mapping) else getattr(obj, part, None)
    return float(obj) if isinstance(obj, int | float) else None


def read(report: StepReport) -> dict[str, float]:
    """The gauge figures (and denominators) ``report`` carries, by path: what its view keeps."""
    return {p: v for p in _VIEW_PATHS if (v := value_at(report, p)) is not None}


def counted(report: StepReport) -> Iterator[tuple[MetricSpec, int]]:
    """The counters a run-level report adds to, with what it adds (none at 0)."""
    for spec in COUNTER_FIGURES:
        v = value_at(report, spec.path)
        if v:
            yield spec, int(v)


def combined(spec: MetricSpec, views: Sequence[RankState], job: RankState | None) -> float | None:
    """The gauge's value over a run's live ``views`` (its shown ranks) and ``job`` (the live job view), by
    ``spec.reduce``; None when no view carries the figure (or a fraction's denominator is 0)."""
    path = spec.path
    if spec.reduce in ("max", "min"):  # idempotent: every view that holds it, the job's poster and details too
        pool = [*views, *([job] if job is not None else [])]
    elif job is not None and path in job.figures:  # each rank once: the job speaks for them
        pool = [job]
    else:
        pool = [*(st for st in views if st.scope == "rank"), *([job] if job is not None else [])]
    pool = [st for st in pool if path in st.figures]
    if not pool:
        return None
    values = [st.figures[path] for st in pool]
    if spec.over is not None:
        den = sum(st.figures.get(spec.over, 0.0) for st in pool)
        return sum(values) / den if den > 0 else None
    if spec.reduce == "sum":
        return sum(values)
    if spec.reduce == "last":
        return values[-1]
    if any(v != v for v in values):  # a NaN figure is news: it wins
        return math.nan
    return max(values) if spec.reduce == "max" else min(values)
