"""``IngressGate``: cheap refusals before a request reaches a route, and the body read under limits.

* 401/403 for a body route (POST /v1/reports, PUT /v1/runs/{run_id}/weights/{version}: an ingest
  token; PUT /v1/directives/{run_id}: an admin token) whose bearer token is missing or not of its role, before a single body byte is read: a client
  without a token holds no buffer, whatever it sends. (The routes check the token again, through
  ``nanwatch.monitor.web.deps``; this check only decides whether the body is worth reading.)
* 413 when Content-Length is over the limit; a body without one (chunked) is counted and cut off at it,
  so a huge body is never buffered. (Starlette's own body limit would do the counting, but it replaces the
  response to an oversized Content-Length with a plain-text 413 that names no limit and is not the
  documented ``Problem`` body.)
* 415 for a POST or PUT whose Content-Type is not ``application/json``: a browser can send ``text/plain``
  across origins without asking (CSRF against the tokenless loopback default), never JSON.
* 408 when the body has not arrived in full ``body_timeout_s`` after the headers.
* 503 + Retry-After when the bodies being received would hold more than ``max_buffered`` bytes in all, or
  more than ``max_buffered_per_token`` bytes sent with one token (load shedding, by bytes rather than by
  requests: a thousand slow senders trickling a byte a second hold a few kilobytes and lock no trainer out,
  a flood of large bodies is refused before it is held, and one credential's flood sheds only itself).

Every refusal before the body is read whole closes the connection (``Connection: close``): the rest of
the body is never read. The request head's own limits (size, time) are the protocol's
(``nanwatch.monitor.web.protocol``).
"""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from nanwatch.monitor.data.auth import Role
from nanwatch.monitor.data.refusal import Refused
from nanwatch.monitor.web.exception_handlers import answer_refusal

__all__ = ["IngressGate"]


def _body_role(method: str, path: str) -> Role | None:
    """The role a route with a JSON body needs (POST /v1/reports, PUT /v1/runs/{run_id}/weights/{version}:
    ingest; PUT /v1/directives/{run_id}: admin), else None."""
    if (method, path) == ("POST", "/v1/reports") or (method == "PUT" and path.startswith("/v1/runs/")
                                                     and "/weights/" in path):
        return "ingest"
    if method == "PUT" and path.startswith("/v1/directives/"):
        return "admin"
    return None


#: who holds body bytes: a credential (role, audit name), or None where the role needs no token (an open
#: role cannot tell its callers apart, so only the global budget applies)
_Holder = tuple[str, str] | None


class _Budget:
    """Bytes held by request bodies being received: in all, and by credential."""

    def __init__(self, total: int, per_holder: int) -> None:
        self.total, self.per_holder = total, per_holder
        self.held = 0
        self.by_holder: dict[tuple[str, str], int] = {}

    def refusal(self, holder: _Holder, n: int) -> str | None:
        """Why ``holder`` may not hold ``n`` more bytes (the setting that says no), else None."""
        if self.held + n > self.total:
            return f"{self.held} bytes of request bodies being received (NANWATCH_MAX_BUFFERED_BYTES)"
        mine = self.by_holder.get(holder, 0) if holder is not None else 0
        if holder is not None and mine + n > self.per_holder:
            return (f"{mine} bytes of request bodies being received with this token "
                    "(NANWATCH_MAX_BUFFERED_BYTES_PER_TOKEN)")
        return None

    def take(self, holder: _Holder, n: int) -> None:
        self.held += n
        if holder is not None:
            self.by_holder[holder] = self.by_holder.get(holder, 0) + n

    def give_back(self, holder: _Holder, n: int) -> None:
        self.held -= n
        if holder is not None and (left := self.by_holder.pop(holder, 0) - n):
            self.by_holder[holder] = left


class _TooLarge(Exception):
    pass


class _Overloaded(Exception):
    """``args[0]``: why (``_Budget.refusal``)."""


class IngressGate:
    """The gate every HTTP request passes before its route (the module's list of refusals)."""

    def __init__(self, app: ASGIApp, *, max_body: int, max_buffered: int, max_buffered_per_token: int,
                 retry_after_s: int, body_timeout_s: float) -> None:
        self.app, self.max_body, self.retry_after = app, max_body, str(retry_after_s)
        self.body_timeout_s = body_timeout_s
        self.budget = _Budget(max_buffered, max_buffered_per_token)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        role = _body_role(scope["method"], scope["path"])
        holder: _Holder = None
        res = getattr(scope["app"].state, "resources", None)
        if role is not None and res is not None and not res.tokens.open(role):  # no resources: the route's 503
            try:
                who = res.tokens.authorize(headers.get(b"authorization", b"").decode("latin-1"), role)
            except Refused as e:
                return await self._refuse(scope, receive, send, e.reason, e.status, str(e.detail),
                                          headers=e.headers)
            holder = (who.role, who.name)
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body:
            return await self._refuse(scope, receive, send, "too_large", 413,
                                      f"request body of {int(length)} bytes is over the {self.max_body}-byte limit "
                                      "(NANWATCH_MAX_BODY_BYTES); send smaller batches")
        if role is None:
            return await self.app(scope, receive, send)  # no body, or no such route: the router answers
        ctype = headers.get(b"content-type", b"").split(b";", 1)[0].strip().lower()
        if ctype != b"application/json":
            return await self._refuse(scope, receive, send, "unsupported_media_type", 415,
                                      f"Content-Type must be application/json, got {ctype.decode('latin-1')!r}")
        held = [0]
        try:
            body = await asyncio.wait_for(self._read_body(receive, holder, held), self.body_timeout_s)
        except asyncio.TimeoutError:
            return await self._refuse(scope, receive, send, "body_timeout", 408,
                                      f"the request body did not arrive within {self.body_timeout_s:g} s "
                                      "(NANWATCH_BODY_TIMEOUT_S)")
        except _TooLarge:
            return await self._refuse(scope, receive, send, "too_large", 413,
                                      f"request body over the {self.max_body}-byte limit (NANWATCH_MAX_BODY_BYTES); "
                                      "send smaller batches")
        except _Overloaded as e:
            return await self._refuse(scope, receive, send, "overloaded", 503, f"overloaded: {e.args[0]}; retry later",
                                      headers={"Retry-After": self.retry_after})
        finally:
            self.budget.give_back(holder, held[0])
        if body is None:
            return None  # the client went away
        return await self.app(scope, self._with_body(body, receive), send)

    async def _read_body(self, receive: Receive, holder: _Holder, held: list[int]) -> bytes | None:
        """The whole body; ``held[0]`` tracks what it holds of the budget (given back by the caller)."""
        chunks = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            if held[0] + len(chunk) > self.max_body:
                raise _TooLarge
            if (why := self.budget.refusal(holder, len(chunk))) is not None:
                raise _Overloaded(why)
            held[0] += len(chunk)
            self.budget.take(holder, len(chunk))
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    @staticmethod
    def _with_body(body: bytes, receive: Receive) -> Receive:
        """A ``receive`` that hands the route the body read here, whole, then the client's own messages."""
        sent = False

        async def with_body() -> Message:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: the disconnect, when it comes

        return with_body

    @staticmethod
    async def _refuse(scope: Scope, receive: Receive, send: Send, reason: str, status: int, detail: str, *,
                      headers: dict[str, str] | None = None) -> None:
        """Answer and close: every refusal here comes before the body was read whole."""
        refusal = Refused(detail, status=status, reason=reason, headers={**(headers or {}), "Connection": "close"})
        await answer_refusal(scope["app"].state, refusal)(scope, receive, send)
