"""Dependencies and their ``Annotated`` aliases: resources owned by the lifespan, and bearer-token auth.

Tokens are compared with ``secrets.compare_digest`` against every configured token (no early exit), and
the matching token's name is what the audit log records. A scope with no token configured is open; that
is only allowed on loopback (``Settings.check_exposure``).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, HTTPException, Path, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from nanwatch.monitor.directive_log import DirectiveLog
from nanwatch.monitor.exporter import MetricsRenderer
from nanwatch.monitor.ledger import Ledger
from nanwatch.monitor.long_poll import LongPoll
from nanwatch.monitor.refusal import Refused
from nanwatch.monitor.settings import Settings
from nanwatch.monitor.state import CollectorState
from nanwatch.monitor.store import Store
from nanwatch.wire import RUN_ID_PATTERN

# Dependencies are ``async def`` on purpose: FastAPI runs a plain ``def`` dependency in a worker thread,
# and at 1000 reports/s those thread hops were the largest cost of the ingest path (measured with
# ``nanwatch bench collector``, nanwatch.bench.load).

__all__ = ["AdminToken", "IngestToken", "MetricsReader", "ReaderToken", "Resources", "ResourcesDep", "RunIdPath",
           "SettingsDep"]

bearer = HTTPBearer(
    auto_error=False, scheme_name="bearer",
    description="Ingest token (NANWATCH_TOKEN) for reports and directive polls; admin token "
                "(NANWATCH_ADMIN_TOKEN) for directive changes; any token, the reader-only metrics token "
                "(NANWATCH_METRICS_TOKEN) included, for reading runs and /metrics.")


@dataclass(slots=True)
class Resources:
    """What the lifespan opens and closes. Routes write through ``ledger`` alone; they read ``state``,
    ``directive_log`` and ``store`` (events), after the ledger's ``resync``."""

    store: Store
    state: CollectorState
    polls: LongPoll
    directive_log: DirectiveLog
    ledger: Ledger
    metrics: MetricsRenderer
    ingest_tokens: dict[str, bytes]
    admin_tokens: dict[str, bytes]
    metrics_tokens: dict[str, bytes]


async def _settings(request: Request) -> Settings:
    return request.app.state.settings


async def _resources(request: Request) -> Resources:
    res = getattr(request.app.state, "resources", None)
    if res is None:
        raise HTTPException(503, "the collector is starting or stopping; retry shortly",
                            headers={"Retry-After": "1"})
    if not res.ledger.resync():  # never answer from memory the store disowns
        raise HTTPException(503, "a write failed and the store could not be re-read since; retry shortly",
                            headers={"Retry-After": "1"})
    return res


SettingsDep = Annotated[Settings, Depends(_settings)]
RunIdPath = Annotated[str, Path(pattern=RUN_ID_PATTERN, description="run id")]
ResourcesDep = Annotated[Resources, Depends(_resources)]
_Creds = Annotated[HTTPAuthorizationCredentials | None, Security(bearer)]


class _Unauthorized(Refused):
    """No token, or not one of the scope's: 401 (403 for a valid token of another kind)."""

    status, reason = 401, "unauthorized"

    def __init__(self, detail: str, *, status: int = 401) -> None:
        super().__init__(detail, status=status, headers={"WWW-Authenticate": "Bearer"})


def _match(presented: bytes, tokens: dict[str, bytes]) -> str | None:
    found = None
    for name, token in tokens.items():
        if secrets.compare_digest(presented, token):
            found = name
    return found


def _check(res: Resources, creds: HTTPAuthorizationCredentials | None, *, scope: str) -> str:
    ingest, admin = res.ingest_tokens, res.admin_tokens
    wanted = {"ingest": (ingest,), "admin": (admin,), "reader": (ingest, admin, res.metrics_tokens)}[scope]
    if not any(wanted):  # a scope without tokens is open (loopback only)
        return "anonymous"
    if creds is None:
        env = {"admin": "NANWATCH_ADMIN_TOKEN", "ingest": "NANWATCH_TOKEN"}.get(
            scope, "any nanwatch token; Prometheus: the reader-only NANWATCH_METRICS_TOKEN")
        raise _Unauthorized(f"missing bearer token: send 'Authorization: Bearer <token>' ({env})")
    presented = creds.credentials.encode("latin-1")  # the header's bytes as sent (tokens are visible ASCII)
    for tokens in wanted:
        name = _match(presented, tokens)
        if name is not None:
            return name
    others = {"ingest": (admin, res.metrics_tokens), "admin": (ingest, res.metrics_tokens)}.get(scope, ())
    if any(_match(presented, tokens) is not None for tokens in others):
        raise _Unauthorized(f"this token is not an {scope} token", status=403)
    raise _Unauthorized("invalid bearer token")


async def _ingest(res: ResourcesDep, creds: _Creds) -> str:
    return _check(res, creds, scope="ingest")


async def _admin(res: ResourcesDep, creds: _Creds) -> str:
    return _check(res, creds, scope="admin")


async def _reader(res: ResourcesDep, creds: _Creds) -> str:
    return _check(res, creds, scope="reader")


async def _metrics_reader(res: ResourcesDep, settings: SettingsDep, creds: _Creds) -> str:
    return "anonymous" if settings.metrics_public else _check(res, creds, scope="reader")


#: The name of the token that authenticated the request ("anonymous" where the scope is open).
IngestToken = Annotated[str, Depends(_ingest)]
AdminToken = Annotated[str, Depends(_admin)]
ReaderToken = Annotated[str, Depends(_reader)]
MetricsReader = Annotated[str, Depends(_metrics_reader)]
