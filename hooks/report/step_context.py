"""The message of the hand-over between the two threads of reporting: what the training thread knew when a
record ended (the directive in force, the time, the exception it raised), sent with the record's copy.

``nanwatch.hooks.report.handover`` makes it (training thread), ``nanwatch.hooks.report.flow`` carries it
through the reporter (opaque there) and ``nanwatch.hooks.report.build`` reads it into the report (reporter
thread): the three share this type, and none of them owns the others.

Example usage::

    ctx = StepContext(rec.swap(), state.mode, state.version, time.time())
    flow.capture(rec.flat(), step, ctx)
"""

from __future__ import annotations

from dataclasses import dataclass

from nanwatch.hooks.measure.recorder import StepState

__all__ = ["StepContext"]


@dataclass(frozen=True, slots=True)
class StepContext:
    """What the training thread knew at step end, handed to the reporter thread with the copy."""

    state: StepState
    mode: str
    directive_version: int
    time: float
    #: the exception type the step raised (it never finished), or None
    raised: str | None = None
    #: the Monitor closed normally: the incarnation's last report, of no measurements (``state`` is empty)
    final: bool = False
