"""Step end without a host sync: one asynchronous device-to-host copy plus an event, handed to the reporter
thread, which takes each step once its copy has landed (:meth:`Reporter.take`) and gives the finished report
back (:meth:`Reporter.finish`).

Host buffers are a small pool (pinned on CUDA) so the copy never blocks the training thread; if the
thread falls behind by more than the pool, that step's report is dropped and counted instead.

Why the reporter calls nothing: it is the hand-over between two threads, not a stage of the pipeline. The
thread that consumes it (``nanwatch.hooks.report.flow``) drives it: it takes a ``Landed`` step, turns it into
values (the decoded stats, the report, what the directive state and the sinks get) and hands the report back
for ``last_report()``. Data flows one way, and every call shows in an import.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from nanwatch.wire import StepReport

__all__ = ["Landed", "Pending", "Reporter"]

log = logging.getLogger("nanwatch")

#: How long the thread waits after a step is handed over before it reads and decodes it (unless it is
#: behind). At a step's end the training thread runs Python (the hand-over, ``zero_grad``, the next step's
#: start and first hooks) and the decode is Python too: started at once, it holds the GIL while the training
#: thread waits for it. Measured (bench model, bf16, 2 threads, 2-core EPYC VM): ``Monitor.end_step`` took
#: 1.17 ms a step started at once, 0.51 ms with a 3 ms wait, the decode itself ~0.7 ms of this thread's CPU.
#: At most a quarter of the time between hand-overs, so that steps shorter than the wait never pile up.
SETTLE_S = 0.002


@dataclass(slots=True)
class Pending:
    """A finished step waiting for its copy: everything the report needs except the device values."""

    seq: int
    step: int
    host: torch.Tensor | None  # None: a report of no measurements (``Reporter.post``)
    size: int
    event: Any  # torch.cuda.Event | None
    context: Any  # opaque to the reporter: handed back with the values (``Landed``)


@dataclass(frozen=True, slots=True)
class Landed:
    """A step whose copy has landed: its ``Pending`` record and the host values (empty for a report of no
    measurements)."""

    pending: Pending
    values: list[float]


class Reporter:
    """Owns the host-buffer pool and the queue between the training thread (``capture``, ``post``) and the
    reporter thread (``take``, ``finish``)."""

    def __init__(self, *, max_pending: int = 8) -> None:
        self._queue: queue.Queue[Pending | None] = queue.Queue()
        self._free: list[torch.Tensor] = []
        self._outstanding = 0
        self._max_pending = max_pending
        self._cond = threading.Condition()
        self._last: StepReport | None = None
        self._seq = 0
        self._submitted = -1
        self._done = -1
        self._last_capture = time.monotonic()
        self._period = 0.0  # seconds between the last two hand-overs (the step's length, near enough)
        self.dropped = 0

    def capture(self, data: torch.Tensor, step: int, context: Any) -> bool:
        """Step end: enqueue the copy of ``data`` (1-D, the step's measurements) into a free host buffer
        (asynchronous towards pinned memory, plus an event on a CUDA tensor's stream) and hand it to the
        thread, with ``context`` for the report. False, and counted as dropped, when the thread is
        ``max_pending`` steps behind: training never waits for reporting."""
        n = data.numel()
        host = self._host_buffer(n, data.dtype, data.device)
        if host is None:
            return False
        host[:n].copy_(data, non_blocking=host.is_pinned())
        event = None
        if data.device.type == "cuda":
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(data.device))
        pending = Pending(self._seq, step, host, n, event, context)
        now = time.monotonic()
        self._period, self._last_capture = now - self._last_capture, now
        self._seq += 1
        with self._cond:
            self._submitted = pending.seq
        self._queue.put(pending)
        return True

    def post(self, step: int, context: Any) -> None:
        """Hand the thread a report of no device values (the final report): never dropped, no copy."""
        pending = Pending(self._seq, step, None, 0, None, context)
        self._seq += 1
        with self._cond:
            self._submitted = pending.seq
        self._queue.put(pending)

    def _host_buffer(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """A free host buffer of at least ``numel`` values, or None when the pool is exhausted."""
        with self._cond:
            while self._free:
                buf = self._free.pop()
                if buf.numel() >= numel:
                    self._outstanding += 1
                    return buf
            if self._outstanding >= self._max_pending:
                self.dropped += 1
                return None
            self._outstanding += 1
        return torch.empty(numel, dtype=dtype, pin_memory=device.type == "cuda")

    def last_report(self, timeout: float | None = 10.0) -> StepReport | None:
        """The newest finished report, after waiting for every step already submitted."""
        with self._cond:
            self._cond.wait_for(lambda: self._done >= self._submitted, timeout=timeout)
            return self._last

    def close(self) -> None:
        """Training thread: no more steps; :meth:`take` returns None after the last queued one."""
        self._queue.put(None)

    # ---- reporter thread ---------------------------------------------------------------------------
    def take(self) -> Landed | None:
        """The next step, once its copy has landed; None once closed. Give it back with :meth:`finish`. A
        copy that cannot be read is logged and finished here (no report), and the next step is taken."""
        while (item := self._queue.get()) is not None:
            if self._queue.empty():  # not behind: let the training thread get past its step boundary first
                time.sleep(min(SETTLE_S, self._period / 4))
            try:
                if item.event is not None:
                    # Poll rather than synchronize: a sync-debug mode set by the trainer is global and would
                    # flag an event sync even on this thread.
                    while not item.event.query():
                        time.sleep(0.0005)
                values = [] if item.host is None else item.host[: item.size].tolist()  # sync-ok: host tensor
            except Exception:
                log.exception("nanwatch: could not read the copy of step %s", item.step)
                self.finish(item, None)
                continue
            return Landed(item, values)
        return None

    def finish(self, item: Pending, report: StepReport | None) -> None:
        """``item`` is done: its host buffer goes back to the pool, ``report`` (None: it failed) becomes
        ``last_report()`` unless it is the final report, and ``last_report()`` waiters wake."""
        with self._cond:
            if item.host is not None:
                self._free.append(item.host)
                self._outstanding -= 1
            if report is not None and not report.final:  # last_report() stays the last step's
                self._last = report
            self._done = item.seq
            self._cond.notify_all()
