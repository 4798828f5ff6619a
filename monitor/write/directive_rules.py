"""The directive-rule engine: the declarative rules (``Settings.rules``) applied to each new report, turned into
intents: events to record and directives to issue.

Always recorded, whatever the directive rules: the run's first non-finite value, each attention-mode change
that ranks report (fallback applied or reverted), each rank whose step raised (``rank_crashed``), each
classified rollout mismatch and module attribution (``rollout_mismatch``, ``rollout_attribution``); a run's
first loss-scale overflow (``loss_scale_overflow``, once per run: the scaler at work, not an incident). Events
are deduplicated per run by a key, so a condition that persists for hours is one event, not one per step and
rank. The engine decides and writes nothing: it reads what it must through ``DirectiveRuleReads`` and returns
``Intents``, which the ledger carries out inside its ingest transaction, before the next report is folded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from nanwatch.monitor.data.event_log import FirstNonfinite, ModeChange
from nanwatch.monitor.data.state import (
    RUN_LEVEL_SCOPES,
    STEP_SLACK,
    Applied,
    RankState,
    crash_key,
)
from nanwatch.monitor.data.store import EventRow
from nanwatch.policy import Rule, matches, remedy
from nanwatch.wire import Directive, DirectiveSpec, StepReport

__all__ = ["DirectiveRuleEngine", "DirectiveRuleReads", "Intents", "Issue"]


class DirectiveRuleReads(Protocol):
    """What the directive-rule engine reads while it decides (``nanwatch.monitor.write.ledger.Ledger``): what the store
    and memory hold, the current batch's earlier reports' intents included. It writes nothing through it."""

    def has_event(self, run_id: str, dedupe: str) -> bool: ...

    def directive(self, run_id: str) -> Directive: ...

    def event_count(self, run_id: str, kind: str) -> int:
        """How many events of ``kind`` the run holds (recorded, this process's and the store's read back)."""

    def witness(self, run_id: str) -> Applied | None:
        """Which incarnation of rank 0 applied the current revertible directive (``RunState.applied``)."""


@dataclass(frozen=True, slots=True)
class Issue:
    """A directive the directive rules ask for: the ledger issues it as a new version, with its audit event."""

    run_id: str
    spec: DirectiveSpec
    actor: str


@dataclass(slots=True)
class Intents:
    """What one report calls for, in the order it must happen: events to record and directives to issue
    (a directive's audit event falls between the events around it), and the auto-revert's new witness."""

    run_id: str
    actions: list[EventRow | Issue] = field(default_factory=list)
    witness: Applied | None = None
    """Rank 0's incarnation that applied the current revertible directive, as this report tells (None: as
    it was)."""


class DirectiveRuleEngine:
    """Decides what each new report calls for (``observe``); the ledger carries it out."""

    def __init__(self, rules: list[Rule], *, logit_tau: float) -> None:
        self._rules = rules
        self._tau = logit_tau

    def observe(self, r: StepReport, rank: RankState | None, previous_mode: str | None, now: float, *,
                reads: DirectiveRuleReads) -> Intents:
        """What ``r`` calls for (``rank``: the view the fold left, ``previous_mode``: the rank's mode before)."""
        out = Intents(r.run_id)
        # a job report speaks for the rank that held its first offender (wire 1.4), not for its poster
        who = r.first_offender_rank if r.scope == "job" and r.first_offender_rank is not None else r.rank
        events = _Events(r, now, who, out)
        # dynamic loss scaling handled this step's non-finite gradients (wire 1.6): normal operation, no
        # incident: no first offender, no rule, no directive; one event per run says the scaler is at work
        overflow = bool(r.scaler_overflow)
        if overflow and r.scope != "heartbeat":
            events.add("loss_scale_overflow", "loss_scale_overflow", {"loss_scale": r.loss_scale, "stage": r.stage})
        if not overflow:
            _first_nonfinite(r, rank, reads, events)
        _lifecycle(r, rank, previous_mode, events)
        _rollout(r, events)
        _spikes(r, reads, events)
        issued = _auto_revert(r, reads, out) if r.rank == 0 and rank is not None else None
        if r.scope == "heartbeat" or overflow:
            return out  # no measurements (or only the scaler's overflow): only its mode can change (above)
        for rule in self._rules:
            for key, site, detail in matches(rule, r, logit_tau=self._tau):
                events.add(rule.when, f"{rule.when}:{key}", {"rule": rule.name, **detail}, site=site)
                wanted = remedy(rule, r)
                # one directive at a time: none is issued over a run's active one (this report's included)
                if wanted is not None and (issued or reads.directive(r.run_id).mode) == "none":
                    spec = DirectiveSpec(mode=wanted, revert_after_clean_steps=rule.revert_after_clean_steps,
                                         reason=f"{rule.when} at {site} (rank {r.rank}, step {r.step})")
                    out.actions.append(Issue(r.run_id, spec, f"rule:{rule.name}"))
                    issued = wanted
        return out


@dataclass(slots=True)
class _Events:
    """The events one report calls for, each stamped with its run, time and step, and the rank it speaks for."""

    r: StepReport
    now: float
    who: int
    out: Intents

    def add(self, kind: str, key: str, detail: FirstNonfinite | ModeChange | dict[str, Any], *,
            site: str | None = None, rank: int | None = None, step: int | None = None) -> None:
        self.out.actions.append(EventRow(self.r.run_id, self.now, kind, key, self.who if rank is None else rank,
                                         self.r.step if step is None else step, site, "", detail))


def _first_nonfinite(r: StepReport, rank: RankState | None, reads: DirectiveRuleReads, events: _Events) -> None:
    """The run's first non-finite value: a detail report's is one rank's, and the job report of its step
    (reduced in execution order across ranks) names the first."""
    n = rank.nonfinite if rank is not None else r.nonfinite_total
    if r.scope in RUN_LEVEL_SCOPES and (n or r.first_offender) and not reads.has_event(r.run_id, "first_nonfinite"):
        site, phase, stage = r.first_offender, r.first_offender_phase, r.first_offender_stage
        if site is None:
            hit = next(s for s in r.sites if s.nan or s.inf)
            site, phase, stage = hit.site, hit.phase, hit.stage
        events.add("first_nonfinite", "first_nonfinite",
                   FirstNonfinite(phase=phase, stage=stage or "train", nonfinite=n), site=site)


def _lifecycle(r: StepReport, rank: RankState | None, previous_mode: str | None, events: _Events) -> None:
    """What a report says happened to its rank: its step raised (it crashed), an incident was classified,
    its attention mode changed (a fallback applied or reverted)."""
    if r.raised is not None and r.scope != "job":  # the rank itself said its step raised: it crashed
        events.add("rank_crashed", crash_key(r.rank, r.incarnation, r.raised),
                   {"raised": r.raised, "stage": r.stage, "incarnation": r.incarnation}, site=r.first_offender,
                   rank=r.rank)
    if r.incident is not None:
        inc = r.incident
        # everything the trainer's differential re-run found, the drill-down's birth, parameters and path; a
        # replica divergence (its ranks, hosts, first differing parameters, repaired) is the job's: once a step
        key = (f"replica_divergence:{inc.step}" if inc.cls == "replica_divergence"
               else f"incident:{events.who}:{inc.step}")
        # stamped with the incident's own step: on a GPU the rerun decides a step later, and the incident
        # arrives in a later step's report (nanwatch.hooks.forensics.rerun_flags)
        events.add("incident", key, inc.model_dump(mode="json", exclude={"site", "step"}),
                   site=inc.site or (inc.params[0] if inc.params else None), step=inc.step)
    if previous_mode is not None and rank is not None and rank.attention_mode != previous_mode:
        if rank.attention_mode == "none":
            events.add("mode_reverted", f"reverted:{r.directive_version}",
                       ModeChange(previous_mode=previous_mode, directive_version=r.directive_version))
        else:
            events.add("mode_applied", f"applied:{rank.attention_mode}:{r.directive_version}",
                       ModeChange(mode=rank.attention_mode, previous_mode=previous_mode,
                                  directive_version=r.directive_version))


def _rollout(r: StepReport, events: _Events) -> None:
    """The trainer's classified rollout mismatches (wire 1.8), each with its figures, evidence and remedy, and
    the module attribution: into the run's event log. Never a directive: the cause is outside the trainer's
    attention. A mismatch from a run-level report (job or rank, as its counter; one per cause, step and rank,
    ``job`` for the job's); an attribution from any measured report, once per step and cause."""
    if r.scope in RUN_LEVEL_SCOPES:
        who = "job" if r.scope == "job" else str(r.rank)
        for ev in r.rollout_events:
            events.add("rollout_mismatch", f"rollout_mismatch:{ev.cause}:{ev.step}:{who}",
                       ev.model_dump(mode="json"), rank=r.rank)
    for ev in r.moe.events if r.moe is not None and r.scope in RUN_LEVEL_SCOPES else ():
        events.add(ev.kind, f"{ev.kind}:{ev.step}:{'job' if r.scope == 'job' else r.rank}",
                   ev.model_dump(mode="json"), site=ev.routers[0] if ev.routers else None, rank=r.rank)
    at = r.rollout_attribution
    if at is not None and r.scope != "heartbeat":
        events.add("rollout_attribution", f"rollout_attribution:{at.cause}:{at.step}",
                   at.model_dump(mode="json"), site=at.module, rank=r.rank)


#: spike events a run holds at most: the first spike of each site and pass, until this many (a spiky run
#: cannot fill the run's event cap; nanwatch_spikes_total counts them all)
MAX_SPIKE_EVENTS = 64


def _spikes(r: StepReport, reads: DirectiveRuleReads, events: _Events) -> None:
    """The first spike of each site and pass (wire 1.9), while the run holds fewer than ``MAX_SPIKE_EVENTS``:
    its step, factor, value and baseline. From run-level reports (a detail report's are its job's). Never a
    directive: a spike is a precursor, not an incident."""
    if r.scope not in RUN_LEVEL_SCOPES or not r.spikes:
        return
    room = MAX_SPIKE_EVENTS - reads.event_count(r.run_id, "spike")
    for s in r.spikes:
        if room <= 0:
            return
        key = f"spike:{s.phase}:{s.site}"
        if not reads.has_event(r.run_id, key):
            events.add("spike", key, s.model_dump(mode="json", exclude={"site"}), site=s.site)
            room -= 1


def _auto_revert(r: StepReport, reads: DirectiveRuleReads, out: Intents) -> str | None:
    """Record as a new version (mode ``none``) that the trainers reverted on their own after clean steps,
    as the directive allowed: the directive metric then matches what ranks apply, and a rule can issue
    a fresh directive. Only rank 0 decides a revert (every rank follows its agreement), and one report
    cannot fake it (#19): it must come from the incarnation of rank 0 that reported the mode applied
    under this version before (``RunState.applied``), at a step at least ``revert_after_clean_steps``
    past ``apply_at_step``, and at most ``STEP_SLACK`` past that incarnation's previous report. An honest
    revert reported after a gap, or first seen after a restart of the collector (the witness is kept in
    memory), is believed at the rank's next report. Returns ``"none"`` if it issued the revert, else None."""
    cur = reads.directive(r.run_id)
    if cur.mode == "none" or not cur.revert_after_clean_steps or r.directive_version != cur.version:
        return None
    seen = reads.witness(r.run_id)
    known = seen is not None and seen.version == cur.version
    mine = known and seen.incarnation == r.incarnation
    # a report under this version is the rank's word that it applied it: the first one (none known, as
    # after a restart of the collector) or one in the mode (a restarted job) names the witness
    if r.attention_mode == cur.mode or not known or mine:
        out.witness = Applied(cur.version, r.incarnation, r.step)
    if (mine and r.attention_mode == "none"
            and cur.apply_at_step + cur.revert_after_clean_steps <= r.step <= seen.step + STEP_SLACK):
        spec = DirectiveSpec(mode="none", apply_at_step=r.step, reason=f"rank {r.rank} reverted after clean steps")
        out.actions.append(Issue(r.run_id, spec, "trainer:auto-revert"))
        return "none"
    return None
