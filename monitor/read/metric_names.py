"""The one table of metric names, types, labels and help. The exporter is driven by it; dashboards, alert
rules and tests are checked against it. Every name here is public API (dashboards, alert rules and
people's queries use them): rename none. The first group is the project's original public set.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["METRICS", "MetricSpec", "family"]


@dataclass(frozen=True, slots=True)
class MetricSpec:
    name: str
    """Exposed name; counters end in ``_total``."""
    type: Literal["counter", "gauge"]
    labels: tuple[str, ...]
    help: str


_SPECS = (
    # the original public set
    MetricSpec("nanwatch_nonfinite_values_total", "counter", ("run_id", "rank", "pass", "kind"),
               "Measured calls, at all sites, whose tensor held a NaN (kind=nan) or an Inf and no NaN (kind=inf); "
               "pass: forward or backward. Exact element counts are in the incident drill-down."),
    MetricSpec("nanwatch_site_nonfinite_values_total", "counter", ("run_id", "site", "pass"),
               "Measured calls per site whose tensor held a NaN or an Inf, summed over ranks."),
    MetricSpec("nanwatch_sdpa_calls_total", "counter", ("run_id", "backend", "dtype", "stage"),
               "Attention calls by the SDPA backend that ran (stage: train, eval or generate)."),
    MetricSpec("nanwatch_attention_logit_max", "gauge", ("run_id", "layer"),
               "Upper bound on the max scaled QK logit in the latest step, max over live ranks and heads."),
    MetricSpec("nanwatch_tensor_headroom_ratio", "gauge", ("run_id", "site_kind"),
               "Max amax/finfo.max in the latest step over sites and live ranks (1 is the overflow edge)."),
    MetricSpec("nanwatch_attention_mode", "gauge", ("run_id", "rank", "mode"),
               "The attention path each rank applies now (always 1)."),
    MetricSpec("nanwatch_directive_info", "gauge", ("run_id", "mode", "version"),
               "The run's active directive (always 1)."),
    MetricSpec("nanwatch_last_report_timestamp_seconds", "gauge", ("run_id", "rank"),
               "Unix time the collector last received a report from the rank. Kept after the rank's TTL while "
               "it is silent without a final report or a crash (hung: for NANWATCH_SILENT_KEEP_S); dropped at "
               "once when it ends normally."),
    MetricSpec("nanwatch_reports_dropped_total", "counter", ("run_id", "rank"),
               "Reports the trainer could not deliver (cumulative per trainer incarnation)."),
    # added since, by the collector
    MetricSpec("nanwatch_skipped_steps_total", "counter", ("run_id", "rank"),
               "Optimizer steps the weight guard skipped because the step saw a non-finite value."),
    MetricSpec("nanwatch_incidents_total", "counter", ("run_id", "class"),
               "Non-finite steps classified by the trainer: by its differential replay (precision, data_mask, "
               "not_reproducible, not_classified), or born in the optimizer update (optimizer), summed over "
               "ranks."),
    MetricSpec("nanwatch_first_offender_info", "gauge", ("run_id", "site", "pass", "stage", "rank"),
               "Where the run's first non-finite value was reported (always 1; from the event log)."),
    MetricSpec("nanwatch_rlhf_stat", "gauge", ("run_id", "stat"),
               "Policy-gradient health in the latest step over live ranks: ratio_max, kl_*_max (max over "
               "ranks), logprob_min (min), clip_fraction, kl_*_mean, advantage_std (mean over ranks)."),
    MetricSpec("nanwatch_collector_logit_tau", "gauge", (),
               "The attention-logit threshold tau of the collector's rules (NANWATCH_LOGIT_TAU)."),
    MetricSpec("nanwatch_unmeasured_steps_total", "counter", ("run_id", "reason"),
               "Step reports, summed over ranks, in which part of the step went unmeasured, by reason "
               "(no_forward, no_attention, compiled, no_logits, no_logit_bound)."),
    MetricSpec("nanwatch_events_total", "counter", ("run_id", "kind"),
               "Events recorded in the run's event log (first non-finite, math fallback, directive changes...)."),
    MetricSpec("nanwatch_live_ranks", "gauge", ("run_id",),
               "Ranks that reported (any report, heartbeats included) within the TTL."),
    # added for job-level reporting (wire 1.4): the run-level figures alerts and dashboards are written on
    MetricSpec("nanwatch_run_nonfinite_values_total", "counter", ("run_id", "pass", "kind", "stage"),
               "Measured calls, at all sites and on all ranks, whose tensor held a NaN (kind=nan) or an Inf and "
               "no NaN (kind=inf), by the sites' stage (train, eval: an evaluation's report, generate: inside "
               "generate(), e.g. RLHF rollouts): summed over stages, the sum over ranks of "
               "nanwatch_nonfinite_values_total, counted from job reports in job mode (so it holds even where a "
               "rank's detail report is missing). Steps whose non-finite gradients a loss scaler handled are "
               "not counted (nanwatch_loss_scale_overflows_total)."),
    MetricSpec("nanwatch_run_world_size", "gauge", ("run_id",),
               "The run's world size (max over its live ranks' and job reports); compare with "
               "nanwatch_live_ranks: a rank that never reported, or stopped, is missing."),
    # added for lifecycle (wire 1.5 ``raised``)
    MetricSpec("nanwatch_rank_crashed", "gauge", ("run_id", "rank"),
               "1 for each rank whose step raised (the rank crashed; the exception type is in the run's "
               "rank_crashed event). Kept while the collector holds the run, until the rank reports again "
               "from a restarted process."),
    # added for pages an on-call engineer can trust (wire 1.6 final, loss scaling; issue #18)
    MetricSpec("nanwatch_latest_offender_info", "gauge", ("run_id", "stage", "site", "pass", "rank"),
               "Where this incident began (always 1; one series per run and stage): the first offender of the "
               "run's most recent non-finite report in that stage, with the rank that held it (loss-scale "
               "overflows excepted). nanwatch_first_offender_info keeps the run's first."),
    MetricSpec("nanwatch_math_fallback_info", "gauge", ("run_id", "site", "dtype", "rank"),
               "The run's latest training attention call that ran on the SDPA math backend in half precision "
               "(always 1; one series per run): its site, dtype and the rank that reported it."),
    MetricSpec("nanwatch_loss_scale_overflows_total", "counter", ("run_id",),
               "Training steps whose non-finite gradients dynamic loss scaling (a GradScaler) handled: it "
               "skipped the update and lowered the scale. Normal operation, counted once per step however many "
               "ranks report it; these steps add nothing to the non-finite counters."),
    MetricSpec("nanwatch_loss_scale", "gauge", ("run_id",),
               "The loss scale after the latest step, min over live ranks (absent without dynamic loss "
               "scaling): a collapsing scale is the incident, not an overflow."),
    MetricSpec("nanwatch_run_ended", "gauge", ("run_id",),
               "1 once every rank of the run sent its final report (the run ended normally); kept until the "
               "run's retention, gone when a new incarnation reports."),
    # added for the incident capsule (wire 1.7 ``Incident.capsule``; issue #20)
    MetricSpec("nanwatch_not_reproducible_incidents_total", "counter", ("run_id", "host"),
               "Incidents the trainer's differential replay could not reproduce (class not_reproducible), by the "
               "host that saw them (the hostname of Incident.host, cleaned). A host that computes a NaN its own "
               "replay does not is the silent-data-corruption signal: sum by (host) over runs."),
    MetricSpec("nanwatch_latest_incident_info", "gauge", ("run_id", "class", "host", "rank", "capsule"),
               "The run's latest incident of each class (always 1; one series per run and class): the host and "
               "rank that saw it and where its capsule was written (empty when none was): replay it with "
               "`nanwatch replay CAPSULE`."),
    MetricSpec("nanwatch_collector_reports_accepted_total", "counter", (),
               "Step reports applied to the state."),
    MetricSpec("nanwatch_collector_reports_duplicate_total", "counter", (),
               "Step reports already applied (replays), acknowledged and ignored."),
    MetricSpec("nanwatch_collector_requests_rejected_total", "counter", ("reason",),
               "Requests refused with a 4xx or 503, by reason."),
    MetricSpec("nanwatch_collector_series_dropped_total", "counter", ("run_id",),
               "Series not created because the run hit the per-run series cap."),
    MetricSpec("nanwatch_collector_caps_hit_total", "counter", ("cap",),
               "Times a collector cap refused or dropped something: runs and incarnations (the request got "
               "429), events and total_events (not recorded), memory (above NANWATCH_MEMORY_LIMIT_MIB: a new "
               "run, incarnation or rank got 429, or new series and events were not kept)."),
)

METRICS: dict[str, MetricSpec] = {s.name: s for s in _SPECS}


def family(name: str) -> CounterMetricFamily | GaugeMetricFamily:
    """A fresh, empty family for ``name``, typed and labelled from the table."""
    spec = METRICS[name]
    cls = CounterMetricFamily if spec.type == "counter" else GaugeMetricFamily
    return cls(spec.name, spec.help, labels=spec.labels)
