"""nanwatch in the Trainer's own logs: a few ``nanwatch/*`` scalars added to every ``Trainer.log`` call, so
that W&B, TensorBoard, MLflow and the console get them through the integrations users already run.

The scalars are added by wrapping ``log`` on the trainer instance, not in a callback's ``on_log``: the
reporting integrations (TensorBoard's, W&B's) are callbacks that run before a user's, so a value added in
``on_log`` would reach the console but not them. The wrap is undone when the callback closes.

The reporter thread updates the figures (``observer``); the training thread reads them in ``log``. The
figures are one immutable dict, replaced whole, so a read never sees half an update.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

from nanwatch.wire import StepReport

__all__ = ["LogScalars"]


class _Unwrap:
    def __init__(self, trainer: Any) -> None:
        self._trainer = trainer

    def remove(self) -> None:
        self._trainer.__dict__.pop("log", None)


class LogScalars:
    """The figures a training log shows: cumulative non-finite and skipped steps (training stage), and the
    latest step's largest attention-logit bound, largest headroom and directive version. Under a GradScaler
    also its latest ``nanwatch/loss_scale`` and the cumulative ``nanwatch/scaler_overflows``: an overflow the
    scaler handled is counted there, not as a non-finite step."""

    def __init__(self) -> None:
        self._figures: dict[str, float] = {}
        self._nonfinite = self._skipped = self._overflows = 0

    def observer(self, then: Callable[[StepReport], None] | None) -> Callable[[StepReport], None]:
        """An ``on_report`` that keeps the figures, then calls the user's own ``then``."""

        def observe(report: StepReport) -> None:
            self.observe(report)
            if then is not None:
                then(report)

        return observe

    def observe(self, report: StepReport) -> None:
        """Reporter thread: fold one report in (a training step's: an evaluation's report is about the
        evaluation, which HF logs itself)."""
        if report.stage != "train" or report.final:
            return
        self._overflows += bool(report.scaler_overflow)
        self._nonfinite += (report.first_offender is not None and report.first_offender_stage in (None, "train")
                            and not report.scaler_overflow)
        self._skipped += bool(report.step_skipped)
        bounds = [lg.bound for lg in report.logits]
        headroom = [s.headroom for s in report.sites if s.stage == "train" and math.isfinite(s.headroom)]
        figures = {"nanwatch/nonfinite_steps": float(self._nonfinite), "nanwatch/skipped_steps": float(self._skipped),
                   "nanwatch/directive_version": float(report.directive_version)}
        if bounds:
            figures["nanwatch/logit_max"] = max(bounds)
        if headroom:
            figures["nanwatch/headroom_max"] = max(headroom)
        if report.loss_scale is not None:
            figures["nanwatch/loss_scale"] = report.loss_scale
        if report.scaler_overflow is not None:
            figures["nanwatch/scaler_overflows"] = float(self._overflows)
        self._figures = figures

    def wrap_log(self, trainer: Any) -> _Unwrap:
        """Add the figures to every ``trainer.log(logs)``; the returned handle's ``remove()`` undoes it."""
        original = trainer.log

        @functools.wraps(original)
        def log(logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
            if "eval_loss" not in logs:  # an evaluation's log is about the evaluation, not the training steps
                logs = {**logs, **self._figures}
            return original(logs, *args, **kwargs)

        trainer.log = log
        return _Unwrap(trainer)
