"""Dependencies and their ``Annotated`` aliases: resources owned by the lifespan, and bearer-token auth
(who a token is, and which runs it owns: ``nanwatch.monitor.data.auth``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, HTTPException, Path, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from nanwatch.monitor.data.auth import Principal, Role, TokenTable
from nanwatch.monitor.data.directive_log import DirectiveLog
from nanwatch.monitor.data.durable import DurableStore
from nanwatch.monitor.data.long_poll import LongPoll
from nanwatch.monitor.data.state import CollectorState
from nanwatch.monitor.read.exporter import MetricsRenderer
from nanwatch.monitor.settings import Settings
from nanwatch.monitor.write.ledger import Ledger
from nanwatch.wire import RUN_ID_PATTERN

# Dependencies are ``async def`` on purpose: FastAPI runs a plain ``def`` dependency in a worker thread,
# and at 1000 reports/s those thread hops were the largest cost of the ingest path (measured with
# ``nanwatch bench collector``, nanwatch.bench.load).

__all__ = ["AdminToken", "IngestToken", "MetricsReader", "ReaderToken", "Resources", "ResourcesDep", "RunIdPath",
           "SettingsDep", "require_owned"]

bearer = HTTPBearer(
    auto_error=False, scheme_name="bearer",
    description="Ingest token (NANWATCH_TOKEN) for reports and directive polls; admin token "
                "(NANWATCH_ADMIN_TOKEN) for directive changes; any token, the reader-only metrics token "
                "(NANWATCH_METRICS_TOKEN) included, for reading runs and /metrics.")


@dataclass(slots=True)
class Resources:
    """What the lifespan opens and closes. Routes write through ``ledger`` alone; they read ``state``,
    ``directive_log`` and ``store`` (events), after the ledger's ``resync``."""

    store: DurableStore
    state: CollectorState
    polls: LongPoll
    directive_log: DirectiveLog
    ledger: Ledger
    metrics: MetricsRenderer
    tokens: TokenTable


async def _settings(request: Request) -> Settings:
    return request.app.state.settings


async def _resources(request: Request) -> Resources:
    res = getattr(request.app.state, "resources", None)
    if res is None:
        raise HTTPException(503, "the collector is starting or stopping; retry shortly",
                            headers={"Retry-After": "1"})
    if not res.ledger.sync.resync():  # never answer from memory the store disowns
        raise HTTPException(503, "a write failed and the store could not be re-read since; retry shortly",
                            headers={"Retry-After": "1"})
    run_id = request.path_params.get("run_id")  # replicas: a run another one wrote is re-read when named
    if run_id is not None or request.url.path == "/v1/runs":
        res.ledger.sync.catch_up({run_id} if run_id is not None else None)
    return res


SettingsDep = Annotated[Settings, Depends(_settings)]
RunIdPath = Annotated[str, Path(pattern=RUN_ID_PATTERN, description="run id")]
ResourcesDep = Annotated[Resources, Depends(_resources)]
_Creds = Annotated[HTTPAuthorizationCredentials | None, Security(bearer)]


def _authorize(res: Resources, request: Request, role: Role) -> Principal:
    return res.tokens.authorize(request.headers.get("authorization"), role)


async def _ingest(res: ResourcesDep, request: Request, _creds: _Creds) -> Principal:
    return _authorize(res, request, "ingest")


async def _admin(res: ResourcesDep, request: Request, _creds: _Creds) -> Principal:
    return _authorize(res, request, "admin")


async def _reader(res: ResourcesDep, request: Request, _creds: _Creds) -> Principal:
    return _authorize(res, request, "reader")


async def _metrics_reader(res: ResourcesDep, request: Request, settings: SettingsDep, _creds: _Creds) -> Principal:
    return Principal("anonymous", "reader") if settings.metrics_public else _authorize(res, request, "reader")


#: Who sent the request (``nanwatch.monitor.data.auth``; "anonymous" where the role is open). The ``bearer``
#: security dependency only documents the scheme in OpenAPI: the token is checked from the header.
IngestToken = Annotated[Principal, Depends(_ingest)]
AdminToken = Annotated[Principal, Depends(_admin)]
ReaderToken = Annotated[Principal, Depends(_reader)]
MetricsReader = Annotated[Principal, Depends(_metrics_reader)]


def require_owned(principal: Principal, run_id: str) -> None:
    """404 unless ``principal`` owns ``run_id`` (a scoped ingest token reads and polls its namespace only).
    Not 403: another namespace's runs are not there for this caller, so their existence does not leak."""
    if not principal.owns(run_id):
        raise HTTPException(404, f"no run {run_id!r}: it never reported, or its history was deleted")
