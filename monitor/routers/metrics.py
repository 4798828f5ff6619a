"""``GET /metrics``: served by prometheus_client's own ASGI app (content negotiation, gzip), called from a
documented route so that the OpenAPI document lists it and ``/metrics`` needs no trailing slash."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from nanwatch.monitor.deps import ResourcesDep

router = APIRouter(tags=["metrics"])


@router.get("/metrics", response_class=Response,
            responses={200: {"description": "Prometheus text exposition", "content": {"text/plain": {}}}})
async def metrics(request: Request, res: ResourcesDep) -> Response:
    sent: dict = {}

    async def send(message: dict) -> None:
        sent.setdefault(message["type"], message)

    async def receive() -> dict:
        return {"type": "http.request", "body": b"", "more_body": False}

    await request.app.state.metrics_app(request.scope, receive, send)
    start, body = sent["http.response.start"], sent["http.response.body"]
    headers = {k.decode(): v.decode() for k, v in start["headers"]}
    return Response(body["body"], status_code=start["status"], headers=headers)
