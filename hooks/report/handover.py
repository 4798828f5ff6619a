"""The training thread's side of reporting: a finished record (a training step's, or an evaluation's) is
handed to the report flow with what the training thread knew at that moment (the directive in force, the
time, the exception it raised), and at a normal close the incarnation's final report follows the last one.

The Monitor decides *when* (step end, window end, close); this decides *what* goes with the copy, so the
facade stays wiring; :func:`connect` points the flow at the collector, when there is one. Training thread.

Example usage::

    handover = StepHandover(flow, rec=rec, directive_state=state, max_pending=8)
    handover.hand_over(41)             # step 41's record, copied asynchronously
    handover.ended_by = "ValueError"   # the run ended on an exception: no final report
    handover.finish()                  # at close, after every hook is off
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from nanwatch.hooks.config import DirectivesConfig
from nanwatch.hooks.directives.directive_state import DirectiveState
from nanwatch.hooks.failsafe import contained
from nanwatch.hooks.measure.recorder import Recorder, StepState
from nanwatch.hooks.report.step_context import StepContext

__all__ = ["CloseTimeout", "Reports", "StepHandover", "connect"]

log = logging.getLogger("nanwatch")


class Reports(Protocol):
    """What the hand-over asks of the report flow it hands records to (``nanwatch.hooks.report.flow.ReportFlow``,
    built by the Monitor and handed in)."""

    incarnation: str

    def capture(self, data: torch.Tensor, step: int, ctx: StepContext) -> bool: ...

    def final(self, step: int, ctx: StepContext) -> None: ...

    def send_to(self, sender: Any) -> None: ...


@dataclass(slots=True)
class CloseTimeout:
    """The timeout ``Monitor.close()`` was given, for the parts its ExitStack closes with it."""

    seconds: float = 10.0

    def call(self, close: Callable[[float], None]) -> None:
        close(self.seconds)


class StepHandover:
    """Hands one Monitor's records to its :class:`~nanwatch.hooks.report.flow.ReportFlow`."""

    def __init__(self, flow: Reports, *, rec: Recorder, directive_state: DirectiveState,
                 max_pending: int) -> None:
        self._flow = flow
        self._rec = rec
        self._directive_state = directive_state
        self._max_pending = max_pending
        #: the step of the last record handed over (the final report's step)
        self.reported_step: int | None = None
        #: the exception type that ended the run (set by the Monitor; cleared when training goes on after
        #: an exception it caught): no final report then
        self.ended_by: str | None = None

    def hand_over(self, step: int, raised: str | None = None) -> tuple[torch.Tensor, StepState]:
        """The recorder's current record, under ``step`` (``raised``: the exception type the step or window
        raised), to the reporter; no host sync. Dropped, with a warning, when the reporter is too far
        behind: training never waits for reporting. Returns what was handed over: the values on the device
        and the record (a rerun decided a step later decodes them, ``nanwatch.hooks.forensics.rerun``)."""
        self.reported_step = step
        data = self._rec.flat()
        state = self._rec.swap()
        ctx = StepContext(state, self._directive_state.mode, self._directive_state.version, time.time(),
                          raised=raised)
        if not self._flow.capture(data, step, ctx):
            log.warning("nanwatch: reporter is %d steps behind; dropped the report for step %d",
                        self._max_pending, step)
        return data, state

    def finish(self) -> None:
        """At close, once every hook is off: the directive state closes, and a run that did not end on an
        exception sends its final report (``final=True``), saying the mode and version the run ended in
        (read before the state closes: closing resets the mode)."""
        final = StepContext(StepState(), self._directive_state.mode, self._directive_state.version,
                            time.time(), final=True)
        self._directive_state.close()
        if self.ended_by is None:
            contained(self._flow.final, self.reported_step or 0, final)


def connect(directives: DirectivesConfig, *, run_id: str, collector: str | None, token: str | None,
            log_dir: str | None, rank: int, flow: Reports, directive_state: DirectiveState) -> None:
    """With a collector: every report goes to it too (a ``ReportSender``, closed with the flow, which keeps
    what it could not deliver in the undelivered folder: ``nanwatch.hooks.report.spool``), and rank 0
    polls it for directives (a ``DirectivePoller``, closed with the directive state; the other ranks follow
    rank 0 by agreement). The transport is imported here: a Monitor without a collector never loads it.
    ``collector``, ``token``: the resolved config's (one shard); ``log_dir``: its ``log.dir``."""
    if not collector:
        return
    from nanwatch.hooks.report.spool import Spool, undelivered_root
    from nanwatch.hooks.report.transport import DirectivePoller, ReportSender

    spool = Spool(undelivered_root(log_dir), run_id=run_id, rank=rank, incarnation=flow.incarnation)
    flow.send_to(ReportSender(collector, token=token, spool=spool))
    if directives.source in ("auto", "collector") and rank == 0:
        directive_state.follow(DirectivePoller(collector, run_id, token=token))
