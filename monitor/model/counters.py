"""The collector's counters, each with one owner.

* **Counter families** (``CounterFamily``): the per-run totals a report adds to (``RunState.counters``, the
  store's ``counters`` table). One table, ``FAMILIES``, maps each family's key -- the word stored in the
  database, never renamed -- to the metric it is exposed as, its labels and its help: the fold counts through
  these constants, the state migrates stored rows by them, the API sums them, the exporter renders them and
  the metric-name table (``nanwatch.monitor.read.metric_names``) takes their specs from here.
* **Request counters** (``RequestCounters``): reports applied and resent, requests refused by reason. One
  small object, so that each count has one writer: the ledger counts what it applied, and the one refusal
  handler (``nanwatch.monitor.web.exception_handlers``) counts what was refused.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

__all__ = ["ENDED_FAMILY", "FAMILIES", "INCIDENT", "JOB_SKIPPED", "LOSS_SCALE_OVERFLOW", "NONFINITE",
           "NOT_REPRODUCIBLE", "ROLLOUT_EVENT", "ROLLOUT_NONFINITE", "RUN_NONFINITE", "SDPA", "SITE", "SKIPPED", "SPIKE",
           "UNMEASURED", "WEIGHT_SYNC_MISMATCHES", "WEIGHT_SYNCS_UNVERIFIABLE", "WEIGHT_SYNCS_VERIFIED", "CounterFamily", "RequestCounters"]


@dataclass(frozen=True, slots=True)
class CounterFamily:
    """One family of per-run counter totals and the counter metric it is exposed as."""

    key: str
    """The family as stored (``RunState.counters`` keys, the store's ``counters.family`` column): a stored
    value, so never renamed."""
    metric: str
    """The exposed counter's name (public API: dashboards, alert rules and people's queries use it)."""
    labels: tuple[str, ...]
    """The stored labels, in order: the metric's labels after ``run_id``."""
    help: str
    """The metric's help; empty for a family that adds to another family's metric (``JOB_SKIPPED``)."""

    @property
    def per_rank(self) -> bool:
        """Labelled by rank: its series are the rank's, admitted (and capped) with it."""
        return self.labels[:1] == ("rank",)


NONFINITE = CounterFamily(
    "nonfinite", "nanwatch_nonfinite_values_total", ("rank", "pass", "kind"),
    "Measured calls, at all sites, whose tensor held a NaN (kind=nan) or an Inf and no NaN (kind=inf); "
    "pass: forward or backward. Exact element counts are in the incident drill-down.")
SITE = CounterFamily(
    "site", "nanwatch_site_nonfinite_values_total", ("site", "pass"),
    "Measured calls per site whose tensor held a NaN or an Inf, summed over ranks.")
SDPA = CounterFamily(
    "sdpa", "nanwatch_sdpa_calls_total", ("backend", "dtype", "stage"),
    "Attention calls by the SDPA backend that ran (stage: train, eval or generate).")
SKIPPED = CounterFamily(
    "skipped", "nanwatch_skipped_steps_total", ("rank",),
    "Optimizer steps the weight guard skipped because the step saw a non-finite value. Steps whose "
    "non-finite gradients a loss scaler handled are not counted (nanwatch_loss_scale_overflows_total).")
JOB_SKIPPED = CounterFamily(
    "job_skipped", SKIPPED.metric, (),
    "")  # a job report's skipped step: every rank it covered skipped it, so it adds to each rank's series
INCIDENT = CounterFamily(
    "incident", "nanwatch_incidents_total", ("class",),
    "Non-finite steps classified by the trainer: by its differential re-run (precision, data_mask, "
    "not_reproducible, not_classified), or born in the optimizer update (optimizer), summed over "
    "ranks; and data-parallel replicas whose parameters stopped agreeing (replica_divergence: silent data "
    "corruption without a NaN), counted once per step whichever ranks report it.")
UNMEASURED = CounterFamily(
    "unmeasured", "nanwatch_unmeasured_steps_total", ("reason",),
    "Step reports, summed over ranks, in which part of the step went unmeasured, by reason "
    "(no_forward, no_attention, compiled, no_logits, no_logit_bound).")
RUN_NONFINITE = CounterFamily(
    "run_nonfinite", "nanwatch_run_nonfinite_values_total", ("pass", "kind", "stage"),
    "Measured calls, at all sites and on all ranks, whose tensor held a NaN (kind=nan) or an Inf and "
    "no NaN (kind=inf), by the sites' stage (train, eval: an evaluation's report, generate: inside "
    "generate(), e.g. RLHF rollouts): summed over stages, the sum over ranks of "
    "nanwatch_nonfinite_values_total, counted from job reports in job mode (so it holds even where a "
    "rank's detail report is missing). Steps whose non-finite gradients a loss scaler handled are "
    "not counted (nanwatch_loss_scale_overflows_total).")
LOSS_SCALE_OVERFLOW = CounterFamily(
    "loss_scale_overflow", "nanwatch_loss_scale_overflows_total", (),
    "Training steps whose non-finite gradients dynamic loss scaling (a GradScaler) handled: it "
    "skipped the update and lowered the scale. Normal operation, counted once per step however many "
    "ranks report it; these steps add nothing to the non-finite counters.")
