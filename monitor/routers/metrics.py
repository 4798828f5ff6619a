"""``GET /metrics``: rendered by prometheus_client's own exposition (``choose_encoder`` picks the text or
OpenMetrics format from ``Accept``, gzip when the scraper accepts it), from a documented route so that
the OpenAPI document lists it and ``/metrics`` needs no trailing slash."""

from __future__ import annotations

import gzip

from fastapi import APIRouter, Request
from prometheus_client.exposition import choose_encoder, gzip_accepted
from starlette.responses import Response

from nanwatch.monitor.deps import ResourcesDep

router = APIRouter(tags=["metrics"])


@router.get("/metrics", response_class=Response,
            responses={200: {"description": "Prometheus text exposition", "content": {"text/plain": {}}}})
async def metrics(request: Request, res: ResourcesDep) -> Response:
    encoder, content_type = choose_encoder(request.headers.get("accept", ""))
    body = encoder(res.registry)
    headers = {"Content-Type": content_type}
    if gzip_accepted(request.headers.get("accept-encoding", "")):
        body = gzip.compress(body)
        headers["Content-Encoding"] = "gzip"
    return Response(body, headers=headers)
