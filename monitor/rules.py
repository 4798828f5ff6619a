"""The declarative policy (``Settings.rules``) applied to each new report: events, and directives.

Always recorded, whatever the policy: the run's first non-finite value, and each attention-mode change
that ranks report (fallback applied or reverted). Events are deduplicated per run by a key, so a
condition that persists for hours is one event, not one per step and rank.
"""

from __future__ import annotations

from nanwatch.monitor.directive_log import DirectiveLog
from nanwatch.monitor.event_log import EventLog
from nanwatch.monitor.state import RankState
from nanwatch.monitor.store import EventRow
from nanwatch.policy import Rule, matches, remedy
from nanwatch.wire import DirectiveSpec, StepReport

__all__ = ["Policy"]


class Policy:
    def __init__(self, rules: list[Rule], *, logit_tau: float, directives: DirectiveLog, events: EventLog) -> None:
        self._rules = rules
        self._tau = logit_tau
        self._directives = directives
        self._events = events

    def observe(self, r: StepReport, rank: RankState | None, previous_mode: str | None, now: float) -> None:
        """Record what ``r`` shows (call inside the ingest transaction)."""
        directives = self._directives
        run_id = r.run_id

        def event(kind: str, key: str, *, site: str | None = None, actor: str = "", **detail) -> None:
            self._events.record(EventRow(run_id, now, kind, key, r.rank, r.step, site, actor, detail))

        n = rank.nonfinite if rank is not None else r.nonfinite_total
        if (n or r.first_offender) and not self._events.has(run_id, "first_nonfinite"):
            site, phase, stage = r.first_offender, r.first_offender_phase, r.first_offender_stage
            if site is None:
                hit = next(s for s in r.sites if s.nan or s.inf)
                site, phase, stage = hit.site, hit.phase, hit.stage
            event("first_nonfinite", "first_nonfinite", site=site, phase=phase, stage=stage or "train", nonfinite=n)
        if r.incident is not None:
            inc = r.incident
            # everything the replay found, the drill-down's birth, parameters and path included
            event("incident", f"incident:{r.rank}:{inc.step}", site=inc.site,
                  **inc.model_dump(mode="json", exclude={"site", "step"}))
        if previous_mode is not None and rank is not None and rank.mode != previous_mode:
            if rank.mode == "none":
                event("mode_reverted", f"reverted:{r.directive_version}", previous_mode=previous_mode,
                      directive_version=r.directive_version)
                cur = directives.current(run_id)
                if (cur.mode != "none" and cur.version == r.directive_version and cur.revert_after_clean_steps
                        and r.rank == 0):
                    # The trainers reverted on their own (clean steps), as the directive allowed: record it
                    # as a new version so the directive metric matches what ranks apply, and a rule can
                    # issue a fresh directive. Only the rank that decides reverts (rank 0, whose agreement
                    # every rank follows) and only the incarnation that applied the mode can end it.
                    directives.set(run_id, DirectiveSpec(mode="none", apply_at_step=r.step,
                                                         reason=f"rank {r.rank} reverted after clean steps"),
                                   actor="trainer:auto-revert")
            else:
                event("mode_applied", f"applied:{rank.mode}:{r.directive_version}", mode=rank.mode,
                      previous_mode=previous_mode, directive_version=r.directive_version)
        for rule in self._rules:
            for key, site, detail in matches(rule, r, logit_tau=self._tau):
                event(rule.when, f"{rule.when}:{key}", site=site, rule=rule.name, **detail)
                mode = remedy(rule, r)
                if mode is not None and directives.current(run_id).mode == "none":
                    spec = DirectiveSpec(mode=mode, revert_after_clean_steps=rule.revert_after_clean_steps,
                                         reason=f"{rule.when} at {site} (rank {r.rank}, step {r.step})")
                    directives.set(run_id, spec, actor=f"rule:{rule.name}")
