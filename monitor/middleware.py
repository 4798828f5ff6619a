"""``IngressGuard``: cheap refusals before a request body is read.

413 when Content-Length is over the limit, and 503 + Retry-After when too many ingest requests are in
flight (load shedding). Bodies without a Content-Length (chunked) are stream-counted and cut off at the
limit, so a huge body is never buffered. (Starlette's own body limit would do the counting, but it
replaces the response to an oversized Content-Length with a plain-text 413 that names no limit and is not
the documented ``Problem`` body.) In-flight requests pile up only when the event loop falls behind, so
that count is the overload signal; senders back off, and replays are idempotent.
"""

from __future__ import annotations

from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from nanwatch.monitor.schemas import Problem, WireJSON

__all__ = ["IngressGuard", "count_rejection"]


def count_rejection(app_state, reason: str) -> None:
    """Count a refused request by reason (``nanwatch_collector_requests_rejected_total``), if the
    collector's resources are open."""
    res = getattr(app_state, "resources", None)
    if res is not None:
        res.state.rejected[reason] += 1


class IngressGuard:
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
        count_rejection(scope["app"].state, reason)
        await response(scope, receive, send)
