"""The collector's default rules, run inside the trainer: a run without a collector (or with
``directive_source="local"``) still gets its remedy, e.g. fp32 attention from the next step after a
non-finite half-precision attention output. Same rules, same code (``nanwatch.policy``, the shared
declarative rules; the collector's engine is ``DirectiveRuleEngine``); the directive is offered to this rank's
DirectiveState, and under torch.distributed the ranks' agreement (a MAX all-reduce) makes every rank apply
it at the same step, whichever rank saw the problem. Reporter thread only."""

from __future__ import annotations

import logging
import time
from typing import Protocol

from nanwatch.policy import Rule, default_rules, matches, remedy
from nanwatch.wire import Directive, StepReport

__all__ = ["LocalRuleEngine", "Offers"]

log = logging.getLogger("nanwatch")


class Offers(Protocol):
    """What the engine asks of the directive state it offers to (``DirectiveState`` is one, handed in by the
    report flow): the mode and version in force, and ``offer``. The rules themselves need no torch."""

    mode: str
    version: int

    def offer(self, directive: Directive) -> None: ...


class LocalRuleEngine:
    """Evaluates the rules on each finished report and offers the first remedy one asks for."""

    def __init__(self, *, run_id: str, directive_state: Offers, logit_tau: float,
                 rules: list[Rule] | None = None) -> None:
        self._run_id = run_id
        self._directive_state = directive_state
        self._tau = logit_tau
        self._rules = default_rules() if rules is None else rules
        self._offered_version = 0

    def observe(self, report: StepReport) -> None:
        """Reporter thread: offer the first directive a rule asks for, if none is active or pending."""
        if report.scaler_overflow or report.final:  # dynamic loss scaling at work, or no measurements
            return
        d = self._directive_state
        if d.mode != "none" or self._offered_version > d.version:
            return
        for rule in self._rules:
            for _, site, _ in matches(rule, report, logit_tau=self._tau):
                mode = remedy(rule, report)
                if mode is None:
                    continue
                self._offered_version = d.version + 1
                d.offer(Directive(run_id=self._run_id, version=self._offered_version, mode=mode,
                                  apply_at_step=report.step + 1, revert_after_clean_steps=rule.revert_after_clean_steps,
                                  reason=f"{rule.when} at {site} (step {report.step})", set_by=f"local:{rule.name}",
                                  created_at=time.time()))
                log.warning("nanwatch: local rules: %s at %s in step %d: offering directive %s", rule.when, site,
                            report.step, mode)
                return
