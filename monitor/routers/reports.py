"""``POST /v1/reports``: ingest."""

from __future__ import annotations

from fastapi import APIRouter, Request

from nanwatch.monitor.atomic import StoreUnavailable, Unstorable
from nanwatch.monitor.deps import IngestToken, ResourcesDep
from nanwatch.monitor.ingest import BadBody, IngestResult, ingest, parse_batch
from nanwatch.monitor.routers._errors import AUTH, BODY, INVALID, NOT_READY, refused, write_failed
from nanwatch.monitor.schemas import Problem, WireJSON
from nanwatch.wire import ReportBatch

router = APIRouter(tags=["reports"])

_BODY = {"required": True, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ReportBatch"}}}}
#: models the body references, added to the OpenAPI components by create_app
SCHEMA_MODELS = (ReportBatch,)


@router.post(
    "/v1/reports", response_model=IngestResult, response_class=WireJSON,
    openapi_extra={"requestBody": _BODY},
    responses={400: {"model": Problem, "description": "malformed JSON, or an unsupported schema major version"},
               **BODY,
               429: {"model": Problem, "description": "a cap was reached (runs, or a run's incarnations)"},
               **AUTH, **INVALID, **NOT_READY},
)
async def post_reports(request: Request, res: ResourcesDep, _token: IngestToken) -> WireJSON:
    """Apply a batch of step reports. Replays of applied reports (same run_id, rank, incarnation, seq)
    are acknowledged as ``duplicates`` and not applied twice, so senders may retry freely."""
    raw = await request.body()
    try:
        batch = parse_batch(raw)
    except BadBody as e:
        return refused(res, e)
    try:
        result = ingest(batch, state=res.state, directives=res.directives, policy=res.policy, store=res.store)
    except BadBody as e:
        return refused(res, e)
    except (StoreUnavailable, Unstorable) as e:
        return write_failed(res, e)
    return WireJSON(result)
