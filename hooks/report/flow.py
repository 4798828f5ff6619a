"""Where a finished step goes, on the reporter thread: built into a StepReport, observed by the directive
state (the clean-step streak) and the local rule engine, then delivered to the collector's sender, the local
log (``nanwatch.hooks.report.local_log``: log lines and a JSONL file) and the user's ``on_report``. One object owns
that chain, so the Monitor hands it a step and nothing more.

Example usage::

    flow = ReportFlow(config, rank=0, world_size=1, incarnation="ab12", rec=rec, warn=WarnOnce(),
                      directive_state=state, expects_logits=lambda: True)
    flow.capture(rec.flat(), step, StepContext(rec.swap(), state.mode, state.version, time.time()))
    flow.last_report()
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from nanwatch.hooks.config import MonitorConfig
from nanwatch.hooks.directives.directive_state import DirectiveState
from nanwatch.hooks.directives.local_rules import LocalRuleEngine
from nanwatch.hooks.failsafe import WarnOnce
from nanwatch.hooks.measure.recorder import Recorder
from nanwatch.hooks.measure.rlhf import rlhf_slots
from nanwatch.hooks.report.build import ReportBuilder, StepContext
from nanwatch.hooks.report.job import JobReporting, open_job_reporting
from nanwatch.hooks.report.local_log import LocalLog
from nanwatch.hooks.report.reporter import Pending, Reporter
from nanwatch.wire import StepReport

__all__ = ["ReportFlow"]

log = logging.getLogger("nanwatch")


class ReportFlow:
    """The reporter thread's side of one Monitor: the builder, the rules, the sender, the callback."""

    def __init__(self, config: MonitorConfig, *, rank: int, world_size: int, incarnation: str, rec: Recorder,
                 warn: WarnOnce, directive_state: DirectiveState, expects_logits: Callable[[], bool]) -> None:
        self._on_report = config.on_report
        self._directive_state = directive_state
        self._config, self._rank, self._world, self._rec = config, rank, world_size, rec
        self._job: JobReporting | None = None
        self._rlhf: dict | None = None  # the step's raw RLHF slots, from _build to _deliver (reporter thread)
        source = config.directive_source
        local = source == "local" or (source == "auto" and not config.collector)
        self._rules = LocalRuleEngine(run_id=config.run_id, directive_state=directive_state,
                                      logit_tau=config.logit_tau) if local else None
        self._sender = None
        self._local = LocalLog(config, rank=rank, incarnation=incarnation, warn=warn)  # log lines, JSONL file
        self._builder = ReportBuilder(
            run_id=config.run_id, rank=rank, world_size=world_size, incarnation=incarnation, rec=rec, warn=warn,
            dropped_reports=lambda: self.dropped, expects_logits=expects_logits,
            agree_every=config.directive_check_every if world_size > 1 else None)
        self._reporter = Reporter(self._build, on_report=self._deliver, max_pending=config.max_pending_reports,
                                  on_close=self._closing)

    def open_job(self) -> bool:
        """Training thread, at attach, on every rank together (a collective when the scope is ``job``): report
        per job from now on (``nanwatch.hooks.report.job``). False: per rank."""
        cfg = self._config
        self._job = open_job_reporting(scope=cfg.report_scope, rank=self._rank, world_size=self._world,
                                       heartbeat_s=cfg.heartbeat_s, timeout_s=cfg.report_reduce_timeout_s)
        return self._job is not None

    def send_to(self, sender) -> None:
        """Deliver every report to ``sender`` too (a ``ReportSender``); closed with this flow."""
        self._sender = sender

    def capture(self, data: torch.Tensor, step: int, ctx: StepContext) -> bool:
        """Training thread, step end: hand the step over (False: dropped, the reporter is too far behind)."""
        return self._reporter.capture(data, step, ctx)

    def final(self, step: int, ctx: StepContext) -> None:
        """Training thread, at a normal close, after the last step's hand-over: the incarnation's final report
        (no measurements, never dropped, never reduced across ranks)."""
        self._reporter.post(step, ctx)

    def last_report(self, timeout: float | None) -> StepReport | None:
        return self._reporter.last_report(timeout)

    @property
    def dropped(self) -> int:
        """Reports that never reached the collector: behind the reporter, or queued and dropped to send."""
        return self._reporter.dropped + (self._sender.dropped if self._sender is not None else 0)

    def close(self, timeout: float) -> None:
        self._reporter.close(timeout)
        if self._sender is not None:
            self._sender.close(timeout_s=timeout)

    # ---- reporter thread ---------------------------------------------------------------------------
    def _build(self, pending: Pending, values: list[float]) -> StepReport:
        report = self._builder.build(pending, values)
        if report.final:
            return report
        if report.stage == "train":  # an evaluation is no training step: it neither makes nor breaks a streak
            # a loss-scale overflow the scaler handled is normal operation: it keeps a clean streak going
            self._directive_state.note_report(report.first_offender is None or bool(report.scaler_overflow))
        if self._rules is not None:
            self._rules.observe(report)
        if self._job is not None and report.stage == "train":
            state = pending.context.state
            self._rlhf = rlhf_slots(self._rec.getter(state, values)) if state.rlhf else None
        return report

    def _deliver(self, report: StepReport) -> None:
        """Send what this rank posts for the step: its own report, or (job scope) the job's, a detail or a
        heartbeat. ``on_report`` sees exactly what is sent; ``last_report()`` stays this rank's own. An eval
        report is never reduced (ranks need not evaluate alike, and a collective one rank issued alone would
        hang): it goes as this rank's own report, numbered in the job's sequence; so do a step that raised and
        the final report (every rank sends its own: a rank closing alone must not wait on its peers)."""
        if self._job is None:
            outs = [report]
        elif report.stage != "train" or report.raised is not None or report.final:
            # a step that raised: this rank is going down, and must not wait on its peers to say so (its
            # reporter's closing header then releases any peer waiting on this step's reduction)
            outs = self._job.own(report)
        else:
            outs = self._job.route(report, self._rlhf)
        for out in outs:
            if self._sender is not None:
                self._sender.submit(out)
            self._local.observe(out)
            if self._on_report is not None:
                try:
                    self._on_report(out)
                except Exception:
                    log.exception("nanwatch: on_report callback failed for step %s", out.step)

    def _closing(self) -> None:
        """Reporter thread, after its last report: the job's group and the local log close here, so that
        nothing writes to them after."""
        self._local.close()
        if self._job is not None:
            self._job.close()
