"""``create_app(settings)``: the collector as a FastAPI app whose lifespan owns the store, the state, the
ledger every write goes through, the long-poll waiters and the metrics renderer. Run it with one uvicorn
worker: the state lives in-process.

Example usage::

    uvicorn --factory nanwatch.monitor.app:create_app      # settings from NANWATCH_* env
    nanwatch serve --host 127.0.0.1 --port 8000 --db nanwatch.db
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress

from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse
from starlette.middleware.trustedhost import TrustedHostMiddleware

from nanwatch.monitor.data.auth import TokenTable
from nanwatch.monitor.data.directive_log import DirectiveLog
from nanwatch.monitor.data.liveness import is_live
from nanwatch.monitor.data.long_poll import LongPoll
from nanwatch.monitor.data.refusal import Refused
from nanwatch.monitor.data.state import CollectorState, HostCaps
from nanwatch.monitor.data.store import EventRow, Store
from nanwatch.monitor.data.weight_rows import decode_all
from nanwatch.monitor.read.exporter import MetricsRenderer
from nanwatch.monitor.settings import Settings, database_url_of, get_settings
from nanwatch.monitor.web.deps import ReaderToken, Resources
from nanwatch.monitor.web.exception_handlers import install_exception_handlers
from nanwatch.monitor.web.middleware import IngressGate
from nanwatch.monitor.web.openapi import document_models
from nanwatch.monitor.web.routers import directives, health, metrics, reports, runs, weights
from nanwatch.monitor.write import exposure
from nanwatch.monitor.write.ledger import Ledger
from nanwatch.monitor.write.lifetimes import restore
from nanwatch.monitor.write.weight_compare import sweep_weights

__all__ = ["create_app"]

log = logging.getLogger("nanwatch.monitor")


def _open_store(settings: Settings) -> Store:
    """SQLite (``db_path``), or PostgreSQL when ``database_url`` is set: the same methods (``nanwatch.monitor.pg``,
    imported only then, so a collector without the ``postgres`` extra never needs psycopg)."""
    url = database_url_of(settings)
    if url is None:
        return Store(settings.db_path)
    try:
        from nanwatch.monitor.pg import PgStore
    except ImportError as e:
        raise ValueError(f"--database-url needs the postgres extra (pip install 'nanwatch[postgres]'): {e}") from None
    return PgStore(url)  # type: ignore[return-value]


def _resources(settings: Settings) -> Resources:
    store = _open_store(settings)
    loaded = store.load()
    scopes = settings.ingest_namespaces()
    tokens = TokenTable(ingest={k: (v, scopes.get(k)) for k, v in settings.ingest_tokens().items()},
                        admin=settings.admin_token_map(), reader=settings.metrics_token_map())
    state = CollectorState(ttl_s=settings.rank_ttl_s, series_cap=settings.max_series_per_run,
                           max_runs=settings.max_runs, max_incarnations=settings.max_incarnations_per_run,
                           max_events=settings.max_events_per_run, silent_keep_s=settings.silent_keep_s,
                           max_incarnations_per_namespace=settings.max_incarnations_per_namespace,
                           max_events_per_namespace=settings.max_events_per_namespace,
                           hosts=HostCaps(per_run=settings.max_hosts_per_run,
                                          per_namespace=settings.max_hosts_per_namespace,
                                          namespace_of=tokens.namespace_of))
    restore(state, loaded)
    polls = LongPoll()
    directive_log = DirectiveLog(polls=polls, current=loaded.directives, floor=loaded.directive_floor)
    ledger = Ledger(store=store, state=state, directive_log=directive_log, directive_rules=settings.rules,
                    logit_tau=settings.logit_tau, margin_steps=settings.directive_margin_steps,
                    namespace_of=tokens.namespace_of, memory_limit_bytes=settings.memory_limit_bytes(),
                    max_events=settings.max_events, weight_sync_wait_s=settings.weight_sync_wait_s,
                    weight_sync_expire_s=settings.weight_sync_expire_s,
                    weight_bytes_per_namespace=settings.max_weight_mib_per_namespace << 20,
                    weight_versions_per_namespace=settings.max_weight_versions_per_namespace)
    ledger.weight_syncs.replace(decode_all(loaded.weights))
    metrics = MetricsRenderer(state, directive_log, exposure, logit_tau=settings.logit_tau,
                              min_interval_s=settings.metrics_min_interval_s, late_s=settings.rank_late_s,
                              on_left_out=lambda runs: _left_out_events(ledger, runs))
    return Resources(store=store, state=state, polls=polls, directive_log=directive_log, ledger=ledger,
                     metrics=metrics, tokens=tokens)


def _left_out_events(ledger: Ledger, runs: dict[str, str]) -> None:
    """An event in each run a /metrics render left out (``render_left_out``, once per run and exception type):
    its owner reads why its series are missing in ``GET /v1/runs/{id}`` (#37)."""
    now = time.time()
    for run_id, error in runs.items():
        if run_id not in ledger.state.runs:
            continue
        ev = EventRow(run_id, now, "render_left_out", f"render_left_out:{error}", detail={"error": error})
        try:
            ledger.atomically({run_id}, set(), lambda ev=ev: ledger.record_event(ev))
        except Refused:  # the store is unavailable, or the run is being deleted: the next render tries again
            pass


def _replicas(settings: Settings, res: Resources) -> tuple[list[asyncio.Task], Callable[[], None]]:
    """With a shared PostgreSQL database: follow what the other replicas write, hold the leases that
    decide which replica exports a run (none until leased: a run is never shown by two), and share what
    the runs' metrics need across replicas (``nanwatch.monitor.pg.shared_metrics``: ranks' latest views,
    where each export stood). Returns the follower's task (none with SQLite) and what lets go of both."""
    if database_url_of(settings) is None:
        return [], lambda: None
    from nanwatch.monitor.data.tenures import Tenures
    from nanwatch.monitor.pg.follow import follow
    from nanwatch.monitor.pg.leases import RunLeases
    from nanwatch.monitor.pg.shared_metrics import SharedMetrics

    leases = RunLeases(res.store.url)  # type: ignore[attr-defined]
    shared = SharedMetrics(res.store.url)  # type: ignore[attr-defined]
    res.ledger.state.tenures = Tenures()
    res.ledger.export_only(set())  # none until leased
    res.metrics.on_rendered(lambda snap: shared.record_later({run.run_id: run.totals for run in snap.runs
                                                             if run.totals is not None}))
    task = asyncio.create_task(follow(res.store, res.ledger.sync.resync,  # type: ignore[arg-type]
                                      every_s=settings.database_refresh_s,
                                      tick=lambda: _lease_runs(res.ledger, leases, shared)))

    def close() -> None:
        leases.close()
        shared.close()

    return [task], close


def _lease_runs(ledger: Ledger, leases, shared) -> None:
    """Hold the leases of the runs live here (a shared PostgreSQL database): this replica shows the series
    of those it holds, and of no other (``CollectorState.exported_runs``, set through the ledger), each
    from where its last export stood; publish this replica's ranks' latest views, and show those the other
    replicas published of the runs it holds."""
    now = time.monotonic()
    state = ledger.state
    shared.publish(state)
    ledger.export_only(leases.update({run_id for run_id, run in state.runs.items() if is_live(state, run, now)}),
                       shared.recorded, shared.foreign)
    shared.clean()


async def _sweep(res: Resources, every_s: float, retention_s: float) -> None:
    while True:
        await asyncio.sleep(every_s)
        now = time.monotonic()
        res.ledger.sweep(now)
        sweep_weights(res.ledger, time.time())
        await res.ledger.retire(now, retention_s)


def _docs_router(title: str) -> APIRouter:
    """``/openapi.json``, ``/docs`` (Swagger UI) and ``/redoc`` behind the same reader token as ``/v1/runs``
    whenever tokens are configured: the document names every route and limit, a map for an attacker, not
    something to hand to anyone who asks. (A browser sends no bearer token by itself: fetch
    ``/openapi.json`` with curl, or open the pages through a proxy or an extension that adds the header.)"""
    router = APIRouter(include_in_schema=False)

    @router.get("/openapi.json")
    async def openapi(request: Request, _who: ReaderToken) -> JSONResponse:
        return JSONResponse(request.app.openapi())

    @router.get("/docs")
    async def swagger_ui(_who: ReaderToken) -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title=title)

    @router.get("/redoc")
    async def redoc(_who: ReaderToken) -> HTMLResponse:
        return get_redoc_html(openapi_url="/openapi.json", title=title)

    return router


