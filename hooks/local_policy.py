"""The collector's default rules, run inside the trainer: a run without a collector (or with
``policy="local"``) still gets its remedy, e.g. fp32 attention from the next step after a non-finite
half-precision attention output. Same rules, same code (``nanwatch.policy``); the directive is offered to
this rank's DirectiveState, and under torch.distributed the ranks' agreement (a MAX all-reduce) makes every
rank apply it at the same step, whichever rank saw the problem."""

from __future__ import annotations

import logging
import time

from nanwatch.hooks.directive_state import DirectiveState
from nanwatch.policy import Rule, default_rules, matches, remedy
from nanwatch.wire import Directive, StepReport

__all__ = ["LocalPolicy"]

log = logging.getLogger("nanwatch")


class LocalPolicy:
    def __init__(self, *, run_id: str, directives: DirectiveState, logit_tau: float,
                 rules: list[Rule] | None = None) -> None:
        self._run_id = run_id
        self._directives = directives
        self._tau = logit_tau
        self._rules = default_rules() if rules is None else rules
        self._offered_version = 0

    def observe(self, report: StepReport) -> None:
        """Reporter thread: offer the first directive a rule asks for, if none is active or pending."""
        d = self._directives
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
                log.warning("nanwatch: local policy: %s at %s in step %d: offering directive %s", rule.when, site,
                            report.step, mode)
                return
