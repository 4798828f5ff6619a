"""Step end without a host sync: one asynchronous device-to-host copy plus an event; a background thread
waits on the event and builds the StepReport.

Host buffers are a small pool (pinned on CUDA) so the copy never blocks the training thread; if the
thread falls behind by more than the pool, that step's report is dropped and counted instead.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from nanwatch.wire import StepReport

__all__ = ["Pending", "Reporter"]

log = logging.getLogger("nanwatch")


@dataclass(slots=True)
class Pending:
    """A finished step waiting for its copy: everything the report needs except the device values."""

    seq: int
    step: int
    host: torch.Tensor | None  # None: a report of no measurements (``Reporter.post``)
    size: int
    event: Any  # torch.cuda.Event | None
    context: Any  # opaque: handed back to ``build``


class Reporter:
    """Owns the host-buffer pool and the thread that turns ``Pending`` steps into ``StepReport``s."""

    def __init__(self, build: Callable[[Pending, list[float]], StepReport], *,
                 on_report: Callable[[StepReport], None] | None = None, max_pending: int = 8,
                 on_close: Callable[[], None] | None = None) -> None:
        self._build = build
        self._on_report = on_report
        self._on_close = on_close  # the thread's last act, after every queued step (job reports: tell peers)
        self._queue: queue.Queue[Pending | None] = queue.Queue()
        self._free: list[torch.Tensor] = []
        self._outstanding = 0
        self._max_pending = max_pending
        self._cond = threading.Condition()
        self._last: StepReport | None = None
        self._seq = 0
        self._submitted = -1
        self._done = -1
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="nanwatch-reporter", daemon=True)
        self._thread.start()

    def capture(self, data: torch.Tensor, step: int, context: Any) -> bool:
        """Step end: enqueue the copy of ``data`` (1-D, the step's measurements) into a free host buffer
        (asynchronous towards pinned memory, plus an event on a CUDA tensor's stream) and hand it to the
        thread, with ``context`` for ``build``. False, and counted as dropped, when the thread is
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

    def close(self, timeout: float = 10.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                if self._on_close is not None:
                    try:
                        self._on_close()
                    except Exception:
                        log.exception("nanwatch: reporter close hook failed")
                return
            report = None
            try:
                if item.event is not None:
                    # Poll rather than synchronize: a sync-debug mode set by the trainer is global and
                    # would flag an event sync even on this thread.
                    while not item.event.query():
                        time.sleep(0.0005)
                values = [] if item.host is None else item.host[: item.size].tolist()  # sync-ok: host tensor
                report = self._build(item, values)
            except Exception:
                log.exception("nanwatch: could not build the report for step %s", item.step)
            finally:
                with self._cond:
                    if item.host is not None:
                        self._free.append(item.host)
                        self._outstanding -= 1
                    if report is not None and not report.final:  # last_report() stays the last step's
                        self._last = report
                    self._done = item.seq
                    self._cond.notify_all()
            if report is not None and self._on_report is not None:
                try:
                    self._on_report(report)
                except Exception:
                    log.exception("nanwatch: on_report callback failed for step %s", item.step)
