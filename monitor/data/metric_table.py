"""The one table of metric names, types, labels and help. The exporter is driven by it; dashboards, alert
rules and tests are checked against it. Every name here is public API (dashboards, alert rules and
people's queries use them): rename none. The first group is the project's original public set.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from nanwatch.monitor.data import counters

__all__ = ["ATTENTION_LOGIT_MAX", "ATTENTION_MODE", "CAPS_HIT", "COLLECTOR_LOGIT_TAU", "DIRECTIVE_INFO",
           "EVENTS", "FIRST_OFFENDER_INFO", "INCIDENTS", "LAST_REPORT_TIMESTAMP", "LATEST_INCIDENT_INFO",
           "LATEST_OFFENDER_INFO", "LIVE_RANKS", "LOSS_SCALE", "LOSS_SCALE_OVERFLOWS", "MATH_FALLBACK_INFO",
           "METRICS", "MetricSpec", "NONFINITE_VALUES", "NOT_REPRODUCIBLE_INCIDENTS", "RANK_CRASHED",
           "RENDER_ERRORS", "REPORTS_ACCEPTED", "REPORTS_DROPPED", "REPORTS_DUPLICATE", "REQUESTS_REJECTED", "RLHF_STAT",
           "ROLLOUT_MISMATCH", "ROLLOUT_MISMATCH_EVENTS", "ROLLOUT_NONFINITE_VALUES", "RUN_ENDED",
           "RUN_NONFINITE_VALUES", "RUN_WORLD_SIZE", "SDPA_CALLS", "SERIES_DROPPED",
           "SITE_NONFINITE_VALUES", "SKIPPED_STEPS", "SPIKES", "TENSOR_HEADROOM_RATIO", "UNMEASURED_STEPS",
           "WEIGHT_SYNCS_UNVERIFIABLE", "WEIGHT_SYNCS_VERIFIED", "WEIGHT_SYNC_LAG", "WEIGHT_SYNC_MISMATCHES", "family"]


@dataclass(frozen=True, slots=True)
class MetricSpec:
    name: str
    """Exposed name; counters end in ``_total``."""
    type: Literal["counter", "gauge"]
    labels: tuple[str, ...]
    help: str


def _counted(fam: counters.CounterFamily) -> MetricSpec:
    """A counter family's metric, as its owner (``nanwatch.monitor.data.counters``) describes it."""
    return MetricSpec(fam.metric, "counter", ("run_id", *fam.labels), fam.help)


# the original public set
NONFINITE_VALUES = _counted(counters.NONFINITE)
SITE_NONFINITE_VALUES = _counted(counters.SITE)
SDPA_CALLS = _counted(counters.SDPA)
ATTENTION_LOGIT_MAX = MetricSpec(
    "nanwatch_attention_logit_max", "gauge", ("run_id", "layer"),
    "Upper bound on the max scaled QK logit in the latest step, max over live ranks and heads.")
TENSOR_HEADROOM_RATIO = MetricSpec(
    "nanwatch_tensor_headroom_ratio", "gauge", ("run_id", "site_kind"),
    "Max amax/finfo.max in the latest step over sites and live ranks (1 is the overflow edge).")
ATTENTION_MODE = MetricSpec(
    "nanwatch_attention_mode", "gauge", ("run_id", "rank", "mode"),
    "The attention path each rank applies now (always 1).")
DIRECTIVE_INFO = MetricSpec(
    "nanwatch_directive_info", "gauge", ("run_id", "mode", "version"),
    "The run's active directive (always 1).")
LAST_REPORT_TIMESTAMP = MetricSpec(
    "nanwatch_last_report_timestamp_seconds", "gauge", ("run_id", "rank"),
    "Unix time the collector last received a report from the rank. Kept after the rank's TTL while "
    "it is silent without a final report or a crash (hung: for NANWATCH_SILENT_KEEP_S); dropped at "
    "once when it ends normally.")
REPORTS_DROPPED = MetricSpec(
    "nanwatch_reports_dropped_total", "counter", ("run_id", "rank"),
    "Reports the trainer could not deliver (cumulative per trainer incarnation).")
# added since, by the collector
SKIPPED_STEPS = _counted(counters.SKIPPED)
INCIDENTS = _counted(counters.INCIDENT)
FIRST_OFFENDER_INFO = MetricSpec(
    "nanwatch_first_offender_info", "gauge", ("run_id", "site", "pass", "stage", "rank"),
    "Where the run's first non-finite value was reported (always 1; from the event log).")
RLHF_STAT = MetricSpec(
    "nanwatch_rlhf_stat", "gauge", ("run_id", "stat"),
    "Policy-gradient health in the latest step over live ranks: ratio_max, kl_*_max (max over "
    "ranks), logprob_min (min), clip_fraction, kl_*_mean, advantage_std (mean over ranks).")
COLLECTOR_LOGIT_TAU = MetricSpec(
    "nanwatch_collector_logit_tau", "gauge", (),
    "The attention-logit threshold tau of the collector's rules (NANWATCH_LOGIT_TAU).")
