"""The rule engine: the declarative rules (``Settings.rules``) applied to each new report, turned into
events and directives.

Always recorded, whatever the rules: the run's first non-finite value, each attention-mode change
that ranks report (fallback applied or reverted), and each rank whose step raised (``rank_crashed``); a run's first loss-scale overflow
(``loss_scale_overflow``, once per run: the scaler at work, not an incident). Events are deduplicated per run by a key, so a
condition that persists for hours is one event, not one per step and rank. The engine decides; it writes
only through the ledger (:class:`RuleWrites`), inside the ledger's ingest transaction.
"""

from __future__ import annotations

from typing import Any, Protocol

from nanwatch.monitor.model.event_log import FirstNonfinite, ModeChange
from nanwatch.monitor.model.state import (
    RUN_LEVEL_SCOPES,
    STEP_SLACK,
    Applied,
    CollectorState,
    RankState,
    crash_key,
)
from nanwatch.monitor.model.store import EventRow
from nanwatch.policy import Rule, matches, remedy
from nanwatch.wire import Directive, DirectiveSpec, StepReport

__all__ = ["RuleEngine", "RuleWrites"]


class RuleWrites(Protocol):
    """What the rule engine reads and writes through (``nanwatch.monitor.write.ledger.Ledger``)."""

    state: CollectorState
    """The runs' memory: the auto-revert's witness (``RunState.applied``) lives on the run."""

    def has_event(self, run_id: str, dedupe: str) -> bool: ...

    def record_event(self, ev: EventRow) -> bool: ...

    def directive(self, run_id: str) -> Directive: ...

    def issue_directive(self, run_id: str, spec: DirectiveSpec, *, actor: str) -> Directive: ...


class RuleEngine:
    def __init__(self, rules: list[Rule], *, logit_tau: float) -> None:
        self._rules = rules
        self._tau = logit_tau

    def observe(self, r: StepReport, rank: RankState | None, previous_mode: str | None, now: float, *,
                into: RuleWrites) -> None:
        """Record what ``r`` shows (inside the ingest transaction)."""
        run_id = r.run_id

        # a job report speaks for the rank that held its first offender (wire 1.4), not for its poster
        who = r.first_offender_rank if r.scope == "job" and r.first_offender_rank is not None else r.rank

        def event(kind: str, key: str, detail: FirstNonfinite | ModeChange | dict[str, Any], *,
                  site: str | None = None) -> None:
            into.record_event(EventRow(run_id, now, kind, key, who, r.step, site, "", detail))

        # dynamic loss scaling handled this step's non-finite gradients (wire 1.6): normal operation, no
        # incident: no first offender, no rule, no directive; one event per run says the scaler is at work
        overflow = bool(r.scaler_overflow)
        if overflow and r.scope != "heartbeat":
            event("loss_scale_overflow", "loss_scale_overflow", {"loss_scale": r.loss_scale, "stage": r.stage})
        n = 0 if overflow else rank.nonfinite if rank is not None else r.nonfinite_total
        # the first offender is the run's: a detail report's is one rank's, and the job report of its step
        # (reduced in execution order across ranks) names the first
        if (r.scope in RUN_LEVEL_SCOPES and not overflow and (n or r.first_offender)
                and not into.has_event(run_id, "first_nonfinite")):
            site, phase, stage = r.first_offender, r.first_offender_phase, r.first_offender_stage
            if site is None:
                hit = next(s for s in r.sites if s.nan or s.inf)
                site, phase, stage = hit.site, hit.phase, hit.stage
            event("first_nonfinite", "first_nonfinite",
                  FirstNonfinite(phase=phase, stage=stage or "train", nonfinite=n), site=site)
        if r.raised is not None and r.scope != "job":  # the rank itself said its step raised: it crashed
            into.record_event(EventRow(run_id, now, "rank_crashed", crash_key(r.rank, r.incarnation, r.raised),
                                       r.rank, r.step, r.first_offender, "",
                                       {"raised": r.raised, "stage": r.stage, "incarnation": r.incarnation}))
        if r.incident is not None:
            inc = r.incident
            # everything the replay found, the drill-down's birth, parameters and path included
            event("incident", f"incident:{who}:{inc.step}", inc.model_dump(mode="json", exclude={"site", "step"}),
                  site=inc.site)
        if previous_mode is not None and rank is not None and rank.attention_mode != previous_mode:
            if rank.attention_mode == "none":
                event("mode_reverted", f"reverted:{r.directive_version}",
                      ModeChange(previous_mode=previous_mode, directive_version=r.directive_version))
            else:
                event("mode_applied", f"applied:{rank.attention_mode}:{r.directive_version}",
                      ModeChange(mode=rank.attention_mode, previous_mode=previous_mode,
                                 directive_version=r.directive_version))
        if r.rank == 0 and rank is not None:
            self._auto_revert(r, into)
        if r.scope == "heartbeat" or overflow:
            return  # no measurements (or only the scaler's overflow): only its mode can change (above); the most frequent report, kept cheap
        for rule in self._rules:
            for key, site, detail in matches(rule, r, logit_tau=self._tau):
                event(rule.when, f"{rule.when}:{key}", {"rule": rule.name, **detail}, site=site)
                mode = remedy(rule, r)
                if mode is not None and into.directive(run_id).mode == "none":
                    spec = DirectiveSpec(mode=mode, revert_after_clean_steps=rule.revert_after_clean_steps,
                                         reason=f"{rule.when} at {site} (rank {r.rank}, step {r.step})")
                    into.issue_directive(run_id, spec, actor=f"rule:{rule.name}")

    @staticmethod
    def _auto_revert(r: StepReport, into: RuleWrites) -> None:
        """Record as a new version (mode ``none``) that the trainers reverted on their own after clean steps,
        as the directive allowed: the directive metric then matches what ranks apply, and a rule can issue
        a fresh directive. Only rank 0 decides a revert (every rank follows its agreement), and one report
        cannot fake it (#19): it must come from the incarnation of rank 0 that reported the mode applied
        under this version before (``RunState.applied``), at a step at least ``revert_after_clean_steps``
        past ``apply_at_step``, and at most ``STEP_SLACK`` past that incarnation's previous report. An honest
        revert reported after a gap, or first seen after a restart of the collector (the witness is kept in
        memory), is believed at the rank's next report."""
        cur = into.directive(r.run_id)
        run = into.state.runs.get(r.run_id)
        if run is None or cur.mode == "none" or not cur.revert_after_clean_steps or r.directive_version != cur.version:
            return
        seen = run.applied
        known = seen is not None and seen.version == cur.version
        mine = known and seen.incarnation == r.incarnation
        # a report under this version is the rank's word that it applied it: the first one (none known, as
        # after a restart of the collector) or one in the mode (a restarted job) names the witness
        if r.attention_mode == cur.mode or not known or mine:
            run.applied = Applied(cur.version, r.incarnation, r.step)
        if (mine and r.attention_mode == "none"
                and cur.apply_at_step + cur.revert_after_clean_steps <= r.step <= seen.step + STEP_SLACK):
            into.issue_directive(r.run_id, DirectiveSpec(mode="none", apply_at_step=r.step,
                                                         reason=f"rank {r.rank} reverted after clean steps"),
                                 actor="trainer:auto-revert")
