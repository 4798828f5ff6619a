"""The declarative policy: which observations in a StepReport call for an event, and which for a
directive. Pure functions of the wire models (pydantic only), so that the collector's rules and the
trainer's local policy (for runs without a collector) are the very same rules.

Example usage::

    for rule in default_rules():
        for key, site, detail in matches(rule, report, logit_tau=100.0):
            print(rule.name, site, detail, remedy(rule, report))
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, StringConstraints

from nanwatch.wire import Mode, StepReport, is_half

__all__ = ["DEFAULT_LOGIT_TAU", "QUERY_SUFFIX", "Rule", "RuleTrigger", "default_rules", "is_agreement_step",
           "matches", "next_apply_step", "precision_helps", "remedy"]

#: The attention-logit threshold both policies use by default (Kimi K2 clips per-head max logits at 100);
#: the trainer's ``MonitorConfig.directives.logit_tau`` and the collector's ``NANWATCH_LOGIT_TAU`` override it.
DEFAULT_LOGIT_TAU = 100.0


#: An attention call's query is its own site, ``<attention site>.query`` (kind ``attention``): read before the
#: output, so a NaN that arrives in q is named there. A non-finite query was born upstream, so it is an
#: input of attention, never evidence against attention's precision.
QUERY_SUFFIX = ".query"

#: Site kinds whose half-precision overflow a precision directive can cure.
_PRECISION_KINDS = frozenset({"attention", "logits"})


def is_agreement_step(step: int, agree_every: int) -> bool:
    """Under torch.distributed, ranks agree on the active directive at the steps where this is True (and
    switch together there): every ``agree_every`` steps, from step 0."""
    return step % agree_every == 0


def next_apply_step(latest_step: int, *, world_size: int, agree_every: int | None) -> int:
    """The earliest step every rank can apply a directive at, given the latest step a rank reported: the
    next step for one rank (or when ranks agree every step), else the next agreement step. The trainer
    (``is_agreement_step``) and the collector (``apply_at_step``) read the cadence from here alone."""
    every = agree_every or 1
    if world_size == 1 or every == 1:
        return latest_step + 1
    return (latest_step // every + 1) * every

#: What a rule watches for in a report.
RuleTrigger = Literal["half_attention_nonfinite", "math_backend_half", "logit_over_tau", "cross_doc_leak"]
RuleName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


class Rule(BaseModel):
    """One line of the declarative policy: an observation, and what to do about it."""

    name: RuleName
    """Recorded in events, and in ``set_by`` as ``rule:<name>`` when the rule issues a directive."""
    when: RuleTrigger
    """``half_attention_nonfinite``: a fp16/bf16 attention output held NaN/Inf. ``math_backend_half``: the
    math SDPA backend ran on half-precision inputs in training. ``logit_over_tau``: a layer's logit bound
    exceeded ``logit_tau``. ``cross_doc_leak``: packed sequences ran under plain causal attention."""
    directive: Mode | None = None
    """Directive to issue when the run has none active; ``None`` records an event only."""
    revert_after_clean_steps: Annotated[int, Field(ge=1)] | None = None
    """Passed on to the directive: trainers go back to ``none`` after this many clean steps."""


def default_rules() -> list[Rule]:
    return [
        Rule(name="half_attention_nonfinite", when="half_attention_nonfinite", directive="fp32"),
        Rule(name="math_backend_half", when="math_backend_half"),
        Rule(name="logit_over_tau", when="logit_over_tau"),
        Rule(name="cross_doc_leak", when="cross_doc_leak"),
    ]


def matches(rule: Rule, r: StepReport, *, logit_tau: float) -> Iterator[tuple[str, str | None, dict[str, Any]]]:
    """``(dedupe key, site, detail)`` for every observation in ``r`` that the rule is about."""
    if rule.when == "half_attention_nonfinite":
        for s in r.sites:
            if ((s.nan or s.inf) and s.kind == "attention" and s.phase == "forward" and s.stage == "train"
                    and r.stage == "train" and is_half(s.dtype) and not s.site.endswith(QUERY_SUFFIX)):
                yield s.site, s.site, {"dtype": s.dtype, "nan": s.nan, "inf": s.inf}
    elif rule.when == "math_backend_half":
        for c in r.sdpa:
            if c.backend == "math" and is_half(c.dtype) and c.stage == "train":
                yield f"{c.site}:{c.dtype}", c.site, {"dtype": c.dtype, "reason": c.reason, "shape": c.shape}
    elif rule.when == "logit_over_tau":
        for lg in r.logits:
            if lg.bound > logit_tau:  # the same figure as nanwatch_attention_logit_max
                yield lg.layer, lg.layer, {"bound": lg.bound, "exact": lg.exact, "tau": logit_tau,
                                           "source": lg.source}
    elif rule.when == "cross_doc_leak":
        if any(f.cross_doc_leak for f in r.fingerprints):
            yield "run", None, {}


def precision_helps(r: StepReport) -> bool:
    """Whether a precision directive (``fp32``, ``fused``) can cure what ``r`` shows: only a half-precision
    overflow born in attention or the logits, in training. The birth decides where the report names one (the
    incident's rerun or drill-down); else the step's first offender, which is the birth when no rerun ran
    (attention downstream of an MLP's NaN comes after it, so the MLP is first). Never for a step classified
    ``data_mask``, ``not_reproducible`` or ``replica_divergence``, an optimizer or parameter birth, a non-finite query (born
    upstream), an eval or generate stage value, or a gradient overflow that dynamic loss scaling handled."""
    if r.stage != "train" or r.scaler_overflow:
        return False
    inc = r.incident
    if inc is not None:
        # a replica divergence is silent data corruption on a host: no attention path cures it
        if inc.cls in ("data_mask", "not_reproducible", "optimizer", "replica_divergence") or inc.phase == "optimizer":
            return False
        if inc.birth_kind is not None:
            return inc.birth_kind in _PRECISION_KINDS and not (inc.birth or "").endswith(QUERY_SUFFIX)
    if r.first_offender is None or r.first_offender_stage not in (None, "train"):
        return False
    if r.first_offender_phase == "optimizer" or r.first_offender.endswith(QUERY_SUFFIX):
        return False
    first = next((s for s in r.sites if s.site == r.first_offender and s.phase == r.first_offender_phase
                  and s.stage == (r.first_offender_stage or "train")), None)
    # a detail or job report may name a first offender whose site it does not carry: then trust the rule's match
    return first is None or (first.kind in _PRECISION_KINDS and is_half(first.dtype))


def remedy(rule: Rule, r: StepReport) -> Mode | None:
    """The directive the rule asks for, given where the step's non-finite value was born: a precision
    fallback only helps a precision problem (``precision_helps``); anything else gets none (the weight guard
    has skipped the step; the incident pages)."""
    if rule.directive is None:
        return None
    if rule.directive in ("fp32", "fused") and not precision_helps(r):
        return None
    return rule.directive
