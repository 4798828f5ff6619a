"""nanwatch in a trainer's own logs: a few ``nanwatch/*`` scalars in every training log row, so that W&B,
TensorBoard, MLflow, CSV and the console get them through the integrations users already run (HF's
``Trainer.log``, Lightning's ``LightningModule.log``).

For HF the scalars are added by wrapping ``log`` on the trainer instance, not in a callback's ``on_log``: the
reporting integrations (TensorBoard's, W&B's) are callbacks that run before a user's, so a value added in
``on_log`` would reach the console but not them. The wrap is undone when the callback closes.

**A row describes its own steps.** A row written after step ``n`` ends carries the figures of steps up to
and including ``n``: the NaN step's own row counts it, and the first row has them. A step's report is built
asynchronously (the reporter thread decodes the step's one device copy), so at log time the training
thread waits for it: :meth:`LogScalars.figures` waits until every step handed over is built
(``Monitor.last_report(timeout)``) and folded here (``observe``). The wait is bounded by ``wait_s``
(:data:`LOG_WAIT_S`, 2 s by default) and only paid on a step that writes a row (every ``logging_steps`` /
``log_every_n_steps``). Both trainers have already read the loss on the host for that row, so the step's
device work is done and the report is normally milliseconds away (the reporter's decode and build); the
bound matters only when the reporter is behind (a slow ``on_report``, a job-level reduction waiting on a slow
peer): then the row carries the figures folded so far and one warning says the rows may trail their step.
Training never waits longer than the bound, and never on a step that writes no row.

The reporter thread folds the reports (``observer``); the training thread reads the figures at log time.
The figures are one immutable dict, replaced whole under a condition, so a read never sees half an update.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any

from nanwatch.hooks.report.job import report_scope
from nanwatch.wire import StepReport

__all__ = ["LOG_WAIT_S", "ROLLOUT_SCALARS", "LogScalars"]

log = logging.getLogger("nanwatch")

#: How long a log row waits, at most, for the report of the last step it covers (seconds).
LOG_WAIT_S = 2.0
#: ``nanwatch/rollout_<name>`` -> the ``RolloutStat`` field it shows (the latest step's; absent when None)
ROLLOUT_SCALARS = {"abs_mean": "abs_mean", "abs_max": "abs_max", "abs_p99": "abs_p99", "k3": "k3_mean",
                   "truncated_fraction": "truncated_fraction", "prob_correlation": "prob_correlation",
                   "logprob_slope": "logprob_slope"}


class _Unwrap:
    def __init__(self, trainer: Any) -> None:
        self._trainer = trainer

    def remove(self) -> None:
        self._trainer.__dict__.pop("log", None)


class LogScalars:
    """The figures a training log shows: cumulative non-finite and skipped steps (training stage), and the
    latest step's largest attention-logit bound, largest headroom and directive version. Under a GradScaler
    also its latest ``nanwatch/loss_scale`` and the cumulative ``nanwatch/scaler_overflows``: an overflow the
    scaler handled is counted there, not as a non-finite step.

    With ``Monitor.rlhf(rollout_logprobs=...)`` (TRL's vLLM mode feeds it), the latest step's rollout
    mismatch (:data:`ROLLOUT_SCALARS`: ``nanwatch/rollout_abs_mean``, ``_abs_max``, ``_abs_p99``, ``_k3``,
    ``_truncated_fraction``, ``_prob_correlation``, ``_logprob_slope``) and the cumulative count of non-finite
    rollout logprobs in the mask, ``nanwatch/rollout_nonfinite`` (counted, never hidden).

    The integration says which Monitor runs (:meth:`follow`) and which training step ended last
    (``ended``); :meth:`figures` is what a row carries."""

    def __init__(self, wait_s: float = LOG_WAIT_S) -> None:
        self.wait_s = wait_s
        self.monitor: Any = None  # the Monitor whose reports are folded (:meth:`follow`)
        self._every_step = False  # every training step reaches this process's on_report
        self.ended: int | None = None  # the last training step ended (training thread)
        self._figures: dict[str, float] = {}
        self._nonfinite = self._skipped = self._overflows = 0
        self._rollout_nonfinite: int | None = None  # in-mask non-finite rollout logprobs, once any were fed
        self._through = -1  # the last training step folded
        self._cond = threading.Condition()
        self._warned = False

    def observer(self, then: Callable[[StepReport], None] | None) -> Callable[[StepReport], None]:
        """An ``on_report`` that keeps the figures, then calls the user's own ``then``."""

        def observe(report: StepReport) -> None:
            self.observe(report)
            if then is not None:
                then(report)

        return observe

    def observe(self, report: StepReport) -> None:
        """Reporter thread: fold one report in (a training step's: an evaluation's report is about the
        evaluation, which the trainer logs itself). A job's ``detail`` repeats a rank's part of the job report
        and a ``heartbeat`` holds no measurement: they count nothing, but say the step was reported."""
        if report.stage != "train" or report.final:
            return
        with self._cond:
            if report.scope not in ("detail", "heartbeat"):
                self._figures = self._fold(report)
            self._through = max(self._through, report.step)
            self._cond.notify_all()

    def _fold(self, report: StepReport) -> dict[str, float]:
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
        figures.update(self._rollout(report))
        return figures

    def _rollout(self, report: StepReport) -> dict[str, float]:
        """The rollout mismatch's scalars: the step's figures, and the cumulative in-mask non-finite count."""
        rlhf, out = report.rlhf, {}
        if rlhf is not None and ("rollout_logprobs" in rlhf.nonfinite or rlhf.rollout is not None):
            self._rollout_nonfinite = (self._rollout_nonfinite or 0) + rlhf.nonfinite.get("rollout_logprobs", 0)
            for name, field in ROLLOUT_SCALARS.items() if rlhf.rollout is not None else ():
                value = getattr(rlhf.rollout, field)
                if value is not None and math.isfinite(value):
                    out[f"nanwatch/rollout_{name}"] = float(value)
        if self._rollout_nonfinite is not None:
            out["nanwatch/rollout_nonfinite"] = float(self._rollout_nonfinite)
        return out

    def follow(self, monitor: Any) -> None:
        """Training thread: ``monitor``'s reports are the ones folded, from its attach on. Every training step
        reaches this process's ``on_report`` with per-rank reports, or on rank 0 of a job (the other ranks of
        a job post only what differs, and heartbeats): only then does a row wait for its step."""
        self.monitor, self.ended = monitor, None
        try:
            self._every_step = monitor.rank == 0 or report_scope(monitor.config.reports.scope,
                                                                 monitor.world_size) == "rank"
        except Exception:  # noqa: BLE001 - then rows carry what is folded, without waiting
            self._every_step = False

    def figures(self) -> dict[str, float]:
        """Training thread, at log time: the figures through the last step ended, once its report is folded
        (waiting at most ``wait_s``; see the module's docstring)."""
        step, mon = self.ended, self.monitor
        if step is None or mon is None:
            return self._figures
        deadline = time.monotonic() + self.wait_s
        try:
            mon.last_report(timeout=self.wait_s)  # every step handed over is built (its on_report follows)
            if not self._every_step:
                return self._figures
            with self._cond:
                done = self._cond.wait_for(lambda: self._through >= step,
                                           timeout=max(0.0, deadline - time.monotonic()))
        except Exception as exc:  # noqa: BLE001 - a log row never fails for nanwatch
            log.debug("nanwatch: could not wait for step %s's report: %r", step, exc)
            return self._figures
        if not done and not self._warned:
            self._warned = True
            log.warning("nanwatch: step %s's report was not ready within %.1f s of its log row; the row carries "
                        "the figures of the steps reported so far (rows may trail their step while the reporter "
                        "is behind)", step, self.wait_s)
        return self._figures

    def wrap_log(self, trainer: Any) -> _Unwrap:
        """Add the figures to every ``trainer.log(logs)``; the returned handle's ``remove()`` undoes it."""
        original = trainer.log

        @functools.wraps(original)
        def log(logs: dict[str, float], *args: Any, **kwargs: Any) -> None:
            if "eval_loss" not in logs:  # an evaluation's log is about the evaluation, not the training steps
                logs = {**logs, **self.figures()}
            return original(logs, *args, **kwargs)

        trainer.log = log
        return _Unwrap(trainer)
