"""``GET /v1/runs`` and ``GET /v1/runs/{run_id}``: what a person asks after a NaN."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, HTTPException

from nanwatch.monitor.deps import ReaderToken, Resources, ResourcesDep, RunIdPath, SettingsDep
from nanwatch.monitor.routers._problems import AUTH, INVALID, NOT_READY
from nanwatch.monitor.schemas import (
    ApiJSON,
    CrashedRank,
    EventView,
    FirstOffender,
    Problem,
    RankView,
    RunDetail,
    RunList,
    RunSummary,
    SdpaView,
)
from nanwatch.monitor.state import RunState

router = APIRouter(tags=["runs"])


def _summary(res: Resources, run: RunState, now: float) -> dict[str, Any]:
    """What a run's list entry says (figures over the run's live ranks and counters)."""
    live = res.state.live_ranks(run, now)
    fo = run.first_offender_event
    crashed = [CrashedRank(rank=rank, raised=c.raised, step=c.step if c.step >= 0 else None)
               for rank, c in sorted(run.crashed.items())]
    return dict(
        run_id=run.run_id, status="crashed" if crashed else "live" if live else "ended" if run.ended else "idle", crashed_ranks=crashed,
        # steps count per incarnation: the live ranks' latest, else the highest ever stored
        live_ranks=len(live), latest_step=max((st.step for st in live), default=run.latest_step),
        last_report_time=max((st.received for st in live), default=None),
        # the run-level count (job reports in job mode); a run stored before it existed has per-rank ones only
        nonfinite_total=max(sum(v for (fam, _), v in run.counters.items() if fam == "run_nonfinite"),
                            sum(v for (fam, _), v in run.counters.items() if fam == "nonfinite")),
        # a step the guard skipped is skipped on every rank (its flag is reduced): the most any rank counted
        skipped_steps=max((v for (fam, _), v in run.counters.items() if fam == "skipped"), default=0.0)
        + run.counters.get(("job_skipped", ()), 0.0),
        directive=res.directive_log.current(run.run_id),
        first_offender=None if fo is None else FirstOffender.of(fo),
    )


@router.get("/v1/runs", response_model=RunList, response_class=ApiJSON, responses={**AUTH, **NOT_READY})
async def list_runs(res: ResourcesDep, _token: ReaderToken) -> ApiJSON:
    """Every run the collector knows: live ones and those with persisted history (memory holds every run
    the store does, loaded at start)."""
    now = time.monotonic()
    runs = [res.state.runs[i] for i in sorted(res.state.runs)]
    return ApiJSON(RunList(runs=[RunSummary(**_summary(res, run, now)) for run in runs]))


@router.get("/v1/runs/{run_id}", response_model=RunDetail, response_class=ApiJSON,
            responses={404: {"model": Problem, "description": "no such run"}, **AUTH, **INVALID, **NOT_READY})
async def get_run(run_id: RunIdPath, res: ResourcesDep, settings: SettingsDep, _token: ReaderToken) -> ApiJSON:
    """Latest state per live rank, the first offender, SDPA backends seen, and the recent event history. In
    job mode, ranks known only through heartbeats are listed only once late (``NANWATCH_RANK_LATE_S``):
    ``live_ranks`` counts them all. A crashed rank is listed (``crashed``) while within the TTL, but not
    counted live."""
    run = res.state.runs.get(run_id)
    if run is None:
        raise HTTPException(404, f"no run {run_id!r}: it never reported, or its history was deleted")
    now = time.monotonic()
    late_before = now - res.state.late_after(run, settings.rank_late_s)
    shown = [st for st in res.state.held_ranks(run, now)
             if st.scope != "beat" or st.seen < late_before or st.crashed is not None]
    ranks = [RankView.model_validate(st).model_copy(update={"silent_s": now - st.seen, "late": st.seen < late_before})
             for st in shown]
    held = {st.rank for st in shown}
    ranks += [RankView.model_validate(st).model_copy(update={"silent_s": now - st.seen, "ended": True})
              for rank, st in run.ended_views.items() if rank not in held]
    ranks.sort(key=lambda v: v.rank)
    events = [EventView.model_validate(e) for e in res.store.events(run_id, limit=settings.events_shown)]
    sdpa = [SdpaView(backend=labels[0], dtype=labels[1], stage=labels[2], calls=v)
            for (fam, labels), v in run.counters.items() if fam == "sdpa"]
    return ApiJSON(RunDetail(**_summary(res, run, now), ranks=ranks, sdpa=sdpa,
                             event_counts=dict(run.event_counts), events=events))