def create_app(settings: Settings | None = None) -> FastAPI:
    """Build the collector. Raises ValueError for an exposed host without tokens or unreadable token files."""
    settings = settings if settings is not None else get_settings()
    settings.check_exposure()
    settings.check_store()
    settings.ingest_tokens(), settings.admin_token_map(), settings.metrics_token_map()  # fail now on bad token files
    if database_url_of(settings) is not None:
        _open_store(settings).close()  # fail now on an unreachable or foreign database, before listening
    elif settings.db_path != ":memory:":
        try:  # fail now on a foreign or newer database, or a path that cannot be opened, before listening
            Store(settings.db_path).close()
        except sqlite3.Error as e:
            raise ValueError(f"cannot open the database {settings.db_path!r}: {e}") from e

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        res = _resources(settings)
        app.state.resources = res
        every = max(0.05, min(settings.rank_ttl_s / 4, settings.run_retention_s / 4, settings.weight_sync_wait_s / 4,
                              30.0))
        follower, close_leases = _replicas(settings, res)
        tasks = [asyncio.create_task(_sweep(res, every, settings.run_retention_s)), *follower]
        log.info("nanwatch collector ready: db=%s runs=%d", getattr(res.store, "where", settings.db_path),
                 len(res.state.runs))
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
                with suppress(asyncio.CancelledError):
                    await task
            close_leases()
            app.state.resources = None
            res.store.close()

    # The API documents are served by ``_docs_router``, only when settings.docs is on; ``app.openapi()``
    # builds the document either way.
    app = FastAPI(title="nanwatch collector", version="1", lifespan=lifespan, openapi_url=None, docs_url=None,
                  redoc_url=None, description="Numerical-health reports in, Prometheus metrics and directives out.")
    app.state.settings = settings
    app.state.resources = None
    for module in (reports, directives, runs, weights, metrics, health):
        app.include_router(module.router)
    if settings.docs:
        app.include_router(_docs_router(app.title))
    app.add_middleware(IngressGate, max_body=settings.max_body_bytes, max_buffered=settings.max_buffered_bytes,
                       max_buffered_per_token=settings.max_buffered_bytes_per_token,
                       retry_after_s=settings.retry_after_s, body_timeout_s=settings.body_timeout_s)
    if not settings.ingest_tokens() or not settings.admin_token_map():
        # A scope without a token is open, which is only allowed on loopback: then only loopback names may
        # appear in Host, so a web page cannot reach it through DNS rebinding (its Host is its own name).
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=["127.0.0.1", "localhost", "::1", "[::1]"])
    install_exception_handlers(app)
    document_models(app, reports.SCHEMA_MODELS + directives.SCHEMA_MODELS + weights.SCHEMA_MODELS)
    return app
