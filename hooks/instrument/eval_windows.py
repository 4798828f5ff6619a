"""Evaluation windows: an evaluation is reported on its own (``stage="eval"``, keyed by the training step it
follows), never folded into a training step's figures or first offender.

A window opens explicitly (``Monitor.evaluating()`` / ``begin_eval``) or implicitly, when a forward in eval
mode starts outside any training step (HF's Trainer evaluates between ``on_step_end`` and the next
``on_step_begin``); an implicit window closes at the next training forward, and any window at the next
training step or ``close``. The Monitor keeps the training step's own bookkeeping and passes what a window
needs of it (the open and last step) as arguments, so that the data flows one way: Monitor -> window ->
recorder -> hand-over. Training thread.
"""

from __future__ import annotations

from collections.abc import Callable

from nanwatch.hooks.measure import compiled
from nanwatch.hooks.measure.recorder import Recorder

__all__ = ["EvalWindows"]


class EvalWindows:
    """Which eval window is open, under which step, and whether it raised.

    ``hand_over(step, raised)``: the recorder's current record to the reporter (the Monitor's);
    ``new_window()``: the probes start a new window (their per-window state).

    Example usage::

        evals = EvalWindows(rec, hand_over=hand_over, new_window=probes.new_window)
        evals.begin(None, open_step=None, last_step=41)   # keyed by step 41
        ...                                                # eval forwards
        evals.end(active=True, in_step=False)              # one stage="eval" report
    """

    def __init__(self, rec: Recorder, *, hand_over: Callable[[int, str | None], None],
                 new_window: Callable[[], None]) -> None:
        self._rec = rec
        self._hand_over = hand_over
        self._new_window = new_window
        self._step: int | None = None  # the open window's step (None: no window)
        self._implicit = False  # the open window was opened by an eval forward outside a step
        self._raised: str | None = None  # the exception type the open window raised

    @property
    def open(self) -> bool:
        return self._step is not None

    def begin(self, step: int | None, *, open_step: int | None, last_step: int | None,
              implicit: bool = False) -> None:
        """Open a window keyed by ``step`` (default: the open training step, else the last one, else 0); the
        caller has closed any window still open."""
        if open_step is None:  # between steps: what ran outside one so far stays for the next step
            self._rec.fold_compiled(compiled.drain())
        self._step = step if step is not None else open_step if open_step is not None else (last_step or 0)
        self._implicit = implicit
        self._raised = None
        self._rec.enter_eval()
        self._new_window()

    def end(self, *, active: bool, in_step: bool) -> None:
        """Close the open window and hand its report over (nothing to hand over when the Monitor is not
        ``active``)."""
        n, self._step = self._step, None
        if n is None or not active:
            return
        if not in_step:  # compiled eval forwards (inside a step they stay the step's)
            self._rec.fold_compiled(compiled.drain())
        raised, self._raised = self._raised, None
        try:
            self._hand_over(n, raised)
        finally:
            self._rec.leave_eval()
            self._new_window()

    def outside_step(self, stage: str, *, open_step: int | None, last_step: int | None) -> None:
        """A model forward of ``stage`` starts outside any training step: an eval forward opens an implicit
        window; a training forward closes one (explicit windows close themselves)."""
        if stage == "eval" and self._step is None:
            self.begin(None, open_step=open_step, last_step=last_step, implicit=True)
        elif stage != "eval" and self._implicit and self._step is not None:
            self.end(active=True, in_step=open_step is not None)

    def mark_raised(self, kind: str) -> bool:
        """The open window raised ``kind`` (the first one kept); False when no window is open."""
        if self._step is None:
            return False
        self._raised = self._raised or kind
        return True
