"""Dependencies and their ``Annotated`` aliases: resources owned by the lifespan, and bearer-token auth.

Tokens are compared with ``secrets.compare_digest`` against every configured token (no early exit), and
the matching token's name is what the audit log records. A scope with no token configured is open; that
is only allowed on loopback (``Settings.check_exposure``).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, HTTPException, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from nanwatch.monitor.atomic import resync
from nanwatch.monitor.directive_log import DirectiveLog
from nanwatch.monitor.event_log import EventLog
from nanwatch.monitor.exporter import MetricsRenderer
from nanwatch.monitor.long_poll import LongPoll
from nanwatch.monitor.rules import Policy
from nanwatch.monitor.settings import Settings
from nanwatch.monitor.state import CollectorState
from nanwatch.monitor.store import Store

# Dependencies are ``async def`` on purpose: FastAPI runs a plain ``def`` dependency in a worker thread,
# and at 1000 reports/s those thread hops were the largest cost of the ingest path (see loadgen.py).

__all__ = ["AdminToken", "IngestToken", "MetricsReader", "ReaderToken", "Resources", "ResourcesDep", "SettingsDep"]

bearer = HTTPBearer(
    auto_error=False, scheme_name="bearer",
    description="Ingest token (NANWATCH_TOKEN) for reports and directive polls; admin token "
                "(NANWATCH_ADMIN_TOKEN) for directive changes; any token, the reader-only metrics token "
                "(NANWATCH_METRICS_TOKEN) included, for reading runs and /metrics.")


@dataclass(slots=True)
class Resources:
    """What the lifespan opens and closes."""

    store: Store
    state: CollectorState
    events: EventLog
    polls: LongPoll
    directives: DirectiveLog
    policy: Policy
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
    if not resync(res.store, res.state, res.directives):  # never answer from memory the store disowns
        raise HTTPException(503, "a write failed and the store could not be re-read since; retry shortly",
                            headers={"Retry-After": "1"})
    return res


SettingsDep = Annotated[Settings, Depends(_settings)]
ResourcesDep = Annotated[Resources, Depends(_resources)]
_Creds = Annotated[HTTPAuthorizationCredentials | None, Security(bearer)]


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
        res.state.rejected["unauthorized"] += 1
        env = {"admin": "NANWATCH_ADMIN_TOKEN", "ingest": "NANWATCH_TOKEN"}.get(
            scope, "any nanwatch token; Prometheus: the reader-only NANWATCH_METRICS_TOKEN")
        raise HTTPException(401, f"missing bearer token: send 'Authorization: Bearer <token>' ({env})",
                            headers={"WWW-Authenticate": "Bearer"})
    presented = creds.credentials.encode("latin-1")  # the header's bytes as sent (tokens are visible ASCII)
    for tokens in wanted:
        name = _match(presented, tokens)
        if name is not None:
            return name
    res.state.rejected["unauthorized"] += 1
    others = {"ingest": (admin, res.metrics_tokens), "admin": (ingest, res.metrics_tokens)}.get(scope, ())
    if any(_match(presented, tokens) is not None for tokens in others):
        raise HTTPException(403, f"this token is not an {scope} token", headers={"WWW-Authenticate": "Bearer"})
    raise HTTPException(401, "invalid bearer token", headers={"WWW-Authenticate": "Bearer"})


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
