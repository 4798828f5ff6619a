"""Report figures (#38): a metric the table names by its wire path (``MetricSpec.path``) needs nothing but that
entry. Each such entry, posted by two ranks to a real ``nanwatch serve`` on loopback, comes out of ``/metrics``
combined its own way; every path is a number on the wire; and every field of the step report (and of its MoE
part, where the last figures landed) is a table figure or says here why it is folded by hand, so that a new
field is never silently left out of the collector."""

from __future__ import annotations

import math
import types
import typing

import pytest
from pydantic import BaseModel
from support import post_reports, sample, scrape, step_report

from nanwatch.monitor.data.metric_table import REPORT_FIGURES, MetricSpec
from nanwatch.wire import MoeStat, StepReport

#: Fields of the step report that are no table figure, and why: each is folded or rendered by hand, or is no
#: measurement. A new field lands in the table (``MetricSpec.path``) or here, with its reason.
NOT_A_FIGURE = {
    "v": "the schema version: checked on ingest",
    "run_id": "identity: the run_id label",
    "scope": "who the report speaks for: decides what the fold takes from it",
    "rank": "identity: the rank label of per-rank series",
    "world_size": "a median over the run's ranks (nanwatch_run_world_size), not a view's figure",
    "incarnation": "identity: the idempotency key and restarts",
    "seq": "the idempotency key",
    "step": "the run's step and STEP_SLACK: the directive rules' clock",
    "stage": "which counters a report feeds (an evaluation's are labelled, never a training view)",
    "time": "the trainer's clock, kept in the view",
    "sites": "per-site counters and headroom by site kind: labelled by site, pass and kind (counting)",
    "sdpa": "per-backend counters and the math fallback: labelled (counting)",
    "logits": "per-layer logit bounds: labelled by layer, admitted under the series cap",
    "rlhf": "per-stat gauges combined stat by stat (nanwatch_rlhf_stat, nanwatch_rollout_mismatch)",
    "rollout_events": "counted by cause, and events",
    "rollout_attribution": "an event of the run's log",
    "moe": "per-router gauges labelled by layer (hand-folded); its per-run figures are table figures below",
    "spikes": "counted once per step and kind, and the run's latest for nanwatch status",
    "fingerprints": "the input fingerprint: events (cross-document leak)",
    "coverage": "unmeasured reasons counted by reason",
    "step_skipped": "counted per rank, or per job for every rank",
    "incident": "counted by class and host; the latest incident's info series",
    "agree_every": "the directive rules' agreement cadence",
    "attention_mode": "a per-rank info series (nanwatch_attention_mode)",
    "directive_version": "the directive rules' acknowledgement",
    "first_offender": "the first/latest offender info series and events",
    "first_offender_phase": "with first_offender",
    "first_offender_stage": "with first_offender",
    "first_offender_rank": "with first_offender",
    "ranks_reporting": "how many ranks a job report covered: its own bookkeeping",
    "heartbeat_s": "the run's heartbeat interval, a median over its ranks",
    "nonfinite_rank": "the guard's verdict: carried into events",
    "raised": "a crashed rank (nanwatch_rank_crashed) and its event",
    "final": "a rank's and the run's end (nanwatch_run_ended)",
    "scaler_overflow": "counted once per step across ranks (nanwatch_loss_scale_overflows_total)",
    "dropped_reports": "per rank, shown by the rank's liveness (nanwatch_reports_dropped_total)",
    "warnings": "text for the trainer's log, not a metric",
}
#: The MoE part's fields that are no table figure, and why.
MOE_NOT_A_FIGURE = {
    "routing_replay": "the replay claimed: decides nanwatch_moe_replay_not_applied",
    "routers": "per-router gauges labelled by layer (hand-folded, merged exactly over ranks)",
    "rerouted_abs_dlogp": "the trainer's attribution of a drift (routing explains X %), told in its event",
    "rerouted_scored": "with rerouted_abs_dlogp",
    "agreeing_abs_dlogp": "with rerouted_abs_dlogp",
    "agreeing_scored": "with rerouted_abs_dlogp",
    "events": "routing events, recorded in the run's log and counted by kind",
}


def _paths() -> set[str]:
    return {p for s in REPORT_FIGURES for p in (s.path, s.over) if p is not None}


