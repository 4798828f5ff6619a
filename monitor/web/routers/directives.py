"""Directives: the trainer's long-poll, and the admin's PUT/DELETE (audit-logged by token name)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Request
from starlette.responses import Response

from nanwatch.monitor.data.long_poll import while_connected
from nanwatch.monitor.web.body import parse_spec
from nanwatch.monitor.web.deps import (
    AdminToken,
    IngestToken,
    ResourcesDep,
    RunIdPath,
    SettingsDep,
    require_owned,
)
from nanwatch.monitor.web.routers._problems import AUTH, BODY, INVALID, NOT_READY
from nanwatch.monitor.web.schemas import ApiJSON, Problem
from nanwatch.wire import Directive, DirectiveSpec

router = APIRouter(tags=["directives"])

_RESPONSES = {**AUTH, **INVALID, **NOT_READY}
_NOT_OWNED = {404: {"model": Problem, "description": "a run outside the token's namespace"}}


@router.get("/v1/directives/{run_id}", response_model=Directive, response_class=ApiJSON,
            responses={**_NOT_OWNED, **_RESPONSES})
async def poll_directive(
    run_id: RunIdPath, request: Request, res: ResourcesDep, settings: SettingsDep, token: IngestToken,
    index: Annotated[int, Query(ge=0, description="the version the caller has; 0 at first")] = 0,
    wait: Annotated[float, Query(ge=0, le=3600, description="seconds to hold the request "
                                 "(clamped to NANWATCH_MAX_WAIT_S)")] = 0.0,
) -> Response:
    """Long-poll: answers as soon as the run's directive version exceeds ``index``, else after ``wait``
    seconds with the current directive (version 0, mode ``none`` if the run has none). A scoped token polls
    its own namespace's runs only (404 for others). A poll whose client leaves ends then, and its answer goes
    nowhere."""
    require_owned(token, run_id)
    d = await while_connected(request.receive,
                              res.directive_log.wait(run_id, index=index, wait_s=min(wait, settings.max_wait_s)))
    return Response(status_code=499) if d is None else ApiJSON(d)


_SPEC_BODY = {"required": True,
              "content": {"application/json": {"schema": {"$ref": "#/components/schemas/DirectiveSpec"}}}}
#: models the bodies reference, added to the OpenAPI components by create_app
SCHEMA_MODELS = (DirectiveSpec,)


@router.put("/v1/directives/{run_id}", response_model=Directive, response_class=ApiJSON,
            openapi_extra={"requestBody": _SPEC_BODY},
            responses={400: {"model": Problem, "description": "malformed JSON"},
                       **BODY,
                       429: {"model": Problem, "description": "the collector's run cap was reached"}, **_RESPONSES})
async def put_directive(run_id: RunIdPath, request: Request, res: ResourcesDep, token: AdminToken) -> ApiJSON:
    """Issue a new directive version. ``apply_at_step`` defaults to the earliest step every live rank can
    apply (the next step, or the next agreement step under torch.distributed) plus the margin.
    The change is audit-logged as an event naming the admin token that made it."""
    spec = parse_spec(await request.body())
    return ApiJSON(res.ledger.set_directive(run_id, spec, actor=token.name))


@router.delete("/v1/directives/{run_id}", response_model=Directive, response_class=ApiJSON,
               responses=_RESPONSES)
async def clear_directive(run_id: RunIdPath, res: ResourcesDep, token: AdminToken) -> ApiJSON:
    """Go back to the model's own attention path: a new version with mode ``none``."""
    return ApiJSON(res.ledger.clear_directive(run_id, actor=token.name))
