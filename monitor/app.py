"""``create_app(settings)``: the collector as a FastAPI app whose lifespan owns the store, the state, the
directive hub and the Prometheus registry. Run it with one uvicorn worker: the state lives in-process.

Example usage::

    uvicorn --factory nanwatch.monitor.app:create_app      # settings from NANWATCH_* env
    nanwatch serve --host 127.0.0.1 --port 8000 --db nanwatch.db
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress

from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler, request_validation_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from prometheus_client import CollectorRegistry, make_asgi_app
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from nanwatch.monitor.deps import Resources
from nanwatch.monitor.directives import DirectiveHub
from nanwatch.monitor.exporter import StateCollector
from nanwatch.monitor.ingest import BOUNDED, MAX_INT
from nanwatch.monitor.routers import directives, health, metrics, reports, runs
from nanwatch.monitor.rules import Policy
from nanwatch.monitor.schemas import Problem, WireJSON
from nanwatch.monitor.settings import Settings, get_settings
from nanwatch.monitor.state import CollectorState
from nanwatch.monitor.store import Store

__all__ = ["create_app"]

log = logging.getLogger("nanwatch.monitor")


class IngressGuard:
    """Cheap refusals before a body is read: 413 when Content-Length is over the limit, and 503 +
    Retry-After when too many ingest requests are in flight (load shedding).

    Bodies without a Content-Length (chunked) are stream-counted and cut off at the limit, so a huge body is
    never buffered. (FastAPI's own ``max_body_size`` would do the counting, but it replaces the response to
    an oversized Content-Length with a plain-text 413 that names no limit and is not the documented
    ``Problem`` body.) In-flight requests pile up only when the event loop falls behind, so that count is
    the overload signal; senders back off, and replays are idempotent."""

    def __init__(self, app: ASGIApp, *, max_body: int, limit: int, retry_after_s: int) -> None:
        self.app, self.max_body, self.limit, self.retry_after = app, max_body, limit, str(retry_after_s)
        self.inflight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None and length.isdigit() and int(length) > self.max_body:
            body = Problem(detail=f"request body of {int(length)} bytes is over the {self.max_body}-byte limit "
                                  "(NANWATCH_MAX_BODY_BYTES); send smaller batches")
            return await self._refuse(scope, receive, send, "too_large", WireJSON(body, 413))
        receive = self._counted(receive)
        if scope["path"] != "/v1/reports":
            return await self.app(scope, receive, send)
        if self.inflight >= self.limit:
            body = Problem(detail=f"overloaded: {self.inflight} ingest requests in flight; retry later")
            resp = WireJSON(body, 503, headers={"Retry-After": self.retry_after})
            return await self._refuse(scope, receive, send, "overloaded", resp)
        self.inflight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.inflight -= 1

    def _counted(self, receive: Receive) -> Receive:
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.max_body:
                raise StarletteHTTPException(413)  # rendered by the app's handler, counted there
            return message

        return counted

    @staticmethod
    async def _refuse(scope: Scope, receive: Receive, send: Send, reason: str, response: WireJSON) -> None:
        res = getattr(scope["app"].state, "resources", None)
        if res is not None:
            res.state.rejected[reason] += 1
        await response(scope, receive, send)


def _resources(settings: Settings) -> Resources:
    store = Store(settings.db_path)
    loaded = store.load()
    state = CollectorState(ttl_s=settings.rank_ttl_s, series_cap=settings.max_series_per_run, loaded=loaded)
    hub = DirectiveHub(store=store, state=state, margin_steps=settings.directive_margin_steps,
                       current=loaded.directives)
    policy = Policy(settings.rules, logit_tau=settings.logit_tau, hub=hub)
    registry = CollectorRegistry(auto_describe=True)
    registry.register(StateCollector(state, hub))
    enc = {k: v.encode() for k, v in settings.ingest_tokens().items()}
    adm = {k: v.encode() for k, v in settings.admin_token_map().items()}
    return Resources(store=store, state=state, hub=hub, policy=policy, registry=registry,
                     ingest_tokens=enc, admin_tokens=adm)


async def _sweep(res: Resources, every_s: float) -> None:
    while True:
        await asyncio.sleep(every_s)
        res.state.sweep(time.monotonic())


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the collector. Raises ValueError for an exposed host without tokens or unreadable token files."""
    settings = settings if settings is not None else get_settings()
    settings.check_exposure()
    settings.ingest_tokens(), settings.admin_token_map()  # fail now on unreadable token files

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        res = _resources(settings)
        app.state.metrics_app = make_asgi_app(res.registry)
        app.state.resources = res
        sweeper = asyncio.create_task(_sweep(res, max(0.05, min(settings.rank_ttl_s / 4, 30.0))))
        log.info("nanwatch collector ready: db=%s runs=%d", settings.db_path, len(res.state.runs))
        try:
            yield
        finally:
            sweeper.cancel()
            with suppress(asyncio.CancelledError):
                await sweeper
            app.state.resources = None
            res.store.close()

    app = FastAPI(title="nanwatch collector", version="1", lifespan=lifespan,
                  description="Numerical-health reports in, Prometheus metrics and directives out.")
    app.state.settings = settings
    app.state.resources = None
    for module in (reports, directives, runs, metrics, health):
        app.include_router(module.router)
    app.add_middleware(IngressGuard, max_body=settings.max_body_bytes, limit=settings.max_inflight_ingest,
                       retry_after_s=settings.retry_after_s)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        if exc.status_code == 405:  # Starlette's Allow names one route's methods; a path has several
            allowed = sorted({m for r in app.routes if isinstance(r, APIRoute)
                              and r.path_regex.match(request.url.path) for m in r.methods})
            exc = StarletteHTTPException(405, f"method {request.method} not allowed here; use {', '.join(allowed)}",
                                         headers={"Allow": ", ".join(allowed)})
        if exc.status_code == 413:
            _count(request, "too_large")
            exc = StarletteHTTPException(413, f"request body over the {settings.max_body_bytes}-byte limit "
                                              "(NANWATCH_MAX_BODY_BYTES); send smaller batches")
        return await http_exception_handler(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        _count(request, "invalid")
        return await request_validation_exception_handler(request, exc)

    _document_models(app, reports.SCHEMA_MODELS + directives.SCHEMA_MODELS)
    return app


def _count(request: Request, reason: str) -> None:
    res = getattr(request.app.state, "resources", None)
    if res is not None:
        res.state.rejected[reason] += 1


def _document_models(app: FastAPI, models: tuple) -> None:
    """Add models that routes reference by ``$ref`` but do not declare as parameters to the OpenAPI doc."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            doc = build()
            comps = doc.setdefault("components", {}).setdefault("schemas", {})
            for model in models:
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                comps.update(schema.pop("$defs", {}))
                comps[model.__name__] = schema
            if "StepReport" in comps:  # the wire validator accepts major 1 only; say so in the schema
                comps["StepReport"]["properties"]["v"]["pattern"] = r"^0*1(\.[\s\S]*)?$"
            for name, fields in BOUNDED.items():  # what ingest enforces beyond the wire models
                for f in fields:
                    prop = comps[name]["properties"][f]
                    for alt in prop.get("anyOf", [prop]):
                        if alt.get("type") == "integer":
                            alt["maximum"] = MAX_INT
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi
