"""The one table of metrics: name, type, labels and help, and for each counter whose totals a report's fold
keeps, the family it is stored as (``MetricSpec.key``); for a report figure, the wire path it is read from and how
it combines over ranks (``MetricSpec.path``, ``reduce``: the fold and the exporter need nothing else,
``nanwatch.monitor.data.report_figures``). The fold counts through these entries, the state
reads stored rows back by them, the API sums them, the exporter renders them, and the metric reference
(``docs/generate.py``), the alerting and recording rules (``deploy/prometheus/generate.py``) and the
dashboards (``grafana/generate.py``) are written from or checked against it.

Every name here is public API (dashboards, alert rules and people's queries use them): a name changes only on
purpose, in a release, with the rules, dashboards, runbook and reference regenerated; a stored ``key`` never
changes (it is a value in people's databases). The first group is the project's original public set.

Example usage::

    METRICS["nanwatch_sdpa_calls_total"].labels   # ("run_id", "backend", "dtype", "stage")
    FAMILIES["sdpa"] is SDPA_CALLS                # the stored family "sdpa" is that counter
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["ATTENTION_LOGIT_MAX", "ATTENTION_MODE", "CAPS_HIT", "COLLECTOR_LOGIT_TAU", "DIRECTIVE_INFO",
           "ENDED_FAMILY", "EVENTS", "FAMILIES", "FIRST_OFFENDER_INFO", "INCIDENTS", "JOB_SKIPPED", "LAST_REPORT_TIMESTAMP", "LATEST_INCIDENT_INFO",
           "LATEST_OFFENDER_INFO", "LIVE_RANKS", "LOSS_SCALE", "LOSS_SCALE_OVERFLOWS", "MATH_FALLBACK_INFO",
           "METRICS", "MOE_EXPERT_LOAD_MAX", "MOE_REPLAY_NOT_APPLIED", "MOE_ROUTER_LOGIT_MAX",
           "MOE_ROUTING_DISAGREEMENT", "MOE_TOKENS_REROUTED", "MOE_OWN_TOKENS_REROUTED", "MetricSpec", "NONFINITE_CALLS", "NOT_REPRODUCIBLE_INCIDENTS",
           "RANK_CRASHED", "REPORT_FIGURES",
           "RENDER_ERRORS", "REPORTS_ACCEPTED", "REPORTS_DROPPED", "REPORTS_DUPLICATE", "REQUESTS_REJECTED", "RLHF_STAT",
           "ROLLOUT_MISMATCH", "ROLLOUT_MISMATCH_EVENTS", "ROLLOUT_NONFINITE_VALUES", "RUN_ENDED",
           "RUN_NONFINITE_CALLS", "RUN_WORLD_SIZE", "SDPA_CALLS", "SERIES_DROPPED",
           "SITE_NONFINITE_CALLS", "SKIPPED_STEPS", "SPIKES", "TENSOR_HEADROOM_RATIO", "UNMEASURED_STEPS",
           "WEIGHT_SYNCS_UNVERIFIABLE", "WEIGHT_SYNCS_VERIFIED", "WEIGHT_SYNC_LAG", "WEIGHT_SYNC_MISMATCHES"]


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """One metric: its name, type, labels and help, and for a counter whose totals the fold keeps per run
    (``RunState.counters``, the store's ``counters`` table), the family it is stored as."""

    name: str
    "''Exposed name; counters end in ``_total``.''"
    type: Literal["counter", "gauge"]
    labels: tuple[str, ...]
    help: str
    key: str | None = None
    """The family as stored (``RunState.counters`` keys, the store's ``counters.family`` column): a stored
    value, so never renamed, whatever the metric is called. None: rendered from the state, not stored."""
    stored_labels: tuple[str, ...] | None = None
    "''The stored labels, in order, where they are not the exposed ones after ``run_id``.''"
    path: str | None = None
    """A report figure: the ``StepReport`` field the metric is read from, dotted into a sub-model or a mapping
    (``loss_scale``, ``moe.tokens_rerouted``, ``rlhf.nonfinite.rollout_logprobs``). Such a metric needs nothing
    but this entry (``nanwatch.monitor.data.report_figures``): a gauge is the latest training step's figure,
    combined over the run's live views by ``reduce``; a counter adds each run-level report's figure. Per run
    (labels ``("run_id",)``): a figure by layer or by rank is folded and rendered by hand."""
    reduce: Literal["sum", "max", "min", "last"] | None = None
    """How a gauge's figure combines over the views of the latest step: ``max``/``min`` over every live view
    and the job's (a NaN wins); ``sum`` and ``last`` count each rank once: the job's figure when the job
    report carries it, else the ranks' own reports' (``last``: the latest of them)."""
    over: str | None = None
    """A gauge that is a fraction: the path of its denominator, summed over the same views as the figure;
    exported only while it is above 0."""

    def __post_init__(self) -> None:
        if self.path is None:
            if self.reduce is not None or self.over is not None:
                raise ValueError(f"{self.name}: reduce= and over= are a report figure's (give path=)")
            return
        if self.labels != ("run_id",):
            raise ValueError(f"{self.name}: a report figure is one series per run (labels ('run_id',)), got "
                             f"{self.labels}: fold and render a figure by layer or rank by hand")
        if self.reduce is None or (self.type == "counter" and (self.reduce != "sum" or self.key is None)):
            raise ValueError(f"{self.name}: a report figure needs reduce=; a counter's is 'sum', with a stored key")
        if self.over is not None and self.reduce != "sum":
            raise ValueError(f"{self.name}: a fraction (over=) sums its figure and denominator: reduce='sum'")

    @property
    def per_rank(self) -> bool:
        """Labelled by rank: its series are the rank's, admitted (and capped) with it."""
        labels = self.stored_labels if self.stored_labels is not None else self.labels[1:]
        return labels[:1] == ("rank",)


# the original public set
NONFINITE_CALLS = MetricSpec(
    "nanwatch_nonfinite_calls_total", "counter", ("run_id", "rank", "pass", "kind"),
    "Measured calls, at all sites, whose tensor held a NaN (kind=nan) or an Inf and no NaN (kind=inf); "
    "pass: forward or backward. Exact element counts are in the incident drill-down.",
    key="nonfinite")
SITE_NONFINITE_CALLS = MetricSpec(
    "nanwatch_site_nonfinite_calls_total", "counter", ("run_id", "site", "pass"),
    "Measured calls per site whose tensor held a NaN or an Inf, summed over ranks.",
    key="site")
SDPA_CALLS = MetricSpec(
    "nanwatch_sdpa_calls_total", "counter", ("run_id", "backend", "dtype", "stage"),
    "Attention calls by the SDPA backend that ran (stage: train, eval or generate).",
    key="sdpa")
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
SKIPPED_STEPS = MetricSpec(
    "nanwatch_skipped_steps_total", "counter", ("run_id", "rank"),
    "Optimizer steps the weight guard skipped because the step saw a non-finite value. Steps whose "
    "non-finite gradients a loss scaler handled are not counted (nanwatch_loss_scale_overflows_total).",
    key="skipped")
#: a job report's skipped step: every rank it covered skipped it, so it adds to each rank's series of
#: ``SKIPPED_STEPS`` (stored apart, under no label; not a metric of its own: not in ``METRICS``)
JOB_SKIPPED = MetricSpec(SKIPPED_STEPS.name, "counter", SKIPPED_STEPS.labels, "", key="job_skipped", stored_labels=())
INCIDENTS = MetricSpec(
    "nanwatch_incidents_total", "counter", ("run_id", "class"),
    "Non-finite steps classified by the trainer: by its differential re-run (precision, data_mask, "
    "not_reproducible, not_classified), or born in the optimizer update (optimizer), summed over ranks; "
    "and data-parallel replicas whose parameters stopped agreeing (replica_divergence: silent data "
    "corruption without a NaN), counted once per step whichever ranks report it.",
    key="incident")
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
UNMEASURED_STEPS = MetricSpec(
    "nanwatch_unmeasured_steps_total", "counter", ("run_id", "reason"),
    "Step reports, summed over ranks, in which part of the step went unmeasured, by reason (no_forward, "
    "no_attention, compiled, no_logits, no_logit_bound).",
    key="unmeasured")
EVENTS = MetricSpec(
    "nanwatch_events_total", "counter", ("run_id", "kind"),
    "Events recorded in the run's event log (first non-finite, math fallback, directive changes...).")
LIVE_RANKS = MetricSpec(
    "nanwatch_live_ranks", "gauge", ("run_id",),
    "Ranks that reported (any report, heartbeats included) within the TTL.")
# added for job-level reporting (wire 1.4): the run-level figures alerts and dashboards are written on
RUN_NONFINITE_CALLS = MetricSpec(
    "nanwatch_run_nonfinite_calls_total", "counter", ("run_id", "pass", "kind", "stage"),
    "Measured calls, at all sites and on all ranks, whose tensor held a NaN (kind=nan) or an Inf and no "
    "NaN (kind=inf), by the sites' stage (train, eval: an evaluation's report, generate: inside "
    "generate(), e.g. RLHF rollouts): summed over stages, the sum over ranks of "
    "nanwatch_nonfinite_calls_total, counted from job reports in job mode (so it holds even where a "
    "rank's detail report is missing). Steps whose non-finite gradients a loss scaler handled are not "
    "counted (nanwatch_loss_scale_overflows_total).",
    key="run_nonfinite")
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
LOSS_SCALE_OVERFLOWS = MetricSpec(
    "nanwatch_loss_scale_overflows_total", "counter", ("run_id",),
    "Training steps whose non-finite gradients dynamic loss scaling (a GradScaler) handled: it skipped "
    "the update and lowered the scale. Normal operation, counted once per step however many ranks report "
    "it; these steps add nothing to the non-finite counters.",
    key="loss_scale_overflow")
LOSS_SCALE = MetricSpec(
    "nanwatch_loss_scale", "gauge", ("run_id",),
    "The loss scale after the latest step, min over live ranks (absent without dynamic loss "
    "scaling): a collapsing scale is the incident, not an overflow.",
    path="loss_scale", reduce="min")
RUN_ENDED = MetricSpec(
    "nanwatch_run_ended", "gauge", ("run_id",),
    "1 once every rank of the run sent its final report (the run ended normally); kept until the "
    "run's retention, gone when a new incarnation reports.")
# added for the incident capsule (wire 1.7 ``Incident.capsule``; issue #20)
NOT_REPRODUCIBLE_INCIDENTS = MetricSpec(
    "nanwatch_not_reproducible_incidents_total", "counter", ("run_id", "namespace", "host"),
    "Incidents that point at a host, by the run-id namespace of the run (the glob of the scoped token that "
    "owns it, * for none) and the host: the trainer's differential re-run could not reproduce them (class "
    "not_reproducible; the hostname of Incident.host, cleaned), or the host's data-parallel replica disagreed "
    "with the others (class replica_divergence: one count per host named). A host that computes a NaN its own "
    "re-run does not, or whose parameters drift from its replicas', is the silent-data-corruption signal: sum "
    "by (namespace, host) over runs (one namespace's reports never count on another's host). Hosts are capped per run and per namespace (NANWATCH_MAX_HOSTS_*).",
    key="not_reproducible", stored_labels=("host",))
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
ROLLOUT_NONFINITE_VALUES = MetricSpec(
    "nanwatch_rollout_nonfinite_values_total", "counter", ("run_id",),
    "Non-finite values (NaN or Inf) in the rollout's own log-probabilities (Monitor.rlhf "
    "rollout_logprobs=), inside the mask, summed over steps and ranks: counted from job reports in job "
    "mode, from rank reports otherwise, never from detail reports. The sampler produced them; nothing "
    "replaced them. Padding outside the mask is not counted here (RlhfStat.nonfinite "
    "rollout_logprobs_pad).",
    key="rollout_nonfinite", path="rlhf.nonfinite.rollout_logprobs", reduce="sum")
ROLLOUT_MISMATCH_EVENTS = MetricSpec(
    "nanwatch_rollout_mismatch_events_total", "counter", ("run_id", "cause"),
    "Rollout mismatches the trainer classified (RolloutEvent), by cause: stale_weights (the weight sync's "
    "verdict: a worker's fingerprints mismatched, or it lags), jump (a sudden rise with no verdict to go on: "
    "weights not synced, or from the wrong version), shift (a sudden rise with verified weights: the rollout "
    "engine's scoring changed), drift (precision or kernels), offset (sampler semantics: temperature, "
    "top-p/top-k on one side only), outliers (a few sequences far off). Counted from job and rank "
    "reports (each rank's own classification in per-rank mode), never from detail reports.",
    key="rollout_event")
WEIGHT_SYNCS_VERIFIED = MetricSpec(
    "nanwatch_weight_syncs_verified_total", "counter", ("run_id",),
    "Weight syncs verified: a rollout worker's weight fingerprints of a weight version equal the "
    "trainer's (one per worker and version; PUT /v1/runs/{run_id}/weights/{version}).",
    key="weight_sync_verified")
WEIGHT_SYNC_MISMATCHES = MetricSpec(
    "nanwatch_weight_sync_mismatches_total", "counter", ("run_id",),
    "Weight syncs that failed verification: a rollout worker's weight fingerprints of a weight version "
    "differ from the trainer's (a tensor differs, is missing or is extra); each is a weight_sync_mismatch "
    "event naming the version, the worker and the first differing tensors.",
    key="weight_sync_mismatch")
# added for dtype-aware verification and lag (issue #36)
WEIGHT_SYNCS_UNVERIFIABLE = MetricSpec(
    "nanwatch_weight_syncs_unverifiable_total", "counter", ("run_id",),
    "Weight syncs that could not be verified: a rollout worker's tensors all agree with the trainer's "
    "except dtypes or shapes that no cast the trainer published explains (e.g. an fp8 copy with no fp8 "
    "cast published); each is a weight_sync_unverifiable event naming them. Not a failed sync.",
    key="weight_sync_unverifiable")
WEIGHT_SYNC_LAG = MetricSpec(
    "nanwatch_weight_sync_lag_versions", "gauge", ("run_id", "worker"),
    "Per rollout worker that posted weight fingerprints: the versions the trainer published after the worker's "
    "latest verified one, when it lags (two or more, or one it posted nothing verified for past "
    "NANWATCH_WEIGHT_SYNC_WAIT_S), else 0. In memory; exported while the run is live.")
# added for spikes (wire 1.9 ``StepReport.spikes``; issue #29)
SPIKES = MetricSpec(
    "nanwatch_spikes_total", "counter", ("run_id", "site_kind"),
    "Steps in which at least one site of a kind jumped k times (spike_factor, 10 by default) over its "
    "running baseline without overflowing (Spike), by site kind (a backward site counts as grad; the loss "
    "as loss): a precursor, not an incident. Counted once per step and kind whichever ranks report it, "
    "from job and rank reports, never from detail reports; the sites are in the run's spike events.",
    key="spike")
# added for MoE routing (wire 1.15 ``StepReport.moe``; issue #39): the latest step, the job report's or merged
# exactly over live ranks (counts summed, maxima maxed: ``MoeStat.merged``)
MOE_ROUTING_DISAGREEMENT = MetricSpec(
    "nanwatch_moe_routing_disagreement", "gauge", ("run_id", "layer"),
    "Per MoE router (layer: its module name), the fraction of unmasked tokens whose expert set differs between "
    "the rollout's routes (Monitor.rlhf(rollout_routes=)) and the trainer's, in the latest step that compared.")
MOE_TOKENS_REROUTED = MetricSpec(
    "nanwatch_moe_tokens_rerouted", "gauge", ("run_id",),
    "The fraction of unmasked tokens with at least one MoE router differing from the rollout's routes, in the "
    "latest step that compared.",
    path="moe.tokens_rerouted", reduce="sum", over="moe.tokens_compared")
MOE_OWN_TOKENS_REROUTED = MetricSpec(
    "nanwatch_moe_tokens_rerouted_before_replay", "gauge", ("run_id",),
    "Under routing_replay=apply, the fraction of unmasked tokens whose trainer's own routers, before nanwatch gave "
    "them the rollout's experts, chose another expert set than the rollout's in at least one router, in the latest "
    "step that compared: what the replay corrected (nanwatch_moe_tokens_rerouted then verifies the replay itself). "
    "About what routing without replay would show; near 1, the rollout's routes are another model's.",
    path="moe.tokens_own_rerouted", reduce="sum", over="moe.tokens_compared")
MOE_EXPERT_LOAD_MAX = MetricSpec(
    "nanwatch_moe_expert_load_max", "gauge", ("run_id", "layer"),
    "Per MoE router, the largest expert's share of the routed token slots times the number of experts, in the "
    "latest step: 1 is balanced, the number of experts is one expert taking every token.")
MOE_ROUTER_LOGIT_MAX = MetricSpec(
    "nanwatch_moe_router_logit_max", "gauge", ("run_id", "layer"),
    "Per MoE router, its largest logit in the latest step (max over ranks).")
MOE_REPLAY_NOT_APPLIED = MetricSpec(
    "nanwatch_moe_replay_not_applied", "gauge", ("run_id",),
    "1 when the run claims routing replay (routing_replay verify or apply) and, in the latest step that "
    "compared, a token reached experts other than the rollout's; else 0. Exported under verify/apply only.")
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
    NONFINITE_CALLS, SITE_NONFINITE_CALLS, SDPA_CALLS, ATTENTION_LOGIT_MAX, TENSOR_HEADROOM_RATIO,
    ATTENTION_MODE, DIRECTIVE_INFO, LAST_REPORT_TIMESTAMP, REPORTS_DROPPED, SKIPPED_STEPS, INCIDENTS,
    FIRST_OFFENDER_INFO, RLHF_STAT, COLLECTOR_LOGIT_TAU, UNMEASURED_STEPS, EVENTS, LIVE_RANKS,
    RUN_NONFINITE_CALLS, RUN_WORLD_SIZE, RANK_CRASHED, LATEST_OFFENDER_INFO, MATH_FALLBACK_INFO,
    LOSS_SCALE_OVERFLOWS, LOSS_SCALE, RUN_ENDED, NOT_REPRODUCIBLE_INCIDENTS, LATEST_INCIDENT_INFO,
    ROLLOUT_MISMATCH, ROLLOUT_NONFINITE_VALUES, ROLLOUT_MISMATCH_EVENTS, WEIGHT_SYNCS_VERIFIED, WEIGHT_SYNC_MISMATCHES,
    SPIKES, WEIGHT_SYNCS_UNVERIFIABLE, WEIGHT_SYNC_LAG,
    MOE_ROUTING_DISAGREEMENT, MOE_TOKENS_REROUTED, MOE_OWN_TOKENS_REROUTED, MOE_EXPERT_LOAD_MAX, MOE_ROUTER_LOGIT_MAX, MOE_REPLAY_NOT_APPLIED,
    REPORTS_ACCEPTED, REPORTS_DUPLICATE, REQUESTS_REJECTED, SERIES_DROPPED, CAPS_HIT, RENDER_ERRORS,
)

METRICS: dict[str, MetricSpec] = {s.name: s for s in _SPECS}

#: the report figures (``MetricSpec.path``), in table order: folded and rendered by their entries alone
REPORT_FIGURES: tuple[MetricSpec, ...] = tuple(s for s in _SPECS if s.path is not None)

#: every counter family a report's fold keeps, by its stored key
FAMILIES: dict[str, MetricSpec] = {s.key: s for s in (*_SPECS, JOB_SKIPPED) if s.key is not None}

#: a row of the counters table that is no counter: whether the run ended normally (1) or not (0). Rendered
#: as the gauge ``nanwatch_run_ended`` from ``RunState.ended``, not from the row
ENDED_FAMILY = "ended"
