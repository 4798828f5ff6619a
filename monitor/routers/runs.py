"""``GET /v1/runs`` and ``GET /v1/runs/{run_id}``: what a person asks after a NaN."""

from __future__ import annotations

import time

from fastapi import APIRouter, HTTPException

from nanwatch.monitor.deps import ReaderToken, Resources, ResourcesDep, SettingsDep
from nanwatch.monitor.routers._errors import AUTH, INVALID, NOT_READY
from nanwatch.monitor.routers.directives import RunIdPath
from nanwatch.monitor.schemas import (
    EventView,
    FirstOffender,
    Problem,
    RankView,
    RunDetail,
    RunList,
    RunSummary,
    SdpaView,
    WireJSON,
)
from nanwatch.monitor.state import RunState

router = APIRouter(tags=["runs"])


def _summary(res: Resources, run: RunState, now: float) -> dict:
    """What a run's list entry says."""
    live = res.state.live_ranks(run, now)
    fo = run.first_offender
    return dict(
        # steps count per incarnation: the live ranks' latest, else the highest ever stored
        run_id=run.run_id, live_ranks=len(live), latest_step=max((st.step for st in live), default=run.latest_step),
        last_report_time=max((st.received for st in live), default=None),
        nonfinite_total=sum(v for (fam, _), v in run.counters.items() if fam == "nonfinite"),
        directive=res.directives.current(run.run_id),
        first_offender=None if fo is None else FirstOffender(
            site=fo.site, phase=fo.detail.get("phase"), rank=fo.rank, step=fo.step, time=fo.time),
    )


@router.get("/v1/runs", response_model=RunList, response_class=WireJSON, responses={**AUTH, **NOT_READY})
async def list_runs(res: ResourcesDep, _token: ReaderToken) -> WireJSON:
    """Every run the collector knows: live ones and those with persisted history (memory holds every run
    the store does, loaded at start)."""
    now = time.monotonic()
    runs = [res.state.runs[i] for i in sorted(res.state.runs)]
    return WireJSON(RunList(runs=[RunSummary(**_summary(res, run, now)) for run in runs]))


@router.get("/v1/runs/{run_id}", response_model=RunDetail, response_class=WireJSON,
            responses={404: {"model": Problem, "description": "no such run"}, **AUTH, **INVALID, **NOT_READY})
async def get_run(run_id: RunIdPath, res: ResourcesDep, settings: SettingsDep, _token: ReaderToken) -> WireJSON:
    """Latest state per live rank, the first offender, SDPA backends seen, and the recent event history."""
    run = res.state.runs.get(run_id)
    if run is None:
        raise HTTPException(404, f"no run {run_id!r}: it never reported, or its history was deleted")
    now = time.monotonic()
    ranks = [RankView(
        rank=st.rank, incarnation=st.incarnation, seq=st.seq, step=st.step, time=st.time, received=st.received,
        world_size=st.world_size, attention_mode=st.mode, directive_version=st.directive_version,
        dropped_reports=st.dropped, nonfinite=st.nonfinite, first_offender=st.first_offender,
        first_offender_phase=st.first_offender_phase, headroom=st.headroom,
        logit_max=max(st.logits.values(), default=None)) for st in sorted(res.state.live_ranks(run, now),
                                                                         key=lambda s: s.rank)]
    events = [EventView(time=e.time, kind=e.kind, rank=e.rank, step=e.step, site=e.site, actor=e.actor,
                        detail=e.detail) for e in res.store.events(run_id, limit=settings.events_shown)]
    sdpa = [SdpaView(backend=labels[0], dtype=labels[1], stage=labels[2], calls=v)
            for (fam, labels), v in run.counters.items() if fam == "sdpa"]
    return WireJSON(RunDetail(**_summary(res, run, now), ranks=ranks, sdpa=sdpa,
                              event_counts=dict(run.event_counts), events=events))
