"""``/healthz`` (the process answers) and ``/readyz`` (the store is open and takes a write now: a full
disk or a read-only file is "not ready", since every ingest would answer 503)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from nanwatch.monitor.atomic import resync
from nanwatch.monitor.schemas import Health, Problem, WireJSON

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health, response_class=WireJSON)
async def healthz() -> WireJSON:
    return WireJSON(Health(status="ok"))


@router.get("/readyz", response_model=Health, response_class=WireJSON,
            responses={503: {"model": Problem, "description": "not ready: starting, or the store refuses writes"}})
async def readyz(request: Request) -> WireJSON:
    res = getattr(request.app.state, "resources", None)
    if res is None:
        return WireJSON(Problem(detail="the store is not open"), status_code=503)
    if not resync(res.store, res.state, res.directives):
        return WireJSON(Problem(detail="a write failed and the store could not be re-read since: memory may "
                                       "hold what was never committed"), status_code=503)
    why = res.store.probe()
    if why is not None:
        return WireJSON(Problem(detail=f"the store refuses writes, so every ingest would fail: {why}"),
                        status_code=503)
    return WireJSON(Health(status="ready"))
