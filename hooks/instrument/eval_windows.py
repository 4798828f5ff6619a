"""Evaluation windows: an evaluation is reported on its own (``stage="eval"``, keyed by the training step it
follows), never folded into a training step's figures or first offender.

A window opens explicitly (``Monitor.evaluating()`` / ``begin_eval``) or implicitly, when a forward in eval
mode starts outside any training step (HF's Trainer evaluates between ``on_step_end`` and the next
``on_step_begin``); an implicit window closes at the next training forward, and any window at the next
training step or ``close``. The Monitor says which training step is open (:meth:`EvalWindows.training`), and
the windows key themselves by it; the data flows one way: Monitor -> window -> recorder -> hand-over.
Training thread.

A window has a record of its own: while it is open the recorder writes into the evaluation's record and
buffers (``Recorder.write_into``), the training step's (open or not) put aside untouched, so an evaluation run
inside or between training steps never reaches the training step's first offender or the weight guard's flag.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TypeVar

from nanwatch.hooks.failsafe import contained
from nanwatch.hooks.measure import compiled
from nanwatch.hooks.measure.recorder import Recorder, Records
from nanwatch.wire import MAX_INT

__all__ = ["EvalWindows", "check_step", "window"]

_T = TypeVar("_T")


def check_step(n: object) -> None:
    """A step number a report can be keyed by (the wire's bound), else a ValueError that says so."""
    if not isinstance(n, int) or not 0 <= n <= MAX_INT:
        raise ValueError(f"nanwatch: step numbers are integers from 0 to {MAX_INT}, got {n!r}")


@contextlib.contextmanager
def window(owner: _T, *, end: Callable[[], None],
           mark_raised: Callable[[type[BaseException]], None]) -> Iterator[_T]:
    """The body of ``Monitor.step()`` and ``Monitor.evaluating()``: an exception is the window's
    (``mark_raised``), and ``end`` reports the window whatever happened (a failure of its own only warns)."""
    try:
        yield owner
    except BaseException as exc:
        if not isinstance(exc, GeneratorExit):
            mark_raised(type(exc))
        raise
    finally:
        contained(end)


class EvalWindows:
    """Which eval window is open, under which step, and whether it raised.

    ``hand_over(step, raised)``: the recorder's current record to the reporter
    (``nanwatch.hooks.report.handover.StepHandover.hand_over``); ``new_window()``: the probes start a new
    window (their per-window state).

    Example usage::

        evals = EvalWindows(rec, hand_over=handover.hand_over, new_window=probes.new_window)
        evals.training(41)
        evals.training(None)            # step 41 ended
        evals.begin(None)               # keyed by step 41
        ...                             # eval forwards
        evals.end(active=True)          # one stage="eval" report
    """

    def __init__(self, rec: Recorder, *, hand_over: Callable[[int, str | None], None],
                 new_window: Callable[[], None], warn: Callable[[str], None] | None = None) -> None:
        """``warn``: told (once, it is a ``WarnOnce``) when training forwards run before any step was opened."""
        self._rec = rec
        self._warn = warn
        self._hand_over = hand_over
        self._new_window = new_window
        self._step: int | None = None  # the open window's step (None: no window)
        self._implicit = False  # the open window was opened by an eval forward outside a step
        self._raised: str | None = None  # the exception type the open window raised
        #: the training step open now (None: between steps), as the Monitor said (:meth:`training`)
        self.open_step: int | None = None
        #: the last training step opened: what an evaluation between steps follows
        self.last_step: int | None = None
        self._eval: Records | None = None  # the evaluation's own record and buffers, kept between windows
        self._aside: Records | None = None  # while a window is open: the training record it put aside

    @property
    def open(self) -> bool:
        return self._step is not None

    def training(self, step: int | None) -> None:
        """The Monitor opened training step ``step`` (None: closed the open one)."""
        self.open_step = step
        if step is not None:
            self.last_step = step

    def begin(self, step: int | None, *, implicit: bool = False) -> None:
        """Open a window keyed by ``step`` (default: the open training step, else the last one, else 0); the
        caller has closed any window still open."""
        open_step, last_step = self.open_step, self.last_step
        if open_step is None:  # between steps: what ran outside one so far stays for the next step
            self._rec.fold_compiled(compiled.drain())
        self._step = step if step is not None else open_step if open_step is not None else (last_step or 0)
        self._implicit = implicit
        self._raised = None
        self._enter()
        self._new_window()

    def end(self, *, active: bool) -> None:
        """Close the open window and hand its report over (nothing to hand over when the Monitor is not
        ``active``)."""
        n, self._step = self._step, None
        if n is None or not active:
            return
        if self.open_step is None:  # compiled eval forwards (inside a step they stay the step's)
            self._rec.fold_compiled(compiled.drain())
        raised, self._raised = self._raised, None
        try:
            self._hand_over(n, raised)
        finally:
            self._leave()
            self._new_window()

    def _enter(self) -> None:
        """The recorder writes into the evaluation's record from now on (made at the first window, reused)."""
        if self._aside is not None:
            return
        if self._eval is None:
            self._eval = Records.fresh(self._rec.buf.device)
        self._eval.last = None
        self._aside = self._rec.write_into(self._eval)
        self._rec.state.stage = "eval"

    def _leave(self) -> None:
        """Back to the training record put aside by :meth:`_enter` (the window's record was handed over first)."""
        if self._aside is None:
            return
        self._eval = self._rec.write_into(self._aside)
        self._aside = None

    def outside_step(self, stage: str) -> None:
        """A model forward of ``stage`` starts outside any training step (``Probes.outside_step``, while the
        probes are on): an eval forward opens an implicit window; a training forward closes one (explicit
        windows close themselves)."""
        if stage == "eval" and self._step is None:
            self.begin(None, implicit=True)
        elif stage != "eval" and self._implicit and self._step is not None:
            self.end(active=True)
        if stage == "train" and self.last_step is None and self._warn is not None:
            self._warn("a training forward ran outside `with mon.step(n):` and no step has been opened yet: "
                       "no report is sent until one is (what ran is charged to the first step). Wrap each training "
                       "step in `with mon.step(n):`, or use an integration's callback")

    def mark_raised(self, kind: str) -> bool:
        """The open window raised ``kind`` (the first one kept); False when no window is open."""
        if self._step is None:
            return False
        self._raised = self._raised or kind
        return True
