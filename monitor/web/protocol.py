"""uvicorn's httptools protocol with the limits it lacks: the size of a request head and of its chunked
trailers, the time to send a head, and the time a connection may stay open after its answer. Without
them one client can buffer a 175 MiB header line (or a gigabyte of trailers) on the event loop, or hold a
thousand connections open forever and lock every trainer out of the descriptor table.

* A request line plus headers over ``max_header_bytes`` gets 431 and the connection is closed; at most one
  read chunk beyond the limit is ever held.
* Chunked trailers are never kept (uvicorn appended them to the request's headers, after the head limit
  had stopped counting, and ASGI has no use for them). Reads after the head that carry no body byte and
  begin no request (trailers, chunk framing) are counted against ``max_header_bytes`` too, since httptools
  accumulates an unfinished trailer line itself; beyond it the connection is closed.
* A connection that began a request (or connected) and has not completed its head ``header_timeout_s``
  later is closed.
* After an answer the connection is closed ``timeout_keep_alive`` later unless a new request has begun,
  whatever else the client sends. uvicorn cancels its own keep-alive timer on any byte and re-arms it only
  after the next answer, so a client that keeps sending the unread body of an answered request (a 401, a
  404, a GET with a Content-Length) held its connection for ever.

Bodies are the app's concern (``nanwatch.monitor.web.middleware``: authorisation first, a size limit, a
deadline and a byte budget per credential).
"""

from __future__ import annotations

import asyncio
from typing import Literal

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["BoundedHttpToolsProtocol", "bounded_protocol"]

_Deadline = Literal["head", "idle"]


def bounded_protocol(*, max_header_bytes: int, header_timeout_s: float) -> type[BoundedHttpToolsProtocol]:
    """The protocol class for ``uvicorn.Config(http=...)`` with these limits (the keep-alive is the
    config's ``timeout_keep_alive``): uvicorn builds the protocol itself, so the limits ride on the class."""
    return type("BoundedHttpToolsProtocol", (BoundedHttpToolsProtocol,),
                {"max_header_bytes": max_header_bytes, "header_timeout_s": header_timeout_s})


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """httptools with bounded heads, trailers and idle connections (the module's list); the limits are class
    attributes, set by ``bounded_protocol``."""

    max_header_bytes = 64 * 1024
    """Bytes a request line plus headers may take (and trailers or framing after a head)."""
    header_timeout_s = 10.0
    """Seconds a connection may take to send a complete request head."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_bytes = 0  # bytes read while the head is incomplete
        self._tail_bytes = 0  # bytes read after the head that carried no body byte
        self._in_head = True
        self._fed_body = self._began = False  # in the read being parsed: a body byte, a new request
        self._timer: asyncio.TimerHandle | None = None
        self._timer_kind: _Deadline | None = None
        self._arm("head")

    # -- one deadline per connection: to complete a head, or to begin a request after an answer --

    def _arm(self, kind: _Deadline) -> None:
        """Close the connection when ``kind``'s time is up; an armed deadline of the same kind is
        kept (a head's time counts from its connection or its first byte, not its latest)."""
        if self._timer is not None and self._timer_kind == kind:
            return
        self._disarm()
        seconds = self.header_timeout_s if kind == "head" else self.timeout_keep_alive
        self._timer, self._timer_kind = self.loop.call_later(seconds, self._expire, kind), kind

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = self._timer_kind = None

    def _expire(self, kind: _Deadline) -> None:
        self._timer = self._timer_kind = None
        if not self.transport.is_closing():
            if kind == "head":
                why = f"sent no complete request head in {self.header_timeout_s:g} s"
            else:
                why = f"began no request in {self.timeout_keep_alive:g} s after its answer"
            self.logger.debug("nanwatch: closing a connection that %s", why)
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    # -- parser callbacks --

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._began, self._head_bytes, self._tail_bytes = True, True, 0, 0
        self._arm("head")

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._in_head:  # after the head, a header is a chunked trailer: not kept
            super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._disarm()
        super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        self._fed_body, self._tail_bytes = True, 0
        super().on_body(body)

    def on_response_complete(self) -> None:
        idle = not self.pipeline  # no request of this connection waits for its turn
        super().on_response_complete()
        if idle and not self._in_head and not self.transport.is_closing():
            self._arm("idle")

    def data_received(self, data: bytes) -> None:
        after_head, self._fed_body, self._began = not self._in_head, False, False
        super().data_received(data)
        if self.transport.is_closing():
            return
        if self._in_head:  # the head is still incomplete
            self._head_bytes += len(data)
            if self._head_bytes > self.max_header_bytes:
                self._refuse_head()
        elif after_head and not self._fed_body and not self._began:  # trailers or framing, nothing else
            self._tail_bytes += len(data)
            if self._tail_bytes > self.max_header_bytes:
                self.logger.warning("nanwatch: closing a connection that sent over %d bytes of chunked "
                                    "trailers or framing (NANWATCH_MAX_HEADER_BYTES)", self.max_header_bytes)
                self._disarm()
                self.transport.close()

    def _refuse_head(self) -> None:
        msg = (f"request line and headers over {self.max_header_bytes} bytes (NANWATCH_MAX_HEADER_BYTES)").encode()
        self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain; "
                             b"charset=utf-8\r\nconnection: close\r\ncontent-length: "
                             + str(len(msg)).encode() + b"\r\n\r\n" + msg)
        self._disarm()
        self.transport.close()