NOT_REPRODUCIBLE = CounterFamily(
    "not_reproducible", "nanwatch_not_reproducible_incidents_total", ("host",),
    "Incidents the trainer's differential re-run could not reproduce (class not_reproducible), by the "
    "host that saw them (the hostname of Incident.host, cleaned). A host that computes a NaN its own "
    "re-run does not is the silent-data-corruption signal: sum by (host) over runs.")
WEIGHT_SYNCS_VERIFIED = CounterFamily(
    "weight_sync_verified", "nanwatch_weight_syncs_verified_total", (),
    "Weight syncs verified: a rollout worker's weight fingerprints of a weight version equal the trainer's "
    "(one per worker and version; PUT /v1/runs/{run_id}/weights/{version}).")
WEIGHT_SYNC_MISMATCHES = CounterFamily(
    "weight_sync_mismatch", "nanwatch_weight_sync_mismatches_total", (),
    "Weight syncs that failed verification: a rollout worker's weight fingerprints of a weight version "
    "differ from the trainer's (a tensor differs, is missing or is extra); each is a weight_sync_mismatch "
    "event naming the version, the worker and the first differing tensors.")
WEIGHT_SYNCS_UNVERIFIABLE = CounterFamily(
    "weight_sync_unverifiable", "nanwatch_weight_syncs_unverifiable_total", (),
    "Weight syncs that could not be verified: a rollout worker's tensors all agree with the trainer's except "
    "dtypes or shapes that no cast the trainer published explains (e.g. an fp8 copy with no fp8 cast "
    "published); each is a weight_sync_unverifiable event naming them. Not a failed sync.")

ROLLOUT_NONFINITE = CounterFamily(
    "rollout_nonfinite", "nanwatch_rollout_nonfinite_values_total", (),
    "Non-finite values (NaN or Inf) in the rollout's own log-probabilities (Monitor.rlhf "
    "rollout_logprobs=), inside the mask, summed over steps and ranks: counted from job reports in job "
    "mode, from rank reports otherwise, never from detail reports. The sampler produced them; nothing "
    "replaced them. Padding outside the mask is not counted here (RlhfStat.nonfinite rollout_logprobs_pad).")
ROLLOUT_EVENT = CounterFamily(
    "rollout_event", "nanwatch_rollout_mismatch_events_total", ("cause",),
    "Rollout mismatches the trainer classified (RolloutEvent), by cause: stale_weights (the weight sync's "
    "verdict: a worker's fingerprints mismatched, or it lags), jump (a sudden rise with no verdict to go on: "
    "weights not synced, or from the wrong version), shift (a sudden rise with verified weights: the rollout "
    "engine's scoring changed), drift (precision or kernels), offset (sampler semantics: temperature, "
    "top-p/top-k on one side only), outliers (a few sequences far off). Counted from job and rank "
    "reports (each rank's own classification in per-rank mode), never from detail reports.")
SPIKE = CounterFamily(
    "spike", "nanwatch_spikes_total", ("site_kind",),
    "Steps in which at least one site of a kind jumped k times (spike_factor, 10 by default) over its running "
    "baseline without overflowing (Spike), by site kind (a backward site counts as grad; the loss as loss): a "
    "precursor, not an incident. Counted once per step and kind whichever ranks report it, from job and rank "
    "reports, never from detail reports; the sites are in the run's spike events.")

#: every counter family, by its stored key
FAMILIES: dict[str, CounterFamily] = {f.key: f for f in (
    NONFINITE, SITE, SDPA, SKIPPED, JOB_SKIPPED, INCIDENT, UNMEASURED, RUN_NONFINITE, LOSS_SCALE_OVERFLOW,
    NOT_REPRODUCIBLE, ROLLOUT_NONFINITE, ROLLOUT_EVENT, WEIGHT_SYNCS_VERIFIED, WEIGHT_SYNC_MISMATCHES, SPIKE,
    WEIGHT_SYNCS_UNVERIFIABLE)}

#: a row of the counters table that is no counter: whether the run ended normally (1) or not (0). Rendered
#: as the gauge ``nanwatch_run_ended`` from ``RunState.ended``, not from the row
ENDED_FAMILY = "ended"


class RequestCounters:
    """Totals since the process started (they feed ``nanwatch_collector_*_total``)."""

    __slots__ = ("accepted", "duplicates", "rejected")

    def __init__(self) -> None:
        self.accepted = 0
        """Step reports applied to the state."""
        self.duplicates = 0
        """Step reports already applied (resent by the trainer), acknowledged and ignored."""
        self.rejected: Counter[str] = Counter()
        """Requests refused with a 4xx or 503, by reason."""

    def applied(self, accepted: int, duplicates: int) -> None:
        """A batch was committed: ``accepted`` new reports, ``duplicates`` resent ones."""
        self.accepted += accepted
        self.duplicates += duplicates

    def reject(self, reason: str) -> None:
        """A request was refused for ``reason``."""
        self.rejected[reason] += 1

    def version(self) -> tuple[int, int, int]:
        """Changes whenever a count does (the exporter reuses a render only while nothing changed)."""
        return self.accepted, self.duplicates, sum(self.rejected.values())
