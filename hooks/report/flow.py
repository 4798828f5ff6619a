"""Where a finished step goes, on the reporter thread: decoded (``nanwatch.hooks.measure.decode``), built into
a StepReport, observed by the directive state (the clean-step streak) and the local rule engine, then
delivered to the collector's sender, the local log (``nanwatch.hooks.report.local_log``: log lines and a JSONL
file) and the user's ``on_report``. One object owns that chain, so the Monitor hands it a step and nothing
more.

One way, as values: the flow owns the reporter thread and drives the hand-over (``Reporter.take`` /
``finish``); each step becomes a :class:`Built` value (the report, the streak's verdict, the raw RLHF slots
for the job reduction), and the consumers are fed from that value. Nothing is left on ``self`` from one
stage to the next, and the reporter never calls back up.

Its stages come built (the Monitor is the composition root): the report builder, the job-level reporting it
opens at attach (``nanwatch.hooks.report.job``) and the job report's spike baselines are handed in, each
typed here by what the flow asks of it.

Example usage::

    builder = ReportBuilder(run_id="r1", rank=0, world_size=1, incarnation="ab12", warn=warn,
                            expects_logits=lambda: True, agree_every=None)
    flow = ReportFlow(config.reports, directives=config.directives, local_log=config.log, run_id="r1",
                      collector=None, token=None, rank=0, incarnation="ab12", warn=warn, directive_state=state,
                      builder=builder, open_job=lambda: None)
    flow.capture(rec.flat(), step, StepContext(rec.swap(), state.mode, state.version, time.time()))
    flow.last_report()
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from nanwatch.hooks.config import DirectivesConfig, LocalLogConfig, ReportsConfig
from nanwatch.hooks.directives.directive_state import DirectiveState
from nanwatch.hooks.directives.local_rules import LocalRuleEngine
from nanwatch.hooks.failsafe import WarnOnce
from nanwatch.hooks.measure.decode import StepStats, decode_step
from nanwatch.hooks.moe.report import explained
from nanwatch.hooks.report.local_log import LocalLog
from nanwatch.hooks.report.reporter import Landed, Reporter
from nanwatch.hooks.report.step_context import StepContext
from nanwatch.hooks.rollout.mismatch import MismatchClassifier
from nanwatch.hooks.rollout.sync_verdict import SyncVerdicts
from nanwatch.wire import RolloutEvent, SiteStat, Spike, StepReport

__all__ = ["Builds", "Built", "JobRoutes", "ReportFlow"]

log = logging.getLogger("nanwatch")


@dataclass(frozen=True, slots=True)
class Built:
    """One step, turned into values on the reporter thread: the report and what each consumer gets."""

    report: StepReport
    clean: bool | None
    """For the directive state's clean-step streak: True clean (or a loss-scale overflow the scaler handled),
    False not; None: no training step (an evaluation, the final report), which neither makes nor breaks one."""
    rlhf: dict[tuple[str, str], float] | None
    """A training step's raw RLHF slots, for the job reduction (None: no RLHF stats, or no training step)."""


class Builds(Protocol):
    """What the flow asks of its report builder (``nanwatch.hooks.report.build.ReportBuilder``)."""

    def build(self, stats: StepStats, ctx: StepContext, *, seq: int, step: int, dropped: int) -> StepReport: ...

    def final(self, ctx: StepContext, *, seq: int, step: int, dropped: int) -> StepReport: ...


class JobRoutes(Protocol):
    """What the flow asks of job-level reporting (``nanwatch.hooks.report.job.JobReporting``)."""

    def route(self, own: StepReport, rlhf: dict | None) -> list[StepReport]: ...

    def own(self, report: StepReport) -> list[StepReport]: ...

    def close(self) -> None: ...


