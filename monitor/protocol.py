"""uvicorn's httptools protocol with the two limits it lacks: the size of a request head and the time to
send it. Without them one client can buffer a 175 MiB header line on the event loop, or hold a thousand
half-sent connections open forever and lock every trainer out of the descriptor table.

* A request line plus headers over ``max_header_bytes`` gets 431 and the connection is closed; at most one
  read chunk beyond the limit is ever held.
* A connection that began a request (or connected) and has not completed its head ``header_timeout_s``
  later is closed (idle keep-alive connections are uvicorn's own ``timeout_keep_alive``).

Bodies are the app's concern (``nanwatch.monitor.middleware``: a size limit and a deadline).
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

__all__ = ["guarded_protocol"]


def guarded_protocol(*, max_header_bytes: int, header_timeout_s: float) -> type[HttpToolsProtocol]:
    """The protocol class for ``uvicorn.Config(http=...)`` with these limits."""

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._head_bytes = 0
            self._in_head = True
            self._head_timer: asyncio.TimerHandle | None = None
            self._arm()

        def _arm(self) -> None:
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(header_timeout_s, self._head_timeout)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timeout(self) -> None:
            self._head_timer = None
            if self._in_head and not self.transport.is_closing():
                self.logger.debug("nanwatch: closing a connection that sent no complete request head in %.0f s",
                                 header_timeout_s)
                self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._in_head, self._head_bytes = True, 0
            self._arm()

        def on_headers_complete(self) -> None:
            self._in_head = False
            self._disarm()
            super().on_headers_complete()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._in_head and not self.transport.is_closing():  # the head is still incomplete
                self._head_bytes += len(data)
                if self._head_bytes > max_header_bytes:
                    self._refuse_head()

        def _refuse_head(self) -> None:
            msg = (f"request line and headers over {max_header_bytes} bytes (NANWATCH_MAX_HEADER_BYTES)").encode()
            self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: text/plain; "
                                 b"charset=utf-8\r\nconnection: close\r\ncontent-length: "
                                 + str(len(msg)).encode() + b"\r\n\r\n" + msg)
            self._disarm()
            self.transport.close()

    return GuardedHttpToolsProtocol
