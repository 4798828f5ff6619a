"""``PUT /v1/runs/{run_id}/weights/{version}``: one side's weight fingerprints of a weight version, compared
with the other side's (``nanwatch.monitor.write.weight_compare``; docs/weight_sync.md). ``GET
/v1/runs/{run_id}/weights``: where the run's syncs stand, which the trainer's rollout classification asks
before it calls a mismatch a drift or a jump (``nanwatch.hooks.rollout.sync_verdict``)."""

from __future__ import annotations

import time
from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Request

from nanwatch.monitor.data.refusal import Refused
from nanwatch.monitor.web.body import parse_strict
from nanwatch.monitor.web.deps import (
    IngestToken,
    Resources,
    ResourcesDep,
    RunIdPath,
    require_owned,
)
from nanwatch.monitor.web.routers._problems import AUTH, BODY, INVALID, NOT_READY
from nanwatch.monitor.web.schemas import ApiJSON, Problem, WeightSyncResult, WeightSyncView, WorkerSyncView
from nanwatch.monitor.write.weight_compare import apply_weights
from nanwatch.wire import MAX_INT, WeightFingerprints

router = APIRouter(tags=["weights"])

_BODY = {"required": True,
         "content": {"application/json": {"schema": {"$ref": "#/components/schemas/WeightFingerprints"}}}}
#: models the body references, added to the OpenAPI components by create_app
SCHEMA_MODELS = (WeightFingerprints,)


@router.put(
    "/v1/runs/{run_id}/weights/{version}", response_model=WeightSyncResult, response_class=ApiJSON,
    openapi_extra={"requestBody": _BODY},
    responses={400: {"model": Problem, "description": "malformed JSON"}, **BODY,
               409: {"model": Problem, "description": "the version already has another trainer set"},
               403: {"model": Problem, "description": "a valid token of the wrong kind, a run outside the token's "
                     "namespace, or side=trainer without an incarnation (nothing was applied)"},
               429: {"model": Problem, "description": "a cap was reached (runs, memory, a version's waiting "
                     "rollout sets)"},
               **AUTH,
               **INVALID, **NOT_READY},
)
async def put_weights(run_id: RunIdPath, version: Annotated[int, Path(ge=0, le=MAX_INT)], request: Request,
                      res: ResourcesDep, token: IngestToken) -> ApiJSON:
    """Record the trainer's or a rollout worker's weight fingerprints of weight ``version`` and compare them
    with the other side's, when it is there: each rollout worker's set is compared with the trainer's; equal
    counts ``nanwatch_weight_syncs_verified_total``, different counts ``nanwatch_weight_sync_mismatches_total``
    and logs a ``weight_sync_mismatch`` event (version, worker, first differing tensors). Dtype-aware: a rollout
    tensor verifies against the trainer's native fingerprint or its cast to the rollout's dtype; a dtype or
    shape no published cast explains is ``unverifiable`` (``weight_sync_unverifiable``), never a mismatch. A
    trainer set must carry the incarnation of the rank that posts the run's reports (403 without): it is
    compared once that incarnation reports (``bound``). A resend of the same set is answered again and
    counted once. An ingest token writes its namespace's runs only (403)."""
    if not token.owns(run_id):
        raise Refused(f"token {token.name!r} owns the runs matching {token.runs!r}, not {run_id!r}: nothing was "
                      "applied", status=403, reason="foreign_run")
    body = parse_strict(WeightFingerprints, await request.body())
    return ApiJSON(WeightSyncResult.model_validate(apply_weights(res.ledger, run_id, version, body)))


def weight_sync_view(res: Resources, run_id: str) -> WeightSyncView | None:
    """The run's weight syncs: the latest published version, each worker's state and its lag now (in memory;
    None: the run never posted a set)."""
    summary = res.ledger.weight_syncs.summary(run_id)
    if summary is None:
        return None
    lag = res.ledger.weight_syncs.lag(run_id, time.time())
    return WeightSyncView(latest_published=summary["latest_published"], workers={
        k: WorkerSyncView(**w, lag=lag.get(k, 0)) for k, w in summary["workers"].items()})


@router.get("/v1/runs/{run_id}/weights", response_model=WeightSyncView, response_class=ApiJSON,
            responses={404: {"model": Problem, "description": "the run posted no weight set (or is not there)"},
                       **AUTH, **INVALID, **NOT_READY})
async def get_weights(run_id: RunIdPath, res: ResourcesDep, token: IngestToken) -> ApiJSON:
    """Where the run's weight syncs stand: the latest version the trainer published, and each rollout worker's
    latest posted and verified version, its latest comparison's outcome and its lag. The trainer asks before
    it classifies a rollout mismatch (stale weights, not a drift), with the token it reports with, as it polls
    directives: ingest role (open where ingest is). A scoped ingest token reads its namespace's runs only (404
    for others)."""
    require_owned(token, run_id)
    view = weight_sync_view(res, run_id)
    if view is None:
        raise HTTPException(404, f"run {run_id!r} has posted no weight fingerprints")
    return ApiJSON(view)
