"""The bench's own HTTP/1.1 client, on raw asyncio streams: the ranks and the hostile client of ``nanwatch
bench collector`` speak HTTP byte by byte (a keep-alive per rank, headers that never end, trailers, bodies cut
short), which no HTTP library will send, and a library's own cost would be measured with the collector's.

Example usage::

    reader, writer = await asyncio.open_connection("127.0.0.1", 8000)
    status, body, keep = await request(reader, writer, b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
"""

from __future__ import annotations

import asyncio

__all__ = ["REQUEST_TIMEOUT_S", "auth_line", "count", "get_once", "read_body", "request"]

REQUEST_TIMEOUT_S = 30.0
"""A legitimate request unanswered this long counts as status ``timeout``."""


async def read_body(reader: asyncio.StreamReader, length: int, chunked: bool) -> bytes:
    """A response body: ``length`` bytes, or HTTP/1.1 chunks up to the empty one."""
    if not chunked:
        return await reader.readexactly(length) if length else b""
    parts = []
    while size := int((await reader.readline()).split(b";")[0], 16):
        parts.append(await reader.readexactly(size))
        await reader.readexactly(2)  # CRLF after each chunk
    while (await reader.readline()) not in (b"\r\n", b""):  # trailers
        pass
    return b"".join(parts)


async def request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes,
                   body: bytes = b"") -> tuple[int, bytes, bool]:
    """One request on an open connection: (status, body, whether the server keeps the connection).
    A connection the server closed before answering raises ``ConnectionResetError``."""
    writer.write(head + body)
    status_line = await reader.readline()
    if not status_line:
        raise ConnectionResetError("the server closed the connection before answering")
    length, chunked, keep = 0, False, True
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.partition(b":")
        name, value = name.strip().lower(), value.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding":
            chunked = b"chunked" in value
        elif name == b"connection":
            keep = value != b"close"
    return int(status_line.split()[1]), await read_body(reader, length, chunked), keep


def auth_line(token: str | None) -> str:
    """The Authorization header line for ``token`` (empty without one)."""
    return f"Authorization: Bearer {token}\r\n" if token else ""


def count(counter: dict, key: int | str) -> None:
    counter[key] = counter.get(key, 0) + 1


async def get_once(host: str, port: int, head: bytes) -> tuple[int | str, bytes]:
    """One request (a ``GET /metrics``, ``/v1/runs``) on a fresh connection: (status or ``timeout``/``conn-error``, body)."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), REQUEST_TIMEOUT_S)
        try:
            status, body, _ = await asyncio.wait_for(request(reader, writer, head), REQUEST_TIMEOUT_S)
        finally:
            writer.close()
    except asyncio.TimeoutError:
        return "timeout", b""
    except (OSError, EOFError, ValueError, IndexError):
        return "conn-error", b""
    return status, body
