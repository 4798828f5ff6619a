"""``/healthz`` (the process answers) and ``/readyz`` (the store is open, its schema is whole and it takes a
write now: a full disk, a read-only file or a dropped table or column is "not ready", since every ingest
would answer 503)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from nanwatch.monitor.web.schemas import ApiJSON, Health, Problem

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health, response_class=ApiJSON)
async def healthz() -> ApiJSON:
    return ApiJSON(Health(status="ok"))


@router.get("/readyz", response_model=Health, response_class=ApiJSON,
            responses={503: {"model": Problem,
                             "description": "not ready: starting, the store's schema is not whole, or it refuses "
                                            "writes"}})
async def readyz(request: Request) -> ApiJSON:
    res = getattr(request.app.state, "resources", None)
    if res is None:
        return ApiJSON(Problem(detail="the store is not open"), status_code=503)
    if not res.ledger.sync.resync():
        return ApiJSON(Problem(detail="a write failed and the store could not be re-read since: memory may "
                                       "hold what was never committed"), status_code=503)
    why = res.store.schema_problem()
    if why is not None:
        return ApiJSON(Problem(detail=f"the store's schema is not whole, so every ingest would fail: {why}"),
                       status_code=503)
    why = res.store.probe()
    if why is not None:
        return ApiJSON(Problem(detail=f"the store refuses writes, so every ingest would fail: {why}"),
                        status_code=503)
    return ApiJSON(Health(status="ready"))
