"""``create_app(settings)``: the collector as a FastAPI app whose lifespan owns the store, the state, the
event and directive logs, the long-poll waiters and the Prometheus registry. Run it with one uvicorn
worker: the state lives in-process.

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

from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from nanwatch.monitor.deps import Resources
from nanwatch.monitor.directive_log import DirectiveLog
from nanwatch.monitor.errors import install_error_handlers
from nanwatch.monitor.event_log import EventLog
from nanwatch.monitor.exporter import StateCollector
from nanwatch.monitor.long_poll import LongPoll
from nanwatch.monitor.middleware import IngressGuard
from nanwatch.monitor.openapi import document_models
from nanwatch.monitor.routers import directives, health, metrics, reports, runs
from nanwatch.monitor.rules import Policy
from nanwatch.monitor.settings import Settings, get_settings
from nanwatch.monitor.state import CollectorState
from nanwatch.monitor.store import Store

__all__ = ["create_app"]

log = logging.getLogger("nanwatch.monitor")


def _resources(settings: Settings) -> Resources:
    store = Store(settings.db_path)
    loaded = store.load()
    state = CollectorState(ttl_s=settings.rank_ttl_s, series_cap=settings.max_series_per_run, loaded=loaded)
    events = EventLog(store=store, state=state)
    polls = LongPoll()
    directive_log = DirectiveLog(store=store, state=state, events=events, polls=polls,
                                 margin_steps=settings.directive_margin_steps, current=loaded.directives)
    policy = Policy(settings.rules, logit_tau=settings.logit_tau, directives=directive_log, events=events)
    registry = CollectorRegistry(auto_describe=True)
    registry.register(StateCollector(state, directive_log, logit_tau=settings.logit_tau))
    enc = {k: v.encode() for k, v in settings.ingest_tokens().items()}
    adm = {k: v.encode() for k, v in settings.admin_token_map().items()}
    return Resources(store=store, state=state, events=events, polls=polls, directives=directive_log,
                     policy=policy, registry=registry, ingest_tokens=enc, admin_tokens=adm)


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
    install_error_handlers(app, max_body_bytes=settings.max_body_bytes)
    document_models(app, reports.SCHEMA_MODELS + directives.SCHEMA_MODELS)
    return app
