"""``IngressGuard``: cheap refusals before a request reaches a route, and the body read under limits.

* 413 when Content-Length is over the limit; a body without one (chunked) is counted and cut off at it,
  so a huge body is never buffered. (Starlette's own body limit would do the counting, but it replaces the
  response to an oversized Content-Length with a plain-text 413 that names no limit and is not the
  documented ``Problem`` body.)
* 415 for a POST or PUT whose Content-Type is not ``application/json``: a browser can send ``text/plain``
  across origins without asking (CSRF against the tokenless loopback default), never JSON.
* 408 when the body has not arrived in full ``body_timeout_s`` after the headers.
* 503 + Retry-After when the bodies being received would hold more than ``max_buffered`` bytes in all
  (load shedding, by bytes rather than by requests: a thousand slow senders trickling a byte a second hold
  a few kilobytes and lock no trainer out, while a flood of large bodies is refused before it is held).

The request head's own limits (size, time) are the protocol's (``nanwatch.monitor.protocol``).
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from nanwatch.monitor.exception_handlers import answer_refusal
from nanwatch.monitor.refusal import Refused

__all__ = ["IngressGuard"]


def _takes_body(method: str, path: str) -> bool:
    """The routes with a JSON body: POST /v1/reports and PUT /v1/directives/{run_id}."""
    return (method, path) == ("POST", "/v1/reports") or (method == "PUT" and path.startswith("/v1/directives/"))


class _TooLarge(Exception):
    pass


class _Overloaded(Exception):
    pass


class IngressGuard:
    def __init__(self, app: ASGIApp, *, max_body: int, max_buffered: int, retry_after_s: int,
                 body_timeout_s: float) -> None:
        self.app, self.max_body, self.max_buffered, self.retry_after = app, max_body, max_buffered, str(retry_after_s)
        self.body_timeout_s = body_timeout_s
        self.buffered = 0  # bytes held by bodies being received now

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            return await self._refuse(scope, receive, send, "too_large", 413,
                                      f"request body of {int(length)} bytes is over the {self.max_body}-byte limit "
                                      "(NANWATCH_MAX_BODY_BYTES); send smaller batches")
        if not _takes_body(scope["method"], scope["path"]):
            return await self.app(scope, receive, send)  # no body, or no such route: the router answers
        ctype = headers.get(b"content-type", b"").split(b";", 1)[0].strip().lower()
        if ctype != b"application/json":
            return await self._refuse(scope, receive, send, "unsupported_media_type", 415,
                                      f"Content-Type must be application/json, got {ctype.decode('latin-1')!r}")
        held = [0]
        try:
            body = await asyncio.wait_for(self._read_body(receive, held), self.body_timeout_s)
        except asyncio.TimeoutError:
            return await self._refuse(scope, receive, send, "body_timeout", 408,
                                      f"the request body did not arrive within {self.body_timeout_s:g} s "
                                      "(NANWATCH_BODY_TIMEOUT_S)", close=True)
        except _TooLarge:
            return await self._refuse(scope, receive, send, "too_large", 413,
                                      f"request body over the {self.max_body}-byte limit (NANWATCH_MAX_BODY_BYTES); "
                                      "send smaller batches", close=True)
        except _Overloaded:
            return await self._refuse(scope, receive, send, "overloaded", 503,
                                      f"overloaded: {self.buffered} bytes of request bodies being received "
                                      "(NANWATCH_MAX_BUFFERED_BYTES); retry later", close=True,
                                      retry_after=self.retry_after)
        finally:
            self.buffered -= held[0]
        if body is None:
            return None  # the client went away
        return await self.app(scope, self._replay(body, receive), send)

    async def _read_body(self, receive: Receive, held: list[int]) -> bytes | None:
        """The whole body; ``held[0]`` tracks what it holds of ``self.buffered`` (released by the caller)."""
        chunks = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            if held[0] + len(chunk) > self.max_body:
                raise _TooLarge
            if self.buffered + len(chunk) > self.max_buffered:
                raise _Overloaded
            held[0] += len(chunk)
            self.buffered += len(chunk)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    @staticmethod
    def _replay(body: bytes, receive: Receive) -> Receive:
        sent = False

        async def replay() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        return replay

    @staticmethod
    async def _refuse(scope: Scope, receive: Receive, send: Send, reason: str, status: int, detail: str, *,
                      close: bool = False, retry_after: str | None = None) -> None:
        headers = {"Connection": "close"} if close else {}  # the rest of the body is not read
        if retry_after is not None:
            headers["Retry-After"] = retry_after
        refusal = Refused(detail, status=status, reason=reason, headers=headers)
        await answer_refusal(scope["app"].state, refusal)(scope, receive, send)