UNMEASURED_STEPS = _counted(counters.UNMEASURED)
EVENTS = MetricSpec(
    "nanwatch_events_total", "counter", ("run_id", "kind"),
    "Events recorded in the run's event log (first non-finite, math fallback, directive changes...).")
LIVE_RANKS = MetricSpec(
    "nanwatch_live_ranks", "gauge", ("run_id",),
    "Ranks that reported (any report, heartbeats included) within the TTL.")
# added for job-level reporting (wire 1.4): the run-level figures alerts and dashboards are written on
RUN_NONFINITE_VALUES = _counted(counters.RUN_NONFINITE)
RUN_WORLD_SIZE = MetricSpec(
    "nanwatch_run_world_size", "gauge", ("run_id",),
    "The run's world size (max over its live ranks' and job reports); compare with "
    "nanwatch_live_ranks: a rank that never reported, or stopped, is missing.")
# added for lifecycle (wire 1.5 ``raised``)
RANK_CRASHED = MetricSpec(
    "nanwatch_rank_crashed", "gauge", ("run_id", "rank"),
    "1 for each rank whose step raised (the rank crashed; the exception type is in the run's "
    "rank_crashed event). Kept while the collector holds the run, until the rank reports again "
    "from a restarted process.")
# added for pages an on-call engineer can trust (wire 1.6 final, loss scaling; issue #18)
LATEST_OFFENDER_INFO = MetricSpec(
    "nanwatch_latest_offender_info", "gauge", ("run_id", "stage", "site", "pass", "rank"),
    "Where this incident began (always 1; one series per run and stage): the first offender of the "
    "run's most recent non-finite report in that stage, with the rank that held it (loss-scale "
    "overflows excepted). nanwatch_first_offender_info keeps the run's first.")
MATH_FALLBACK_INFO = MetricSpec(
    "nanwatch_math_fallback_info", "gauge", ("run_id", "site", "dtype", "rank"),
    "The run's latest training attention call that ran on the SDPA math backend in half precision "
    "(always 1; one series per run): its site, dtype and the rank that reported it.")
LOSS_SCALE_OVERFLOWS = _counted(counters.LOSS_SCALE_OVERFLOW)
LOSS_SCALE = MetricSpec(
    "nanwatch_loss_scale", "gauge", ("run_id",),
    "The loss scale after the latest step, min over live ranks (absent without dynamic loss "
    "scaling): a collapsing scale is the incident, not an overflow.")
RUN_ENDED = MetricSpec(
    "nanwatch_run_ended", "gauge", ("run_id",),
    "1 once every rank of the run sent its final report (the run ended normally); kept until the "
    "run's retention, gone when a new incarnation reports.")
# added for the incident capsule (wire 1.7 ``Incident.capsule``; issue #20)
NOT_REPRODUCIBLE_INCIDENTS = MetricSpec(
    counters.NOT_REPRODUCIBLE.metric, "counter", ("run_id", "namespace", "host"),
    "Incidents that point at a host, by the run-id namespace of the run (the glob of the scoped token that "
    "owns it, * for none) and the host: the trainer's differential re-run could not reproduce them (class "
    "not_reproducible; the hostname of Incident.host, cleaned), or the host's data-parallel replica disagreed "
    "with the others (class replica_divergence: one count per host named). A host that computes a NaN its own "
    "re-run does not, or whose parameters drift from its replicas', is the silent-data-corruption signal: sum "
    "by (namespace, host) over runs (one namespace's reports never count on another's host). Hosts are capped per run and per namespace (NANWATCH_MAX_HOSTS_*).")
LATEST_INCIDENT_INFO = MetricSpec(
    "nanwatch_latest_incident_info", "gauge", ("run_id", "class", "host", "rank", "capsule"),
    "The run's latest incident of each class (always 1; one series per run and class): the host and "
    "rank that saw it and where its capsule was written (empty when none was): replay it with "
    "`nanwatch replay CAPSULE`.")
# added for the rollout mismatch (wire 1.8 ``RlhfStat.rollout``, ``rollout_events``; issue #28)
ROLLOUT_MISMATCH = MetricSpec(
    "nanwatch_rollout_mismatch", "gauge", ("run_id", "stat"),
    "The rollout (sampler) against the trainer on the same tokens in the latest step, dlogp = trainer - "
    "rollout over unmasked finite tokens; stat is a RolloutStat field (nanwatch.monitor.data.rollout_figures.STATS): "
    "the job report's, or combined over live ranks: abs_mean, mean, rms, k3_mean, truncated_fraction "
    "token-weighted (exact); abs_max, seq_ratio_max, seq_abs_mean_max max; seq_ratio_min, prob_correlation "
    "min; abs_p99 max (an upper bound); logprob_slope the rank's farthest from 1.")
