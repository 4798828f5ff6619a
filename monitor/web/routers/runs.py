"""``GET /v1/runs`` and ``GET /v1/runs/{run_id}``: what a person asks after a NaN."""

from __future__ import annotations

import heapq
import time
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query, Response

from nanwatch.monitor.model import counters, rollout_figures
from nanwatch.monitor.model.state import RunState
from nanwatch.monitor.web.deps import (
    AdminToken,
    ReaderToken,
    Resources,
    ResourcesDep,
    RunIdPath,
    SettingsDep,
    require_owned,
)
from nanwatch.monitor.web.routers._problems import AUTH, INVALID, NOT_READY
from nanwatch.monitor.web.routers.weights import weight_sync_view
from nanwatch.monitor.web.schemas import (
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
    SpikeView,
)
from nanwatch.run_status import run_status

router = APIRouter(tags=["runs"])

#: the most runs one ``GET /v1/runs`` page holds (each costs a summary on the event loop)
MAX_PAGE = 1000


def _summary(res: Resources, run: RunState, now: float) -> dict[str, Any]:
    """What a run's list entry says (figures over the run's live ranks and counters)."""
    live = res.state.live_ranks(run, now)
    fo = run.first_offender_event
    crashed = [CrashedRank(rank=rank, raised=c.raised, step=c.step if c.step >= 0 else None)
               for rank, c in sorted(run.crashed.items())]
    return dict(
        run_id=run.run_id, status=run_status(crashed=bool(crashed), live=bool(live), ended=run.ended),
        crashed_ranks=crashed,
        # steps count per incarnation: the live ranks' latest, else the highest ever stored
        live_ranks=len(live), latest_step=max((st.step for st in live), default=run.latest_step),
        last_report_time=max((st.received for st in live), default=None),
        # the run-level count (job reports in job mode); a run stored before it existed has per-rank ones only
        nonfinite_total=max(sum(v for (fam, _), v in run.counters.items() if fam == counters.RUN_NONFINITE.key),
                            sum(v for (fam, _), v in run.counters.items() if fam == counters.NONFINITE.key)),
        # a step the guard skipped is skipped on every rank (its flag is reduced): the most any rank counted
        skipped_steps=max((v for (fam, _), v in run.counters.items() if fam == counters.SKIPPED.key), default=0.0)
        + run.counters.get((counters.JOB_SKIPPED.key, ()), 0.0),
        directive=res.directive_log.current(run.run_id),
        first_offender=None if fo is None else FirstOffender.of(fo),
        # what else pages: a run list that hid rollout and replica incidents sent the on-call to the wrong run
        incidents=_by_label(run, counters.INCIDENT.key), rollout_events=_by_label(run, counters.ROLLOUT_EVENT.key),
        weight_sync_mismatches=sum(v for (fam, _), v in run.counters.items()
                                   if fam == counters.WEIGHT_SYNC_MISMATCHES.key),
    )


def _by_label(run: RunState, family: str) -> dict[str, float]:
    """A one-label counter family's run totals by label value (zeros left out)."""
    out: dict[str, float] = {}
    for (fam, labels), v in run.counters.items():
        if fam == family and v and labels:
            out[labels[0]] = out.get(labels[0], 0.0) + v
    return dict(sorted(out.items()))


@router.get("/v1/runs", response_model=RunList, response_class=ApiJSON, responses={**AUTH, **INVALID, **NOT_READY})
async def list_runs(
    res: ResourcesDep, token: ReaderToken,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE, description="runs per page")] = 100,
    after: Annotated[str, Query(max_length=128, description="the previous page's next_after: runs whose id "
                                "sorts after it")] = "",
) -> ApiJSON:
    """The runs the collector knows (live ones and those with persisted history: memory holds every run the
    store does), one page at a time in run-id order. A scoped ingest token sees its namespace's runs only.
    A page costs one pass over the run ids and ``limit`` summaries (not a sort, nor every run's summary)."""
    now = time.monotonic()
    page = heapq.nsmallest(limit + 1, (i for i in res.state.runs if i > after and token.owns(i)))
    more = len(page) > limit
    page = page[:limit]
    return ApiJSON(RunList(runs=[RunSummary(**_summary(res, res.state.runs[i], now)) for i in page],
                           next_after=page[-1] if more else None))


@router.delete("/v1/runs/{run_id}", status_code=204, response_class=Response,
               responses={404: {"model": Problem, "description": "no such run"}, **AUTH, **INVALID, **NOT_READY})
async def delete_run(run_id: RunIdPath, res: ResourcesDep, token: AdminToken) -> Response:
    """Delete a run's whole history (counters, events, directives, high-water marks), from the store and
    then from memory, as retention does: it leaves ``/metrics`` and ``/v1/runs``, and frees its place
    under the run cap. Logged naming the admin token. A trainer still reporting under this id starts a new
    history."""
    if not await res.ledger.delete_run(run_id, actor=token.name):
        raise HTTPException(404, f"no run {run_id!r}: it never reported, or its history was deleted")
    return Response(status_code=204)


@router.get("/v1/runs/{run_id}", response_model=RunDetail, response_class=ApiJSON,
            responses={404: {"model": Problem, "description": "no such run"}, **AUTH, **INVALID, **NOT_READY})
async def get_run(run_id: RunIdPath, res: ResourcesDep, settings: SettingsDep, token: ReaderToken) -> ApiJSON:
    """Latest state per live rank, the first offender, SDPA backends seen, and the recent event history. In
    job mode, ranks known only through heartbeats are listed only once late (``NANWATCH_RANK_LATE_S``):
    ``live_ranks`` counts them all. A crashed rank is listed (``crashed``) while within the TTL, but not
    counted live. A scoped ingest token reads its namespace's runs only (404 for others)."""
    require_owned(token, run_id)
    run = res.state.runs.get(run_id)
    if run is None:
        raise HTTPException(404, f"no run {run_id!r}: it never reported, or its history was deleted")
    now = time.monotonic()
    late_before = now - res.state.late_after(run, settings.rank_late_s)
    shown = [st for st in res.state.held_ranks(run, now)
             if st.scope != "heartbeat" or st.seen < late_before or st.crashed is not None]
    ranks = [RankView.model_validate(st).model_copy(update={"silent_s": now - st.seen, "late": st.seen < late_before})
             for st in shown]
    held = {st.rank for st in shown}
    ranks += [RankView.model_validate(st).model_copy(update={"silent_s": now - st.seen, "ended": True})
              for rank, st in run.ended_views.items() if rank not in held]
    ranks.sort(key=lambda v: v.rank)
    events = [EventView.model_validate(e) for e in res.store.events(run_id, limit=settings.events_shown)]
    sdpa = [SdpaView(backend=labels[0], dtype=labels[1], stage=labels[2], calls=v)
            for (fam, labels), v in run.counters.items() if fam == counters.SDPA.key]
    step, rank, found = run.latest_spikes or (0, 0, ())
    spikes = [SpikeView(step=step, rank=rank, **s.model_dump()) for s in found]
    return ApiJSON(RunDetail(**_summary(res, run, now), ranks=ranks, sdpa=sdpa, latest_spikes=spikes,
                             spikes_total={labels[0]: v for (fam, labels), v in run.counters.items()
                                           if fam == counters.SPIKE.key},
                             rollout=rollout_figures.latest(res.state, run, now),
                             rollout_nonfinite_total=run.counters.get((counters.ROLLOUT_NONFINITE.key, ()), 0),
                             weight_sync=weight_sync_view(res, run.run_id), event_counts=dict(run.event_counts),
                             events=events))
