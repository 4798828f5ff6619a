"""Report figures: a number a measure module computes on the device in a step, declared once by the wire path
it fills (``figure("loss_scale", ...)``), and carried into the step report by that name (#38).

Declaring a figure is the whole of its plumbing: the module that measures it writes it with
``Recorder.figure(FIG, value)`` (one device op into the step's slot buffer, no host read; the step's one
asynchronous copy brings it), the decode reads every figure the step wrote (``StepStats.figures``), the builder
puts each at its path in a training step's report (:func:`fill`), and a job report reduces each across ranks by
``across`` (``nanwatch.hooks.report.job_stats``, from the ranks' reports: :func:`value_at`). A path into a
sub-model (``moe.tokens_own_rerouted``) is filled when the report carries the sub-model.

Example usage::

    OWN = figure("moe.tokens_own_rerouted", how="sum", integer=True)   # at import, in the measuring module
    rec.figure(OWN, count)                                             # in the step, a 0-d device tensor
    fill(report, stats.figures)                                        # reporter thread: report.moe.tokens_own_rerouted
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel

__all__ = ["FIGURES", "Figure", "figure", "fill", "value_at"]


@dataclass(frozen=True, slots=True)
class Figure:
    """One report figure: where it goes in the report, and how it adds up."""

    path: str
    """The ``StepReport`` field it fills, dotted into a sub-model (``loss_scale``, ``moe.tokens_own_rerouted``)."""
    how: Literal["sum", "max", "last"]
    """Within the step: writes add up (``sum``), the largest stays (``max``), or the last write stands (``last``)."""
    across: Literal["sum", "max", "min"]
    """Across a job's ranks (the job report's figure)."""
    integer: bool = False
    """A count: an ``int`` on the wire."""

    @property
    def key(self) -> tuple[str, str]:
        """Its slot's key in the step's slot buffer."""
        return ("figure", self.path)

    @property
    def kind(self) -> str:
        """Its slot's kind (``SlotBuffer``): an assigned value lives in a max slot, as the loss scale always did."""
        return "sum" if self.how == "sum" else "max"

    def value(self, raw: float) -> float | int:
        return int(raw) if self.integer else raw


#: every figure declared, by path (modules declare theirs at import)
FIGURES: dict[str, Figure] = {}


def figure(path: str, *, how: Literal["sum", "max", "last"], across: Literal["sum", "max", "min"] | None = None,
           integer: bool = False) -> Figure:
    """Declare the figure at ``path`` (``across`` defaults to ``how``, ``last`` to ``max``); declaring the same
    one twice (a module reloaded) returns it, another one at the same path is a ``ValueError``."""
    fig = Figure(path, how, across or ("max" if how == "last" else how), integer)
    if FIGURES.setdefault(path, fig) != fig:
        raise ValueError(f"report figure {path!r} is already declared as {FIGURES[path]}")
    return fig


def value_at(report: BaseModel, path: str) -> float | None:
    """The figure at ``path`` in ``report``, or None where it (or the sub-model holding it) is absent."""
    obj: object = report
    for part in path.split("."):
        obj = obj.get(part) if isinstance(obj, Mapping) else getattr(obj, part, None)
        if obj is None:
            return None
    return obj if isinstance(obj, int | float) else None


def fill(report: BaseModel, values: Mapping[str, float]) -> BaseModel:
    """``report`` with each figure of ``values`` (by path) at its place; a path whose sub-model the report does not
    carry is left out. Copies, never mutates (the values were checked where they were measured)."""
    for path, raw in values.items():
        fig = FIGURES.get(path)
        if fig is not None:
            report = _put(report, path.split("."), fig.value(raw))
    return report


def _put(model: BaseModel, parts: list[str], value: float | int) -> BaseModel:
    head, rest = parts[0], parts[1:]
    if not rest:
        return model.model_copy(update={head: value})
    inner = getattr(model, head, None)
    if not isinstance(inner, BaseModel):
        return model
    return model.model_copy(update={head: _put(inner, rest, value)})
