"""Directives: the trainer's long-poll, and the admin's PUT/DELETE (audit-logged by token name)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Request

from nanwatch.monitor.atomic import StoreUnavailable, Unstorable, atomically
from nanwatch.monitor.deps import AdminToken, IngestToken, Resources, ResourcesDep, SettingsDep
from nanwatch.monitor.ingest import BadBody, parse_spec
from nanwatch.monitor.routers._errors import AUTH, BODY, INVALID, NOT_READY, refused, write_failed
from nanwatch.monitor.schemas import Problem, WireJSON
from nanwatch.wire import RUN_ID_PATTERN, Directive, DirectiveSpec

router = APIRouter(tags=["directives"])

RunIdPath = Annotated[str, Path(pattern=RUN_ID_PATTERN, description="run id")]
_RESPONSES = {**AUTH, **INVALID, **NOT_READY}


@router.get("/v1/directives/{run_id}", response_model=Directive, response_class=WireJSON,
            responses=_RESPONSES)
async def poll_directive(
    run_id: RunIdPath, res: ResourcesDep, settings: SettingsDep, _token: IngestToken,
    index: Annotated[int, Query(ge=0, description="the version the caller has; 0 at first")] = 0,
    wait: Annotated[float, Query(ge=0, le=3600, description="seconds to hold the request "
                                 "(clamped to NANWATCH_MAX_WAIT_S)")] = 0.0,
) -> WireJSON:
    """Long-poll: answers as soon as the run's directive version exceeds ``index``, else after ``wait``
    seconds with the current directive (version 0, mode ``none`` if the run has none)."""
    d = await res.directives.wait(run_id, index=index, wait_s=min(wait, settings.max_wait_s))
    return WireJSON(d)


_SPEC_BODY = {"required": True,
              "content": {"application/json": {"schema": {"$ref": "#/components/schemas/DirectiveSpec"}}}}
#: models the bodies reference, added to the OpenAPI components by create_app
SCHEMA_MODELS = (DirectiveSpec,)


@router.put("/v1/directives/{run_id}", response_model=Directive, response_class=WireJSON,
            openapi_extra={"requestBody": _SPEC_BODY},
            responses={400: {"model": Problem, "description": "malformed JSON"},
                       **BODY,
                       429: {"model": Problem, "description": "the collector's run cap was reached"}, **_RESPONSES})
async def put_directive(run_id: RunIdPath, request: Request, res: ResourcesDep, token: AdminToken) -> WireJSON:
    """Issue a new directive version. ``apply_at_step`` defaults to the earliest step every live rank can
    apply (the next step, or the next agreement step under torch.distributed) plus the margin.
    The change is audit-logged as an event naming the admin token that made it."""
    try:
        spec = parse_spec(await request.body())
    except BadBody as e:
        return refused(res, e)
    return _set(res, run_id, spec, token)


def _set(res: Resources, run_id: str, spec: DirectiveSpec, actor: str) -> WireJSON:
    """A new version, all or nothing: a poller never sees a version the store does not hold."""
    over = res.state.over_caps(set(), {run_id})
    if over is not None:
        return refused(res, BadBody(429, "cap", over))
    try:
        d = atomically(res.store, res.state, res.directives, {run_id},
                       lambda: res.directives.set(run_id, spec, actor=actor))
    except (StoreUnavailable, Unstorable) as e:
        return write_failed(res, e)
    return WireJSON(d)


@router.delete("/v1/directives/{run_id}", response_model=Directive, response_class=WireJSON,
               responses=_RESPONSES)
async def clear_directive(run_id: RunIdPath, res: ResourcesDep, token: AdminToken) -> WireJSON:
    """Go back to the model's own attention path: a new version with mode ``none``."""
    return _set(res, run_id, DirectiveSpec(mode="none", reason="cleared"), token)
