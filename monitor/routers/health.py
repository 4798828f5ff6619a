"""``/healthz`` (the process answers) and ``/readyz`` (the lifespan has opened the store and it answers)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from nanwatch.monitor.schemas import Health, Problem, WireJSON

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health, response_class=WireJSON)
async def healthz() -> WireJSON:
    return WireJSON(Health(status="ok"))


@router.get("/readyz", response_model=Health, response_class=WireJSON,
            responses={503: {"model": Problem, "description": "not ready yet"}})
async def readyz(request: Request) -> WireJSON:
    res = getattr(request.app.state, "resources", None)
    try:
        ok = res is not None and res.store.ping()
    except Exception:  # a broken database is "not ready", never a 500
        ok = False
    if not ok:
        return WireJSON(Problem(detail="the store is not open"), status_code=503)
    return WireJSON(Health(status="ready"))
