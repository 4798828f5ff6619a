"""Long-poll waiters, one ``asyncio.Event`` per run that is replaced on every change. Events of runs
nobody waits on are dropped, so polling random run ids cannot grow memory. On shutdown every waiter is
answered at once instead of being cancelled mid-wait. A long-poll whose client leaves ends at once
(``while_connected``): the server does not cancel a request when its client goes, so an abandoned poll would
otherwise hold its request and connection state for its whole wait (issue #19.13: 19,697 closed ``wait=60``
polls held 571 MiB for a minute)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

__all__ = ["LongPoll", "while_connected"]

T = TypeVar("T")
#: an ASGI ``receive`` (typed here without the web stack: the write path imports this module)
Receive = Callable[[], Awaitable[dict[str, Any]]]


async def _disconnected(receive: Receive) -> None:
    """Return once the client has gone (ASGI ``http.disconnect``); a GET's empty body is skipped."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def while_connected(receive: Receive, awaitable: Awaitable[T]) -> T | None:
    """``awaitable``'s result, or ``None`` as soon as the client disconnects (it is then cancelled)."""
    task = asyncio.ensure_future(awaitable)
    gone = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (gone, task):
            if not t.done():
                t.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await t
    return None if task.cancelled() else task.result()


class LongPoll:
    def __init__(self) -> None:
        self._wakers: dict[str, asyncio.Event] = {}
        self._waiting: dict[str, int] = {}
        self._closing = False

    def waiting(self) -> int:
        """How many long-polls are waiting now (all runs)."""
        return sum(self._waiting.values())

    def waiting_on(self, run_id: str) -> bool:
        """Whether a long-poll waits on ``run_id`` now."""
        return self._waiting.get(run_id, 0) > 0

    def notify(self, run_id: str) -> None:
        """Something of ``run_id`` changed: wake its waiters (they re-check their condition)."""
        waker = self._wakers.pop(run_id, None)
        if waker is not None:
            waker.set()

    def close(self) -> None:
        """Server shutdown: answer every long-poll now (uvicorn would cancel them once its graceful
        shutdown timeout runs out)."""
        self._closing = True
        for waker in self._wakers.values():
            waker.set()

    async def wait(self, run_id: str, ready: Callable[[], bool], *, wait_s: float) -> None:
        """Return as soon as ``ready()`` is true (checked now and after each notify), after ``wait_s``
        seconds, or at shutdown."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            remaining = deadline - loop.time()
            if ready() or remaining <= 0 or self._closing:
                return
            waker = self._wakers.get(run_id)
            if waker is None:
                waker = self._wakers[run_id] = asyncio.Event()
            self._waiting[run_id] = self._waiting.get(run_id, 0) + 1
            try:
                await asyncio.wait_for(waker.wait(), remaining)
            except asyncio.TimeoutError:
                pass
            finally:
                left = self._waiting[run_id] - 1
                if left:
                    self._waiting[run_id] = left
                else:
                    del self._waiting[run_id]
                    if self._wakers.get(run_id) is waker and not waker.is_set():
                        del self._wakers[run_id]
