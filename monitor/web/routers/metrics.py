"""``GET /metrics``: rendered by prometheus_client's own exposition (``choose_encoder`` picks the text or
OpenMetrics format from ``Accept``, gzip when the scraper accepts it), off the event loop
(``MetricsRenderer``), from a documented route so that the OpenAPI document lists it and ``/metrics``
needs no trailing slash. It needs a reader token whenever tokens are configured, unless
``NANWATCH_METRICS_PUBLIC`` is set: it names every run and layer. A scoped ingest token (one that owns a
run-id namespace) gets 403: the exposition names every namespace's runs, sites, ranks, hosts and capsule
paths, which that token may not read through ``/v1/runs`` either (#27 finding 15); Prometheus scrapes with
the reader token, an admin's or the unscoped ingest token."""

from __future__ import annotations

from fastapi import APIRouter, Request
from prometheus_client.exposition import gzip_accepted
from starlette.responses import Response

from nanwatch.monitor.data.auth import Unauthorized
from nanwatch.monitor.web.deps import MetricsReader, ResourcesDep
from nanwatch.monitor.web.routers._problems import AUTH

router = APIRouter(tags=["metrics"])


@router.get("/metrics", response_class=Response,
            responses={200: {"description": "Prometheus text exposition", "content": {"text/plain": {}}},
                       **AUTH})
async def metrics(request: Request, res: ResourcesDep, token: MetricsReader) -> Response:
    if token.runs is not None:
        raise Unauthorized(f"the token {token.name!r} owns the runs {token.runs!r} only and /metrics shows every "
                           "namespace's: scrape with the reader token (NANWATCH_METRICS_TOKEN)", status=403)
    gzipped = gzip_accepted(request.headers.get("accept-encoding", ""))
    body, content_type = await res.metrics.render(request.headers.get("accept", ""), gzipped)
    headers = {"Content-Type": content_type}
    if gzipped:
        headers["Content-Encoding"] = "gzip"
    return Response(body, headers=headers)
