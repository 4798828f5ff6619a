"""Report assembly, on the reporter thread: a step's decoded values (``nanwatch.hooks.measure.decode``'s
``StepStats``) plus what the training thread knew at step end (:class:`StepContext`) become one
:class:`~nanwatch.wire.StepReport`, with the warnings a user must see (cross-document leak, no attention
measured) attached and told once, and the step's spikes (``nanwatch.hooks.measure.spikes``: each site against
its own running baseline, from the values the copy brought). (``StepContext`` is the hand-over's message:
``nanwatch.hooks.report.step_context``.)"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from nanwatch.hooks.failsafe import WarnOnce
from nanwatch.hooks.measure.decode import StepStats
from nanwatch.hooks.measure.figures import fill
from nanwatch.hooks.measure.optimizer_check import NonfiniteParams, optimizer_incident
from nanwatch.hooks.measure.recorder import StepState
from nanwatch.hooks.measure.replica_verdict import replica_incident
from nanwatch.hooks.measure.scaler_overflow import SCALER_FOUND, handled_by_scaler, loss_scaling
from nanwatch.hooks.moe.report import moe_stat
from nanwatch.hooks.report.step_context import StepContext
from nanwatch.wire import Coverage, Incident, LogitStat, SiteStat, Spike, StepReport

__all__ = ["ReportBuilder"]

log = logging.getLogger("nanwatch")


class ReportBuilder:
    """Builds the StepReports of one Monitor (one rank, one incarnation) from decoded values: a step's
    ``StepStats`` and its context in, a report out; nothing here reads the recorder."""

    def __init__(self, *, run_id: str, rank: int, world_size: int, incarnation: str, warn: WarnOnce,
                 expects_logits: Callable[[], bool], agree_every: int | None,
                 spikes: Callable[[int, Sequence[SiteStat]], list[Spike]] | None = None) -> None:
        self._ids = dict(run_id=run_id, rank=rank, world_size=world_size, incarnation=incarnation,
                         agree_every=agree_every)
        self._expects_logits = expects_logits
        self._warn = warn
        self._optimizer_incident_done = False  # reporter thread only: the optimizer incident, once per run
        self._params = NonfiniteParams()  # reporter thread only: non-finite parameters, told once per episode
        self._spikes = spikes  # reporter thread only: a SpikeDetector's observe, the sites' baselines (None: off)

    def build(self, stats: StepStats, ctx: StepContext, *, seq: int, step: int, dropped: int) -> StepReport:
        """The report of the step ``ctx`` describes, whose values ``stats`` holds (``dropped``: the reports
        lost so far, carried by this one)."""
        state = ctx.state
        overflow = _scaler_overflow(state, stats)
        warns = list(state.warnings)
        told = self._params.observe(stats.batches, stats.sites, step=step, skipped=bool(
            stats.step_skipped or (loss_scaling(state) and stats.slot("max", SCALER_FOUND, 0.0) > 0)))
        warns.extend(told)
        incident = self._optimizer_incident(stats, state.incident, step, overflow=overflow)
        replicas = replica_incident(state.replica, stats.slot, step)  # type: ignore[arg-type]
        if replicas is not None:
            log.warning("nanwatch: step %d: replicas diverged: %s; first differing: %s", step, replicas.note,
                        ", ".join(replicas.params))
            incident = incident or replicas  # the rerun's or optimizer's verdict, when the same step has one
        for f in stats.fingerprints:
            if f.cross_doc_leak:
                warns.append(f"forward {f.forward}: packed sequences (position_ids restart) ran with plain "
                             "causal attention: documents attend across boundaries (HF builds a cache when "
                             "use_cache is left True in training; pass use_cache=False)")
        if ctx.raised is not None:
            warns.append(f"the step raised {ctx.raised} before it finished: the rank crashed, and what the step "
                         "did not reach is missing, not unmeasured")
        coverage = self._coverage(state, stats.sites, stats.logits, warns, raised=ctx.raised is not None)
        for w in warns:
            if w in told:  # one channel: the training log, once per episode (NonfiniteParams)
                log.warning("nanwatch: %s", w)
            else:
                self._warn(w)
        first = stats.first_offender
        spikes = self._spikes(step, stats.sites) if self._spikes is not None and state.stage == "train" else []
        report = StepReport(
            **self._ids, seq=seq, step=step, stage=state.stage, raised=ctx.raised, time=ctx.time,
            sites=stats.sites, sdpa=stats.sdpa, logits=stats.logits, fingerprints=stats.fingerprints,
            coverage=coverage, rlhf=stats.rlhf, attention_mode=ctx.mode, directive_version=ctx.directive_version,
            first_offender=first.site if first else None, first_offender_phase=first.phase if first else None,
            first_offender_stage=first.stage if first else None,
            first_offender_rank=self._ids["rank"] if first else None,
            step_skipped=stats.step_skipped, incident=incident, nonfinite_rank=stats.nonfinite_rank,
            rollout_attribution=state.rollout_attribution,
            scaler_overflow=overflow, dropped_reports=dropped, warnings=warns[:64],
            spikes=spikes, moe=moe_stat(state.moe, stats.slot, stats.logits, step))
        # the figures measure modules declared (``nanwatch.hooks.measure.figures``): a training step's alone
        return fill(report, stats.figures) if state.stage == "train" else report

    def _optimizer_incident(self, stats: StepStats, incident: Incident | None, step: int, *,
                            overflow: bool | None) -> Incident | None:
        """The step's incident is the optimizer's when its first offender is a parameter an optimizer update
        wrote non-finite (once per run; never over a rerun's verdict or a loss-scale overflow the scaler
        handled)."""
        first = stats.first_offender
        for seen in stats.batches:
            b = seen.batch
            if not seen.bad or b.phase != "optimizer":
                continue
            if (incident is None and not overflow and not self._optimizer_incident_done and first is not None
                    and first[:2] == (b.names[seen.bad[0][0]], "optimizer")):
                self._optimizer_incident_done = True
                incident = optimizer_incident(seen, step=step)
                self._warn(f"step {step}: {incident.note}")
        return incident

    def final(self, ctx: StepContext, *, seq: int, step: int, dropped: int) -> StepReport:
        """The incarnation's last report (the Monitor closed normally): ids, the last step, the directive
        state and the drops, no measurements."""
        return StepReport(**self._ids, seq=seq, step=step, time=ctx.time, final=True, attention_mode=ctx.mode,
                          directive_version=ctx.directive_version, dropped_reports=dropped)

    def _coverage(self, state: StepState, sites: Sequence[SiteStat], logits: Sequence[LogitStat],
                  warns: list[str], *, raised: bool = False) -> Coverage:
        """What the step measured, and why any part of it was not (with a warning that says what to do). A
        step that raised makes no such claim: its forward stopped where the exception was, so a missing part
        says nothing about how the model ran (it is not "compiled, or outside the model")."""
        c = state.coverage
        unmeasured = [] if raised else self._unmeasured(state, logits, warns)
        return Coverage(forwards=c.forwards + c.compiled_forwards, sites=len(sites),
                        attention_calls=c.attention_calls, attention_probed=c.attention_probed,
                        compiled_calls=c.compiled_calls, recomputed_calls=c.recomputed_calls, logits=c.logits,
                        params_checked=c.params_checked, unmeasured=unmeasured)

    def _unmeasured(self, state: StepState, logits: Sequence[LogitStat], warns: list[str]) -> list[str]:
        c = state.coverage
        unmeasured = []
        if not c.forwards and not c.compiled_forwards:
            unmeasured.append("no_forward")
        if c.compiled_forwards or c.compiled_calls:
            unmeasured.append("compiled")
            warns.append("part of the model ran inside torch.compile'd code, where nanwatch's eager probes are "
                         "off: attention there is counted (backend 'compiled'), not measured, and parameter "
                         "gradients are measured instead (see README, 'torch.compile')")
        elif c.train_forwards and not c.attention_probed:
            unmeasured.append("no_attention")
            warns.append("no attention was measured in this step: check is_attention= and that the model calls "
                         "torch.nn.functional.scaled_dot_product_attention at call time")
        if (c.train_forwards or c.compiled_forwards) and not c.logits and self._expects_logits():
            unmeasured.append("no_logits")
            warns.append("the output head's logits were not seen in a training forward (it ran compiled, or "
                         "outside the model): the logits are unmeasured this step")
        missing = sorted(state.attention_layers - {lg.layer for lg in logits})
        if missing:
            unmeasured.append("no_logit_bound")
            more = f" and {len(missing) - 1} more layers" if len(missing) > 1 else ""
            warns.append(f"no attention-logit figure for {missing[0]}{more}: the kernel saved no log-sum-exp "
                         "(math backend, or saved tensors offloaded) and the step was not an exact_logit_every "
                         "step")
        return unmeasured


def _scaler_overflow(state: StepState, stats: StepStats) -> bool | None:
    """``scaler_overflow`` of a training step run under a watched GradScaler, else None
    (``nanwatch.hooks.remedies.loss_scaling`` says what is read and when; its ``loss_scale`` is a report figure)."""
    if not loss_scaling(state) or state.stage != "train":
        return None
    return handled_by_scaler(stats.slot("max", SCALER_FOUND, 0.0) > 0, stats.sites)
