"""The rollout mismatch, classified by its pattern over steps: reporter thread, host side, on the report that
is posted (the job's under job reports, so every classification speaks for the job).

Six causes, each an event with its figures and the remedy that fits; none of them ever asks for a precision
directive, since the trainer's attention is not where any of them comes from. What the weight sync knows
comes first (``nanwatch.hooks.rollout.sync_verdict``, asked of the collector only when a pattern is about to
raise an event):

* **stale_weights**: the pattern would be a jump, a drift or an offset, and the weight sync's verdict is stale
  (a rollout worker's fingerprints mismatched the trainer's, or it lags behind the published versions): the
  rollout sampled with other weights. Never a drift, an offset or an attribution on top (stale weights once
  became a "drift" three steps later, and an attribution then named a module that explained 2 % of it).
  Reported once per stale cause (the worker and how: mismatch or lag), again once it was verified since.
  While a worker's set of the latest version may still be on its way (``pending``), the decision waits for
  it, at most :data:`SUSTAIN` steps (a silent worker is stale one publish later, when it lags).
* **jump**: mean |Δlogp| at least :data:`JUMP_FACTOR` times its median over the previous steps (and at least
  :data:`JUMP_FLOOR`), with no verdict to go on (the run does not verify its syncs): the rollout scored with
  other weights (a sync that did not happen, or from the wrong version: TRL #5312 went from 0.015 to 0.201).
  Reported once; again only after the mismatch came back down. While it (or stale weights) lasts, no drift or
  offset is declared on top of it.
  A rise that a temperature explains is not a jump: when the rollout's logprobs follow the trainer's on a
  line of slope ≠ 1 that leaves little of the mismatch (``fit_residual_rms`` at most :data:`LINE_EXPLAINS` of
  the rms), it is the offset below (a temperature switched on one side once paged as a weight-sync jump).
* **shift**: the same sudden rise with verified weights: not the sync (every worker loaded the published
  version), but the rollout engine's scoring changed (sampler settings, kernels or precision, misaligned
  tokens). The offset or drift that follows, if it lasts, is declared as usual.
* **offset**: the sampler's semantics differ from the trainer's: rollout logprobs are a near-linear function of
  the trainer's with slope ≠ 1 (a temperature applied on one side only: the slope is 1/T), or Δlogp has one
  sign for most tokens (top-p/top-k renormalising on one side).
* **outliers**: a few sequences (at most a quarter) far off the rest (``RolloutStat.outlier_sequences``).
* **drift**: a symmetric mismatch above :data:`DRIFT_FLOOR` for :data:`SUSTAIN` steps in a row, with verified
  weights or none published: precision or kernels (the attribution names the module, and only then runs).
  Reported when it sets in and each time it doubles.

Healthy same-weights, same-dtype rollouts differ by ~1e-7 (KV-cache against a full forward, fp32); a bf16
rollout engine against an fp32 or bf16 trainer by 1e-3 to 1e-2, which is a drift worth one event, not a page
(the page, ``NanwatchRolloutDrift``, is Prometheus's, on a sustained figure).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable

from nanwatch.hooks.rollout.sync_verdict import UNTRACKED, SyncVerdict
from nanwatch.wire import RolloutEvent, RolloutStat

__all__ = ["DRIFT_FLOOR", "JUMP_FACTOR", "JUMP_FLOOR", "MismatchClassifier", "SUSTAIN"]

JUMP_FACTOR, JUMP_FLOOR = 5.0, 0.01
DRIFT_FLOOR = 1e-3
OFFSET_SLOPE, OFFSET_SIGN = 0.1, 0.5  # |slope − 1| above this; |mean| above this fraction of the rms
SUSTAIN = 3  # steps in a row before an offset or a drift is reported
LINE_EXPLAINS = 0.5  # a line leaving at most this fraction of the rms explains the mismatch (a temperature)
_BASELINE = 20  # steps of history the jump compares with
_QUIET = 50  # an outlier event repeats at most this often, unless the worst sequence doubled
_TEXT = 1000  # the wire's ShortText bound on evidence
_FIGURES = ("abs_mean", "abs_p99", "mean", "rms", "k3_mean", "truncated_fraction", "prob_correlation",
            "logprob_slope", "seq_ratio_max", "seq_abs_mean_max")


def _figures(r: RolloutStat, **extra: float) -> dict[str, float]:
    out = {k: v for k in _FIGURES if (v := getattr(r, k)) is not None}
    out.update({k: float(v) for k, v in extra.items()})
    return out


def _a_temperature(r: RolloutStat) -> bool:
    """The rollout's logprobs are a line of the trainer's with slope ≠ 1 that explains the mismatch: a
    temperature applied by one side only (slope 1/T), not other weights (which scatter around the line)."""
    slope, residual = r.logprob_slope, r.fit_residual_rms
    return (slope is not None and abs(slope - 1.0) > OFFSET_SLOPE and residual is not None and bool(r.rms)
            and residual <= LINE_EXPLAINS * r.rms)


class MismatchClassifier:
    """Turns each step's :class:`RolloutStat` into events. Reporter thread only.

    A pattern (a rise, an offset, a drift) is a candidate until the weight sync's verdict decides what it is
    (module docstring). A ``pending`` verdict (a worker has not posted the latest version yet, and is not late)
    defers the decision to the next step, at most :data:`SUSTAIN` steps; then it is decided as ``untracked``.

    Example usage::

        classify = MismatchClassifier()
        events = classify.observe(report.step, report.rlhf.rollout, sync=verdicts)   # [] on most steps
    """

    def __init__(self) -> None:
        self._history: deque[float] = deque(maxlen=_BASELINE)
        self._held_from: float | None = None  # the baseline a jump or stale weights left; None: not held
        self._shifted_from: float | None = None  # the baseline a shift left; None: not in one
        self._offset_run = self._drift_run = 0
        self._offset_told = False
        self._drift_told: float | None = None  # the mismatch last reported as a drift
        self._outliers_told: tuple[int, float] | None = None  # (step, worst sequence) of the last event
        self._stale_told: str | None = None  # the stale cause last reported (SyncVerdict.key)
        self._waited = 0  # steps a candidate waited for a pending verdict

    @property
    def held(self) -> bool:
        """A jump or stale weights explain the mismatch now: nothing of it is for an attribution."""
        return self._held_from is not None

    def observe(self, step: int, r: RolloutStat, *,
                sync: Callable[[], SyncVerdict] | None = None) -> list[RolloutEvent]:
        """The events step ``step``'s figures raise (at most one per cause). ``sync``: the weight sync's
        verdict (``SyncVerdicts``), asked only when a rise, an offset or a drift is a candidate."""
        if r.abs_mean is None or not r.tokens:
            return []
        outliers = [e for e in (self._outliers(step, r),) if e]
        if self._held_from is not None:
            if r.abs_mean >= 2 * max(self._held_from, DRIFT_FLOOR):  # still up: the jump's, nothing else
                self._offset_run = self._drift_run = 0
                return outliers
            self._held_from = None  # back down: the next rise is news again
        if self._shifted_from is not None and r.abs_mean < 2 * max(self._shifted_from, DRIFT_FLOOR):
            self._shifted_from = None
        rise, offset, drift = self._rise(step, r), self._offset(step, r), self._drift(step, r)
        if rise is None and offset is None and drift is None:
            self._waited = 0
            self._history.append(r.abs_mean)
            return outliers
        v = sync() if sync is not None else UNTRACKED
        if v.state == "pending" and self._waited < SUSTAIN:
            self._waited += 1  # the worker's set of the latest version may still come: decide next step
            return outliers
        self._waited = 0
        return self._decided(step, r, v, rise, offset, drift) + outliers

    def _decided(self, step: int, r: RolloutStat, v: SyncVerdict, rise: RolloutEvent | None,
                 offset: RolloutEvent | None, drift: RolloutEvent | None) -> list[RolloutEvent]:
        """The candidates, decided by the verdict ``v`` (module docstring); commits what is told."""
        if v.state == "stale":
            base = rise.figures["baseline"] if rise is not None else (
                statistics.median(self._history) if self._history else r.abs_mean)
            self._held_from, self._offset_run, self._drift_run = base, 0, 0
            return [e for e in (self._stale(step, r, v, rise is not None),) if e]
        if v.state == "verified":
            self._stale_told = None
        detail = f"; {v.detail}" if v.detail else ""
        if rise is not None and v.state != "verified":
            self._held_from, self._offset_run, self._drift_run = rise.figures["baseline"], 0, 0
            return [rise.model_copy(update={"evidence": (rise.evidence + detail)[:_TEXT]})]
        events = []
        if rise is not None:  # verified weights: not the sync
            self._shifted_from = rise.figures["baseline"]
            events.append(rise.model_copy(update={
                "cause": "shift", "evidence": (rise.evidence + detail)[:_TEXT],
                "remedy": "not the weight sync: the rollout engine's scoring changed (sampler settings such as "
                          "top-p/top-k or a temperature, kernels or precision, or tokens misaligned by a "
                          "position); compare its configuration before and after this step"}))
        if offset is not None:
            self._offset_told = True
            events.append(offset)
        if drift is not None:
            self._drift_told = r.abs_mean
            events.append(drift.model_copy(update={"evidence": (drift.evidence + detail)[:_TEXT]}))
        self._history.append(r.abs_mean)
        return events

    def _stale(self, step: int, r: RolloutStat, v: SyncVerdict, sudden: bool) -> RolloutEvent | None:
        if v.key == self._stale_told:
            return None  # this stale cause was reported; it is still the reason
        self._stale_told = v.key
        pattern = "a sudden rise" if sudden else "a sustained mismatch"
        return RolloutEvent(
            cause="stale_weights", step=step,
            figures=_figures(r, **({"weight_version": v.version} if v.version is not None else {})),
            evidence=f"{pattern} (mean |Δlogp| {r.abs_mean:.4g} at step {step}) while {v.detail}"[:_TEXT],
            remedy="the rollout sampled with other weights than the trainer's: fix that worker's weight sync "
                   "(nanwatch status shows each worker's posted and verified versions); not precision, not the "
                   "sampler: no attribution is run")

    def _rise(self, step: int, r: RolloutStat) -> RolloutEvent | None:
        """A sudden rise (the jump's pattern) not explained by a temperature, or None."""
        if len(self._history) < SUSTAIN or _a_temperature(r) or self._shifted_from is not None:
            return None
        base = statistics.median(self._history)
        if r.abs_mean < max(JUMP_FACTOR * base, JUMP_FLOOR):
            return None
        factor = r.abs_mean / base if base > 0 else float("inf")
        return RolloutEvent(
            cause="jump", step=step, figures=_figures(r, baseline=base, factor=min(factor, 1e300)),
            evidence=f"mean |Δlogp| {r.abs_mean:.4g} at step {step}, {factor:.3g}× its median {base:.3g} over "
                     f"the previous {len(self._history)} steps",
            remedy="the rollout scored with other weights: check the last weight sync (compare "
                   "nanwatch.fingerprint of the version the rollout engine loaded with the trainer's: "
                   "Monitor.publish_weights, nanwatch.weight_sync)")

    def _offset(self, step: int, r: RolloutStat) -> RolloutEvent | None:
        slope_off = r.logprob_slope is not None and abs(r.logprob_slope - 1.0) > OFFSET_SLOPE
        one_sided = r.mean is not None and r.rms and abs(r.mean) > OFFSET_SIGN * r.rms
        if not ((slope_off or one_sided) and r.abs_mean >= DRIFT_FLOOR):
            self._offset_run, self._offset_told = 0, False
            return None
        self._offset_run += 1
        if self._offset_told or self._offset_run < SUSTAIN:
            return None
        why = (f"rollout logprobs follow the trainer's with slope {r.logprob_slope:.3g} (a temperature "
               f"≈ {1 / r.logprob_slope:.3g} applied by one side only)" if slope_off and r.logprob_slope
               else f"Δlogp has one sign: mean {r.mean:.3g} against rms {r.rms:.3g}")
        return RolloutEvent(
            cause="offset", step=step, figures=_figures(r),
            evidence=f"{why}, for {self._offset_run} steps",
            remedy="sampler semantics differ: score with the sampler's temperature/top-p/top-k (or pass the raw "
                   "logprobs as rollout_logprobs); importance sampling would hide this, not fix it")

    def _outliers(self, step: int, r: RolloutStat) -> RolloutEvent | None:
        worst = r.seq_abs_mean_max or 0.0
        if not r.outlier_sequences or r.outlier_sequences > max(1, r.sequences // 4):
            return None
        told = self._outliers_told
        if told is not None and step - told[0] < _QUIET and worst < 2 * told[1]:
            return None
        self._outliers_told = (step, worst)
        return RolloutEvent(
            cause="outliers", step=step, figures=_figures(r, outlier_sequences=r.outlier_sequences,
                                                          sequences=r.sequences),
            evidence=f"{r.outlier_sequences} of {r.sequences} sequences far off the rest: the worst at mean "
                     f"|Δlogp| {worst:.3g} against {r.abs_mean:.3g} for the batch",
            remedy="look at those sequences (length, position, prompt); the attribution re-runs the worst")

    def _drift(self, step: int, r: RolloutStat) -> RolloutEvent | None:
        if r.abs_mean < DRIFT_FLOOR or self._offset_run:
            self._drift_run = 0
            return None
        self._drift_run += 1
        told = self._drift_told
        if self._drift_run < SUSTAIN or (told is not None and r.abs_mean < 2 * told):
            return None
        grown = "" if told is None else f", {r.abs_mean / told:.3g}× the {told:.3g} reported before"
        return RolloutEvent(
            cause="drift", step=step, figures=_figures(r),
            evidence=f"symmetric mismatch: mean |Δlogp| {r.abs_mean:.4g} (signed mean {r.mean:.3g}, "
                     f"p99 {r.abs_p99 or 0:.3g}) for {self._drift_run} steps{grown}",
            remedy="precision or kernels differ between rollout and trainer: see the attribution's module "
                   "(rollout_dtype) and match its precision on both sides")