def test_every_step_report_field_is_a_table_figure_or_says_why_not():
    heads = {p.split(".")[0] for p in _paths()}
    assert set(StepReport.model_fields) - heads - set(NOT_A_FIGURE) == set(), "a new field: a table figure, or why not"
    assert set(NOT_A_FIGURE) - set(StepReport.model_fields) == set()
    moe = {p.split(".", 1)[1] for p in _paths() if p.startswith("moe.")}
    assert set(MoeStat.model_fields) - moe - set(MOE_NOT_A_FIGURE) == set()
    assert set(MOE_NOT_A_FIGURE) - set(MoeStat.model_fields) == set() and not moe & set(MOE_NOT_A_FIGURE)


def _leaf(annotation: object) -> object:
    """The type inside ``X | None`` and ``Annotated[X, ...]``."""
    while True:
        if typing.get_origin(annotation) is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
        elif isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
            (annotation,) = [a for a in typing.get_args(annotation) if a is not type(None)]
        else:
            return annotation


def _wire_type(path: str) -> object:
    """The type the wire gives ``path`` (through sub-models and mappings)."""
    t: object = StepReport
    for part in path.split("."):
        if isinstance(t, type) and issubclass(t, BaseModel):
            t = _leaf(t.model_fields[part].annotation)
        else:
            assert typing.get_origin(t) is dict, (path, part, t)
            t = _leaf(typing.get_args(t)[1])
    return t


@pytest.mark.parametrize("path", sorted(_paths()))
def test_every_figure_path_is_a_number_on_the_wire(path):
    assert _wire_type(path) in (int, float), (path, _wire_type(path))


def test_a_figure_entry_is_checked_when_the_table_is_built():
    with pytest.raises(ValueError, match="one series per run"):
        MetricSpec("nanwatch_x", "gauge", ("run_id", "layer"), "", path="loss_scale", reduce="max")
    with pytest.raises(ValueError, match="reduce="):
        MetricSpec("nanwatch_x", "gauge", ("run_id",), "", path="loss_scale")
    with pytest.raises(ValueError, match="'sum'"):
        MetricSpec("nanwatch_x_total", "counter", ("run_id",), "", key="x", path="loss_scale", reduce="max")
    with pytest.raises(ValueError, match="fraction"):
        MetricSpec("nanwatch_x", "gauge", ("run_id",), "", path="loss_scale", reduce="max", over="step")


def _at(report: StepReport, values: dict[str, float]) -> StepReport:
    """``report`` with each path of ``values`` set (sub-models and mappings made on the way), validated."""
    data = report.model_dump()
    for path, value in values.items():
        *parents, last = path.split(".")
        node = data
        for part in parents:
            if node.get(part) is None:
                node[part] = {}
            node = node[part]
        node[last] = value
    return StepReport.model_validate(data)


def _values(spec: MetricSpec, rank: int) -> dict[str, float]:
    """Two ranks' figures, chosen so that every reduction gives another answer (sum 12, max 8, min 4, over 3/12)."""
    out = {spec.path: (4, 8)[rank]}
    if spec.over is not None:
        out[spec.over] = (10, 30)[rank]
        out[spec.path] = (1, 2)[rank]
    return out


@pytest.mark.parametrize("spec", REPORT_FIGURES, ids=lambda s: s.name)
def test_a_table_entry_is_all_the_collector_needs(collector, spec):
    run = f"fig-{spec.name.removeprefix('nanwatch_')[:40].replace('_', '-')}"
    reports = [_at(step_report(run_id=run, rank=rank, world_size=2, seq=0), _values(spec, rank)) for rank in (0, 1)]
    assert post_reports(collector.url, *reports)["accepted"] == 2
    name = spec.name + ("_total" if spec.type == "counter" and not spec.name.endswith("_total") else "")
    got = sample(scrape(collector.url), name, run_id=run)
    a, b = (_values(spec, rank) for rank in (0, 1))
    want = {"sum": a[spec.path] + b[spec.path], "max": max(a[spec.path], b[spec.path]),
            "min": min(a[spec.path], b[spec.path]), "last": b[spec.path]}[spec.reduce]
    if spec.over is not None:
        want = want / (a[spec.over] + b[spec.over])
    assert got is not None and math.isclose(got, want), (spec.name, got, want)
