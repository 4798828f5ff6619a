"""``POST /v1/reports``: ingest."""

from __future__ import annotations

from fastapi import APIRouter, Request

from nanwatch.monitor.deps import IngestToken, ResourcesDep
from nanwatch.monitor.ingest import BadBody, IngestResult, StoreUnavailable, ingest, parse_batch
from nanwatch.monitor.routers._errors import AUTH, INVALID, NOT_READY
from nanwatch.monitor.schemas import Problem, ValidationProblem, WireJSON
from nanwatch.wire import ReportBatch

router = APIRouter(tags=["reports"])

_BODY = {"required": True, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ReportBatch"}}}}
#: models the body references, added to the OpenAPI components by create_app
SCHEMA_MODELS = (ReportBatch,)


@router.post(
    "/v1/reports", response_model=IngestResult, response_class=WireJSON,
    openapi_extra={"requestBody": _BODY},
    responses={400: {"model": Problem, "description": "malformed JSON, or an unsupported schema major version"},
               413: {"model": Problem, "description": "body over NANWATCH_MAX_BODY_BYTES"},
               **AUTH, **INVALID, **NOT_READY},
)
async def post_reports(request: Request, res: ResourcesDep, _token: IngestToken) -> WireJSON:
    """Apply a batch of step reports. Replays of applied reports (same run_id, rank, incarnation, seq)
    are acknowledged as ``duplicates`` and not applied twice, so senders may retry freely."""
    raw = await request.body()
    try:
        batch = parse_batch(raw)
    except BadBody as e:
        res.state.rejected[e.reason] += 1
        body = ValidationProblem(detail=e.detail) if e.status == 422 else Problem(detail=str(e.detail))
        return WireJSON(body, status_code=e.status)
    try:
        result = ingest(batch, state=res.state, directives=res.directives, policy=res.policy, store=res.store)
    except StoreUnavailable as e:
        res.state.rejected["store_error"] += 1
        return WireJSON(Problem(detail=str(e)), status_code=503, headers={"Retry-After": "1"})
    return WireJSON(result)
