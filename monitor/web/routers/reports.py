"""``POST /v1/reports``: ingest."""

from __future__ import annotations

from fastapi import APIRouter, Request

from nanwatch.monitor.data.refusal import Refused
from nanwatch.monitor.web.body import parse_batch
from nanwatch.monitor.web.deps import IngestToken, ResourcesDep
from nanwatch.monitor.web.routers._problems import AUTH, BODY, INVALID, NOT_READY
from nanwatch.monitor.web.schemas import ApiJSON, IngestResult, Problem
from nanwatch.wire import ReportBatch

router = APIRouter(tags=["reports"])

_BODY = {"required": True, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ReportBatch"}}}}
#: models the body references, added to the OpenAPI components by create_app
SCHEMA_MODELS = (ReportBatch,)


@router.post(
    "/v1/reports", response_model=IngestResult, response_class=ApiJSON,
    openapi_extra={"requestBody": _BODY},
    responses={400: {"model": Problem, "description": "malformed JSON, or an unsupported schema major version"},
               **BODY,
               429: {"model": Problem, "description": "a cap was reached (runs, or a run's incarnations)"},
               **AUTH, 403: {"model": Problem, "description": "a valid token of the wrong kind, or a report for a "
                             "run outside the token's namespace (nothing was applied)"},
               **INVALID, **NOT_READY},
)
async def post_reports(request: Request, res: ResourcesDep, token: IngestToken) -> ApiJSON:
    """Apply a batch of step reports. Resent reports, already applied (same run_id, rank, incarnation, seq),
    are acknowledged as ``duplicates`` and not applied twice, so senders may retry freely. A refusal
    (``nanwatch.monitor.data.refusal``) is answered by the app's handler. A scoped token's batch is checked whole
    before anything is applied: one report for a run outside its namespace refuses it all (403)."""
    batch = parse_batch(await request.body())
    foreign = sorted({r.run_id for r in batch.reports if not token.owns(r.run_id)})
    if foreign:
        raise Refused(f"token {token.name!r} owns the runs matching {token.runs!r}, not {foreign[0]!r}"
                      f"{f' (and {len(foreign) - 1} more)' if len(foreign) > 1 else ''}: nothing was applied",
                      status=403, reason="foreign_run")
    return ApiJSON(IngestResult.model_validate(res.ledger.ingest(batch)))