class ReportFlow:
    """The reporter thread's side of one Monitor: the thread, the builder, the rules, the sender, the callback.

    It receives the sections it runs (``reports``; ``directives`` for the local rules, ``local_log`` for the
    local record) and, from the run's identity, its ``run_id``, ``collector`` (whether there is one decides
    ``directive_source="auto"``) and ``token`` (the weight sync's verdicts are asked of the collector with it);
    and its built stages: ``builder``, ``open_job`` (called at attach, on every rank together: the job-level
    reporting, or None to report per rank) and ``job_spikes`` (a ``SpikeDetector.observe`` for the job
    report's sites, or None: spikes off)."""

    def __init__(self, config: ReportsConfig, *, directives: DirectivesConfig, local_log: LocalLogConfig,
                 run_id: str, collector: str | None, token: str | None, rank: int, incarnation: str,
                 warn: WarnOnce, directive_state: DirectiveState, builder: Builds,
                 open_job: Callable[[], JobRoutes | None],
                 job_spikes: Callable[[int, Sequence[SiteStat]], list[Spike]] | None = None,
                 on_mismatch: Callable[[RolloutEvent], None] | None = None) -> None:
        self._on_report = config.on_report
        self._mismatch, self._on_mismatch = MismatchClassifier(), on_mismatch
        # the weight sync's verdicts, asked of the collector before a mismatch is called a drift or a jump
        self._verdicts = SyncVerdicts(collector, run_id, token=token) if collector else None
        self._directive_state = directive_state
        self._config, self._open_job = config, open_job
        self.incarnation = incarnation
        self._job: JobRoutes | None = None
        source = directives.source
        local = source == "local" or (source == "auto" and not collector)
        self._rules = LocalRuleEngine(run_id=run_id, directive_state=directive_state,
                                      logit_tau=directives.logit_tau) if local else None
        self._sender = None
        self._local = LocalLog(local_log, run_id=run_id, rank=rank, incarnation=incarnation,
                               warn=warn)  # log lines, JSONL file
        self._builder = builder
        self._job_spikes = job_spikes  # job scope: the job report's sites (each the ranks' max)
        self._reporter = Reporter(max_pending=config.max_pending)
        self._thread = threading.Thread(target=self._run, name="nanwatch-reporter", daemon=True)
        self._thread.start()

    def open_job(self) -> bool:
        """Training thread, at attach, on every rank together (a collective when the scope is ``job``): report
        per job from now on (``nanwatch.hooks.report.job``). False: per rank."""
        self._job = self._open_job()
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

    def published(self, version: int, dtypes: list[str]) -> None:
        """Training thread: a weight version published (``Monitor.publish_weights``), for the local record."""
        self._local.published(version, dtypes)

    def last_report(self, timeout: float | None) -> StepReport | None:
        return self._reporter.last_report(timeout)

    @property
    def dropped(self) -> int:
        """Reports that never reached the collector: behind the reporter, or queued and dropped to send."""
        return self._reporter.dropped + (self._sender.dropped if self._sender is not None else 0)

    def close(self, timeout: float) -> None:
        """Let the reporter thread finish and the sender deliver, within ``timeout`` seconds in all; the
        sender then keeps what it could not deliver on disk and logs its account."""
        deadline = time.monotonic() + max(timeout, 0.0)
        self._reporter.close()
        self._thread.join(timeout)
        if self._verdicts is not None:
            self._verdicts.close()
        if self._sender is not None:
            self._sender.close(timeout_s=max(deadline - time.monotonic(), 0.0))

    # ---- reporter thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        """Take each landed step, turn it into a :class:`Built` value, feed the directive state and the rules,
        hand the report back for ``last_report()``, deliver; after the last step, close the sinks."""
        while (landed := self._reporter.take()) is not None:
            built = None
            try:
                built = self._build(landed)
                self._observe(built)
            except Exception:
                built = None
                log.exception("nanwatch: could not build the report for step %s", landed.pending.step)
            finally:
                self._reporter.finish(landed.pending, built.report if built is not None else None)
            if built is not None:
                try:
                    self._deliver(built)
                except Exception:
                    log.exception("nanwatch: could not deliver the report for step %s", landed.pending.step)
        try:
            self._closing()
        except Exception:
            log.exception("nanwatch: reporter close hook failed")

    def _build(self, landed: Landed) -> Built:
        """The step's values: its decoded stats built into a report, and what the consumers get."""
        p = landed.pending
        ctx: StepContext = p.context
        if ctx.final:
            return Built(self._builder.final(ctx, seq=p.seq, step=p.step, dropped=self.dropped), None, None)
        stats = decode_step(ctx.state, landed.values)
        report = self._builder.build(stats, ctx, seq=p.seq, step=p.step, dropped=self.dropped)
        if self._job is None:  # job scope: the job's report is classified, in _deliver
            report = self._classified(report)
        if report.stage != "train":  # an evaluation is no training step: it neither makes nor breaks a streak
            return Built(report, None, None)
        # a loss-scale overflow the scaler handled is normal operation: it keeps a clean streak going
        return Built(report, report.first_offender is None or bool(report.scaler_overflow),
                     stats.rlhf_slots if self._job is not None else None)  # only a job report reduces them

    def _observe(self, built: Built) -> None:
        """Feed the directive state's clean streak and the local rule engine (never the final report)."""
        if built.clean is not None:
            self._directive_state.note_report(built.clean)
        if self._rules is not None and not built.report.final:
            self._rules.observe(built.report)

    def _deliver(self, built: Built) -> None:
        """Send what this rank posts for the step: its own report, or (job scope) the job's, a detail or a
        heartbeat. ``on_report`` sees exactly what is sent; ``last_report()`` stays this rank's own. An eval
        report is never reduced (ranks need not evaluate alike, and a collective one rank issued alone would
        hang): it goes as this rank's own report, numbered in the job's sequence; so do a step that raised and
        the final report (every rank sends its own: a rank closing alone must not wait on its peers)."""
        report = built.report
        if self._job is None:
            outs = [report]
        elif report.stage != "train" or report.raised is not None or report.final:
            # a step that raised: this rank is going down, and must not wait on its peers to say so (its
            # reporter's closing header then releases any peer waiting on this step's reduction)
            outs = self._job.own(report)
        else:
            outs = [self._job_spiked(self._classified(o)) for o in self._job.route(report, built.rlhf)]
        for out in outs:
            if self._sender is not None:
                self._sender.submit(out)
            self._local.observe(out)
            if self._on_report is not None:
                try:
                    self._on_report(out)
                except Exception:
                    log.exception("nanwatch: on_report callback failed for step %s", out.step)

    def _classified(self, report: StepReport) -> StepReport:
        """``report`` with the rollout mismatch's events of its step (a training report that speaks for this
        rank or the job and has rollout figures); each event also goes to ``on_mismatch`` (the attribution)."""
        r = report.rlhf.rollout if report.rlhf is not None else None
        if r is None or report.stage != "train" or report.scope not in ("rank", "job"):
            return report
        events = explained(self._mismatch.observe(report.step, r, sync=self._verdicts), report.moe)
        for event in events:
            log.warning("nanwatch: step %d: rollout mismatch (%s): %s", report.step, event.cause, event.evidence)
            if self._on_mismatch is not None and not self._mismatch.held:  # other weights: no attribution
                try:
                    self._on_mismatch(event)
                except Exception:
                    log.exception("nanwatch: the rollout mismatch's handler failed")
        return report.model_copy(update={"rollout_events": events}) if events else report

    def _job_spiked(self, report: StepReport) -> StepReport:
        """A job report's spikes: its reduced sites (each the ranks' largest value) against the job's own
        baselines; it came with the poster's own."""
        if report.scope != "job" or self._job_spikes is None:
            return report
        return report.model_copy(update={"spikes": self._job_spikes(report.step, report.sites)})

    def _closing(self) -> None:
        """Reporter thread, after its last report: the job's group and the local log close here, so that
        nothing writes to them after."""
        self._local.close()
        if self._job is not None:
            self._job.close()
