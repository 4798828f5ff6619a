"""Report figures on the trainer side (#38): a figure declared once (``nanwatch.hooks.measure.figures``) is written
on the device, decoded from the step's one copy, put at its wire path in the report, and reduced across a job's
ranks by its declaration alone."""

from __future__ import annotations

import types
import typing

import pytest
import torch
from pydantic import BaseModel
from support import step_report

import nanwatch.hooks.moe.taps  # noqa: F401 - declares the MoE figures
from nanwatch.hooks.measure.decode import decode_step
from nanwatch.hooks.measure.figures import FIGURES, figure, fill
from nanwatch.hooks.measure.recorder import Recorder
from nanwatch.hooks.measure.scaler_overflow import LOSS_SCALE
from nanwatch.hooks.report.job_stats import contribution, merge_tables, reduce_job
from nanwatch.wire import MoeStat, StepReport


def _wire_type(path: str) -> object:
    t: object = StepReport
    for part in path.split("."):
        assert isinstance(t, type) and issubclass(t, BaseModel), (path, part)
        t = t.model_fields[part].annotation
        while True:
            if typing.get_origin(t) is typing.Annotated:
                t = typing.get_args(t)[0]
            elif isinstance(t, types.UnionType) or typing.get_origin(t) is typing.Union:
                (t,) = [a for a in typing.get_args(t) if a is not type(None)]
            else:
                break
    return t


@pytest.mark.parametrize("path", sorted(FIGURES))
def test_every_declared_figure_is_a_number_at_its_wire_path(path):
    assert _wire_type(path) is (int if FIGURES[path].integer else float)


def test_a_figure_written_in_the_step_reaches_its_place_in_the_report():
    rec = Recorder(torch.device("cpu"))
    rec.figure(LOSS_SCALE, torch.tensor(1024.0))
    rec.figure(LOSS_SCALE, torch.tensor(512.0))  # the last write of the step stands
    values = rec.flat().tolist()
    stats = decode_step(rec.swap(), values)
    assert stats.figures == {"loss_scale": 512.0}
    assert fill(step_report(), stats.figures).loss_scale == 512.0
    values = rec.flat().tolist()  # a step that wrote none: none, though its slot is still in the buffer
    assert decode_step(rec.swap(), values).figures == {}


def test_a_figure_inside_a_part_the_report_lacks_is_left_out():
    own = FIGURES["moe.tokens_own_rerouted"]
    assert fill(step_report(), {own.path: 3.0}).moe is None
    filled = fill(step_report().model_copy(update={"moe": MoeStat()}), {own.path: 3.0})
    assert filled.moe.tokens_own_rerouted == 3 and isinstance(filled.moe.tokens_own_rerouted, int)


def test_a_second_declaration_at_a_path_is_refused():
    assert figure("loss_scale", how="last", across="min") is not None  # the same again: a reloaded module
    with pytest.raises(ValueError, match="already declared"):
        figure("loss_scale", how="sum")


def test_a_job_report_reduces_each_figure_by_its_declaration():
    """loss_scale: the lowest rank's (a collapsing scale is the incident); a count: summed; a rank without the
    figure adds nothing."""
    ranks = [step_report(rank=0, world_size=3).model_copy(update={"loss_scale": 1024.0, "moe": MoeStat(
                 tokens_compared=10, tokens_own_rerouted=2)}),
             step_report(rank=1, world_size=3).model_copy(update={"loss_scale": 256.0, "moe": MoeStat(
                 tokens_compared=20, tokens_own_rerouted=5)}),
             step_report(rank=2, world_size=3).model_copy(update={"moe": MoeStat(tokens_compared=4)})]
    parts = [contribution(r, None, rank=r.rank) for r in ranks]
    table = merge_tables([p.table for p in parts])
    assert table.figures == ("loss_scale", "moe.tokens_own_rerouted")
    vectors = [p.vectors(table, world=3) for p in parts]
    sums = [sum(col) for col in zip(*(v[0] for v in vectors), strict=True)]
    maxes = [max(col) for col in zip(*(v[1] for v in vectors), strict=True)]
    job = reduce_job(ranks[0], table, sums, maxes, world=3).report
    assert job.loss_scale == 256.0 and job.moe.tokens_own_rerouted == 7 and job.moe.tokens_compared == 34