ROLLOUT_NONFINITE_VALUES = _counted(counters.ROLLOUT_NONFINITE)
ROLLOUT_MISMATCH_EVENTS = _counted(counters.ROLLOUT_EVENT)
WEIGHT_SYNCS_VERIFIED = _counted(counters.WEIGHT_SYNCS_VERIFIED)
WEIGHT_SYNC_MISMATCHES = _counted(counters.WEIGHT_SYNC_MISMATCHES)
# added for dtype-aware verification and lag (issue #36)
WEIGHT_SYNCS_UNVERIFIABLE = _counted(counters.WEIGHT_SYNCS_UNVERIFIABLE)
WEIGHT_SYNC_LAG = MetricSpec(
    "nanwatch_weight_sync_lag_versions", "gauge", ("run_id", "worker"),
    "Per rollout worker that posted weight fingerprints: the versions the trainer published after the worker's "
    "latest verified one, when it lags (two or more, or one it posted nothing verified for past "
    "NANWATCH_WEIGHT_SYNC_WAIT_S), else 0. In memory; exported while the run is live.")
# added for spikes (wire 1.9 ``StepReport.spikes``; issue #29)
SPIKES = _counted(counters.SPIKE)
REPORTS_ACCEPTED = MetricSpec(
    "nanwatch_collector_reports_accepted_total", "counter", (),
    "Step reports applied to the state.")
REPORTS_DUPLICATE = MetricSpec(
    "nanwatch_collector_reports_duplicate_total", "counter", (),
    "Step reports already applied (resent by the trainer), acknowledged and ignored.")
REQUESTS_REJECTED = MetricSpec(
    "nanwatch_collector_requests_rejected_total", "counter", ("reason",),
    "Requests refused with a 4xx or 503, by reason.")
SERIES_DROPPED = MetricSpec(
    "nanwatch_collector_series_dropped_total", "counter", ("run_id",),
    "Series not created because the run hit the per-run series cap.")
CAPS_HIT = MetricSpec(
    "nanwatch_collector_caps_hit_total", "counter", ("cap",),
    "Times a collector cap refused or dropped something: runs, incarnations and "
    "incarnations_per_namespace (the request got 429), weight_sync, weight_bytes_per_namespace and "
    "weight_versions_per_namespace (a weight-sync set got 429), events, events_per_namespace and total_events "
    "(not recorded), memory (above NANWATCH_MEMORY_LIMIT_MIB: a new "
    "run, incarnation or rank got 429, or new series and events were not kept), hosts_per_run and "
    "hosts_per_namespace (a not-reproducible incident on a host beyond NANWATCH_MAX_HOSTS_* was not "
    "counted).")
RENDER_ERRORS = MetricSpec(
    "nanwatch_collector_render_errors_total", "counter", ("reason",),
    "What /metrics renders had to leave out or distrust, by reason (one count per render): run_left_out (a "
    "run whose series could not be built was left out of the render, and an event recorded in its log; "
    "every other run was rendered), rollout_distrusted (a run's ranks' rollout token counts were more than "
    "8x apart: its token-weighted rollout figures are the worst rank's), count_clamped (a run's summed "
    "rollout counts were cut to 2^53-1).")

#: in the order they are exposed (the original public set first)
_SPECS = (
    NONFINITE_VALUES, SITE_NONFINITE_VALUES, SDPA_CALLS, ATTENTION_LOGIT_MAX, TENSOR_HEADROOM_RATIO,
    ATTENTION_MODE, DIRECTIVE_INFO, LAST_REPORT_TIMESTAMP, REPORTS_DROPPED, SKIPPED_STEPS, INCIDENTS,
    FIRST_OFFENDER_INFO, RLHF_STAT, COLLECTOR_LOGIT_TAU, UNMEASURED_STEPS, EVENTS, LIVE_RANKS,
    RUN_NONFINITE_VALUES, RUN_WORLD_SIZE, RANK_CRASHED, LATEST_OFFENDER_INFO, MATH_FALLBACK_INFO,
    LOSS_SCALE_OVERFLOWS, LOSS_SCALE, RUN_ENDED, NOT_REPRODUCIBLE_INCIDENTS, LATEST_INCIDENT_INFO,
    ROLLOUT_MISMATCH, ROLLOUT_NONFINITE_VALUES, ROLLOUT_MISMATCH_EVENTS, WEIGHT_SYNCS_VERIFIED, WEIGHT_SYNC_MISMATCHES,
    SPIKES, WEIGHT_SYNCS_UNVERIFIABLE, WEIGHT_SYNC_LAG,
    REPORTS_ACCEPTED, REPORTS_DUPLICATE, REQUESTS_REJECTED, SERIES_DROPPED, CAPS_HIT, RENDER_ERRORS,
)

METRICS: dict[str, MetricSpec] = {s.name: s for s in _SPECS}


def family(name: str) -> CounterMetricFamily | GaugeMetricFamily:
    """A fresh, empty family for ``name``, typed and labelled from the table."""
    spec = METRICS[name]
    cls = CounterMetricFamily if spec.type == "counter" else GaugeMetricFamily
    return cls(spec.name, spec.help, labels=spec.labels)
