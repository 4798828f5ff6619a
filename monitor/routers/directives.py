"""Directives: the trainer's long-poll, and the admin's PUT/DELETE (audit-logged by token name)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Request

from nanwatch.monitor.deps import AdminToken, IngestToken, ResourcesDep, SettingsDep
from nanwatch.monitor.ingest import BadBody, parse_spec
from nanwatch.monitor.routers._errors import AUTH, INVALID, NOT_READY
from nanwatch.monitor.schemas import Problem, ValidationProblem, WireJSON
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
                       413: {"model": Problem, "description": "body over NANWATCH_MAX_BODY_BYTES"}, **_RESPONSES})
async def put_directive(run_id: RunIdPath, request: Request, res: ResourcesDep, token: AdminToken) -> WireJSON:
    """Issue a new directive version. ``apply_at_step`` defaults to the latest step seen plus the margin.
    The change is audit-logged as an event naming the admin token that made it."""
    try:
        spec = parse_spec(await request.body())
    except BadBody as e:
        res.state.rejected[e.reason] += 1
        body = ValidationProblem(detail=e.detail) if e.status == 422 else Problem(detail=str(e.detail))
        return WireJSON(body, status_code=e.status)
    with res.store.transaction():
        d = res.directives.set(run_id, spec, actor=token)
    return WireJSON(d)


@router.delete("/v1/directives/{run_id}", response_model=Directive, response_class=WireJSON,
               responses=_RESPONSES)
async def clear_directive(run_id: RunIdPath, res: ResourcesDep, token: AdminToken) -> WireJSON:
    """Go back to the model's own attention path: a new version with mode ``none``."""
    with res.store.transaction():
        d = res.directives.set(run_id, DirectiveSpec(mode="none", reason="cleared"), actor=token)
    return WireJSON(d)
