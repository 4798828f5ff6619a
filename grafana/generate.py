"""nanwatch's Grafana dashboards, built in Python with grafana-foundation-sdk (never hand-written JSON).

Regenerate the checked-in JSON after editing this file (from the repository root)::

    python grafana/generate.py           # writes grafana/dashboards/run-health.json and fleet.json
    python grafana/generate.py --check   # writes nothing; exits 1 naming the files that drifted

tests/deploy/test_grafana.py runs the check, and checks every query against the collector's metric table
and the recording rules in deploy/prometheus/rules/, with promtool.

Every metric name in a query comes from the collector's one metric table (``mt.X.name``,
``nanwatch.monitor.data.metric_table``): a metric renamed there renames its queries here, on the next
generation. The recording rules' names (``level:metric:operations``) are the rules file's, checked by the test.

Every panel, target and annotation takes its data source from the dashboard variable ``datasource`` (type
prometheus). Its default is the data source Grafana provisions with the fixed uid ``nanwatch-prometheus``
(grafana/provisioning/datasources/prometheus.yml), so the dashboards open on it; any other Prometheus can
be picked in the variable.

SDK gaps worked around here (grafana-foundation-sdk 1769699379!11.6.0): the dashboard AnnotationQuery
model lacks ``titleFormat``/``textFormat``/``tagKeys``, which Grafana's Prometheus data source reads from an
annotation (:class:`PromAnnotation` adds them); transformation options are untyped (plain dicts).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, NamedTuple

from grafana_foundation_sdk.builders import common as cb
from grafana_foundation_sdk.builders import dashboard as db
from grafana_foundation_sdk.builders import prometheus, stat, statetimeline, table, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common as cm
from grafana_foundation_sdk.models import dashboard as dm
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

from nanwatch.monitor.data import metric_table as mt

__all__ = ["DATASOURCE_UID", "dashboards", "main", "panel_queries", "render"]

OUT_DIR = Path(__file__).resolve().parent / "dashboards"
#: uid of the provisioned Prometheus data source (grafana/provisioning/datasources/prometheus.yml)
DATASOURCE_UID = "nanwatch-prometheus"
#: the alerts' dashboard_url annotations link to these uids (deploy/prometheus/rules/)
RUN_HEALTH_UID = "nanwatch-run-health"
FLEET_UID = "nanwatch-fleet"
TAGS = ["nanwatch"]
#: the runbook's URL: deploy/prometheus/generate.py's DEFAULT_RUNBOOK_BASE (tests/deploy checks they agree)
RUNBOOK_BASE = "https://github.com/nanwatch/nanwatch/blob/main/deploy/runbook.md"

#: every panel, target and annotation queries the data source the ``datasource`` variable picks
DS = dm.DataSourceRef(type_val="prometheus", uid="${datasource}")
RUN = 'run_id="$run_id"'
RUN_RANK = 'run_id="$run_id", rank=~"$rank"'

GREEN, ORANGE, RED = "green", "orange", "red"


# ----------------------------------------------------------------------------------- building blocks


class _PromAnnotationModel(dm.AnnotationQuery):
    """The SDK's AnnotationQuery plus what the Prometheus data source reads from an annotation: the
    legend-style ``titleFormat``/``textFormat`` and ``tagKeys`` (labels that become tags)."""

    def __init__(self) -> None:
        super().__init__()
        self.title_format: str | None = None
        self.text_format: str | None = None
        self.tag_keys: str | None = None

    def to_json(self) -> dict[str, object]:
        payload = super().to_json()
        extra = {"titleFormat": self.title_format, "textFormat": self.text_format, "tagKeys": self.tag_keys}
        payload.update({key: value for key, value in extra.items() if value is not None})
        return payload


class PromAnnotation(db.AnnotationQuery):
    """``db.AnnotationQuery`` building a :class:`_PromAnnotationModel`."""

    _internal: _PromAnnotationModel

    def __init__(self) -> None:
        self._internal = _PromAnnotationModel()

    def title_format(self, fmt: str) -> PromAnnotation:
        self._internal.title_format = fmt
        return self

    def text_format(self, fmt: str) -> PromAnnotation:
        self._internal.text_format = fmt
        return self

    def tag_keys(self, keys: str) -> PromAnnotation:
        self._internal.tag_keys = keys
        return self


def query(expr: str, legend: str | None = None, *, ref: str = "A", instant: bool = False,
          as_table: bool = False) -> prometheus.Dataquery:
    """A Prometheus target: a range query unless ``instant``; ``as_table`` for table panels."""
    q = prometheus.Dataquery().expr(expr).ref_id(ref).datasource(DS)
    q = q.instant() if instant else q.range()
    if legend is not None:
        q = q.legend_format(legend)
    if as_table:
        q = q.format(PromQueryFormat.TABLE)
    return q


def or_none(expr: str, label: str) -> str:
    """``expr``, or one series ``{label="(none)"}`` at 0 while ``expr`` has none: a counter that exists only
    once something happened reads 0, not "No data"."""
    return f'{expr}\nor on () label_replace(vector(0), "{label}", "(none)", "", "")'


def counted(spec: mt.MetricSpec, by: str, *, fn: str = "increase", select: str = RUN) -> str:
    """A counter's ``fn`` (increase or rate) per interval, grouped ``by``, over every collector: the inner max by
    its labels and ``instance`` counts one collector scraped by two jobs once, the sum adds the parts of
    replicas that exported the run in turn (docs/replicas.md#querying-replicas). Never a max over instances
    (it drops the old exporter's part after a handover), never a sum of raw counter values."""
    inner = ", ".join((*spec.labels[1:], "instance"))
    return f"sum by ({by}) (max by ({inner}) ({fn}({spec.name}{{{select}}}[$__rate_interval])))"


def thresholds(*steps: tuple[float | None, str]) -> db.ThresholdsConfig:
    """Absolute thresholds; the first step's value is None (the base colour)."""
    return db.ThresholdsConfig().mode(dm.ThresholdsMode.ABSOLUTE).steps(
        [dm.Threshold(value=value, color=color) for value, color in steps])


def fixed_color(color: str) -> dm.DynamicConfigValue:
    """An override property: one fixed colour."""
    return dm.DynamicConfigValue(
        id_val="color", value=dm.FieldColor(mode=dm.FieldColorModeId.FIXED, fixed_color=color))


def _common(panel: Any, title: str, description: str, w: int, h: int) -> Any:
    """What every panel shares: title, description, size, the ``${datasource}`` data source."""
    return panel.title(title).description(description).span(w).height(h).datasource(DS)


def ts_panel(title: str, description: str, *targets: prometheus.Dataquery, unit: str = "short",
             w: int = 12, h: int = 8) -> timeseries.Panel:
    """A time series with a table legend (last and max) and a shared tooltip."""
    legend = (cb.VizLegendOptions().display_mode(cm.LegendDisplayMode.TABLE).placement(cm.LegendPlacement.BOTTOM)
              .show_legend(True).calcs(["lastNotNull", "max"]))
    tooltip = cb.VizTooltipOptions().mode(cm.TooltipDisplayMode.MULTI).sort(cm.SortOrder.DESCENDING)
    panel = (_common(timeseries.Panel(), title, description, w, h).unit(unit).legend(legend).tooltip(tooltip)
             .line_width(1).fill_opacity(10).show_points(cm.VisibilityMode.NEVER))
    for target in targets:
        panel = panel.with_target(target)
    return panel


def stat_panel(title: str, description: str, target: prometheus.Dataquery, steps: db.ThresholdsConfig, *,
               text_mode: cm.BigValueTextMode = cm.BigValueTextMode.VALUE, w: int = 4, h: int = 5) -> stat.Panel:
    """A single value (the last one), its background coloured by the thresholds."""
    return (_common(stat.Panel(), title, description, w, h).with_target(target).thresholds(steps)
            .color_mode(cm.BigValueColorMode.BACKGROUND).graph_mode(cm.BigValueGraphMode.NONE)
            .text_mode(text_mode).reduce_options(cb.ReduceDataOptions().calcs(["lastNotNull"]).values(False)))


def timeline_panel(title: str, description: str, target: prometheus.Dataquery, *, w: int = 12,
                   h: int = 8) -> statetimeline.Panel:
    """A state timeline of an info-style gauge (always 1): one row per label set, present or absent."""
    return (_common(statetimeline.Panel(), title, description, w, h).with_target(target)
            .show_value(cm.VisibilityMode.NEVER).merge_values(True).row_height(0.8).fill_opacity(80)
            .color_scheme(db.FieldColor().mode(dm.FieldColorModeId.PALETTE_CLASSIC_BY_NAME))
            .legend(cb.VizLegendOptions().show_legend(False)))


def organize(*, exclude: list[str], order: list[str], rename: dict[str, str]) -> dm.DataTransformerConfig:
    """The ``organize`` transformation: hide, order and rename table columns."""
    return dm.DataTransformerConfig(id_val="organize", options={
        "excludeByName": {name: True for name in exclude},
        "indexByName": {name: i for i, name in enumerate(order)},
        "renameByName": rename,
    })


def base_dashboard(uid: str, title: str, description: str) -> db.Dashboard:
    """Shared settings, the ``datasource`` variable and a link menu to the nanwatch dashboards."""
    datasource = (db.DatasourceVariable("datasource").label("Data source").type("prometheus")
                  .current(dm.VariableOption(text="Prometheus", value=DATASOURCE_UID)))
    others = (db.DashboardLink("nanwatch").type(dm.DashboardLinkType.DASHBOARDS).tags(TAGS).as_dropdown(True)
              .include_vars(True).keep_time(True))
    runbook = (db.DashboardLink("Runbook").type(dm.DashboardLinkType.LINK).url(RUNBOOK_BASE)
               .target_blank(True).icon("doc"))
    return (db.Dashboard(title).uid(uid).description(description).tags(TAGS).time("now-1h", "now")
            .refresh("30s").timezone("browser").tooltip(dm.DashboardCursorSync.CROSSHAIR).editable()
            .with_variable(datasource).link(others).link(runbook))


def alerts_annotation(selector: str) -> PromAnnotation:
    """Prometheus's firing alerts (the ALERTS series) as annotations: one region per alert while it fires."""
    return (PromAnnotation().name("Alerts").datasource(DS).enable(True).icon_color("orange")
            .expr(f'ALERTS{{alertstate="firing", {selector}}}').title_format("{{alertname}} ({{severity}})")
            .text_format("{{alertname}} {{severity}}").tag_keys("alertname,severity"))


def builtin_annotation() -> db.AnnotationQuery:
    """Grafana's own annotations and alerts (what every dashboard gets by default)."""
    return (db.AnnotationQuery().name("Annotations & Alerts").type("dashboard").built_in(1).enable(True)
            .hide(True).icon_color("rgba(0, 211, 255, 1)")
            .datasource(dm.DataSourceRef(type_val="grafana", uid="-- Grafana --")))


# ----------------------------------------------------------------------------------- run health


def run_health_variables(d: db.Dashboard) -> db.Dashboard:
    """``run_id`` (the runs seen in the time range) and ``rank`` (its ranks; multi, All = any rank)."""
    run_id = (db.QueryVariable("run_id").label("Run").datasource(DS)
              .query(f"label_values({mt.LIVE_RANKS.name}, run_id)")
              .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED).sort(dm.VariableSort.ALPHABETICAL_ASC))
    rank = (db.QueryVariable("rank").label("Rank").datasource(DS)
            .query(f'label_values({mt.LAST_REPORT_TIMESTAMP.name}{{run_id="$run_id"}}, rank)')
            .refresh(dm.VariableRefresh.ON_TIME_RANGE_CHANGED).sort(dm.VariableSort.NUMERICAL_ASC)
            .multi(True).include_all(True).all_value(".*").current(dm.VariableOption(text="All", value="$__all")))
    return d.with_variable(run_id).with_variable(rank)


def new_or_increased(series: str, identity: str) -> str:
    """Per series: its value if it is new within the interval on every collector (increase() needs an earlier
    sample, so a counter's first event would be lost; a series another replica showed before is not new, it
    moved), else its increase over the interval (0 when nothing happened)."""
    return (f"({series} unless on ({identity}) {series} offset $__rate_interval)\n"
            f"  or increase({series}[$__rate_interval])")


def run_health_annotations(d: db.Dashboard) -> db.Dashboard:
    """Events of the collector's event log, and directive changes, as annotations on every panel.

    Both queries return a series (value 0) while nothing happens and a positive value in an interval where
    something did: Grafana's Prometheus annotations mark only the points above zero."""
    new = new_or_increased(f"{mt.EVENTS.name}{{{RUN}}}", "run_id, kind")
    events = f"sum by (kind) (max by (kind, instance) (\n  {new}\n))"  # over collectors, as counted()
    directive = f"{mt.DIRECTIVE_INFO.name}{{{RUN}}}"
    # a new (mode, version) series is a directive change; "or 0 *" keeps the current one, at 0
    changes = (f"max by (mode, version) (\n  ({directive} unless {directive} offset $__rate_interval)\n"
               f"  or 0 * {directive}\n)")
    return (d.annotation(builtin_annotation())
            .annotation(alerts_annotation(RUN))
            .annotation(PromAnnotation().name("nanwatch events").datasource(DS).enable(True).icon_color(RED)
                        .expr(events).title_format("{{kind}}").text_format("nanwatch event: {{kind}}")
                        .tag_keys("kind"))
            .annotation(PromAnnotation().name("Directive changes").datasource(DS).enable(True)
                        .icon_color("purple").expr(changes).title_format("directive {{mode}} (v{{version}})")
                        .text_format("directive now {{mode}}, version {{version}}").tag_keys("mode")))


def overview_panels() -> list[Any]:
    first_offender = (
        _common(table.Panel(), "First offender",
                "Where the run's first non-finite value was seen (from the collector's event log).", 12, 5)
        .with_target(query(f"{mt.FIRST_OFFENDER_INFO.name}{{{RUN}}}", instant=True, as_table=True))
        .with_transformation(organize(exclude=["Time", "Value", "__name__", "run_id", "job", "instance"],
                                      order=["site", "pass", "stage", "rank"],
                                      rename={"site": "Site", "pass": "Pass", "stage": "Stage", "rank": "Rank"})))
    return [
        stat_panel("Live ranks", "Ranks that reported (a report or a heartbeat) within the collector's TTL.",
                   query(f"{mt.LIVE_RANKS.name}{{{RUN}}}"), thresholds((None, RED), (1, GREEN)), w=3),
        stat_panel("Ranks missing", "The run's world size less its live ranks: ranks that never reported, or "
                   "went silent past the TTL (NanwatchRanksMissing).",
                   query(f"max({mt.RUN_WORLD_SIZE.name}{{{RUN}}}) - max({mt.LIVE_RANKS.name}{{{RUN}}})"),
                   thresholds((None, GREEN), (1, RED)), w=3),
        stat_panel("Non-finite values", "Calls that held a NaN or Inf so far, on every rank (forward and "
                   "backward): the run-level count, the same whether ranks report one by one or as a job.",
                   query(f"sum(max by (stage, pass, kind) ({mt.RUN_NONFINITE_CALLS.name}{{{RUN}}}))"),
                   thresholds((None, GREEN), (1, RED)), w=3),
        stat_panel("Active directive", "The run's active directive (mode and version).",
                   query(f"{mt.DIRECTIVE_INFO.name}{{{RUN}}}", "{{mode}} (v{{version}})"),
                   thresholds((None, "blue")), text_mode=cm.BigValueTextMode.NAME, w=3),
        first_offender,
    ]


def nonfinite_panels() -> list[Any]:
    # counted(): each collector's part once however many jobs scrape it, the replicas' parts summed; counters
    # are born at zero (and a replica taking over a run starts them where the last export stood), so
    # increase() shows the first NaN
    by_site = counted(mt.SITE_NONFINITE_CALLS, "site, pass")
    by_rank = counted(mt.NONFINITE_CALLS, "rank, pass, kind", select=RUN_RANK)
    by_stage = counted(mt.RUN_NONFINITE_CALLS, "stage")
    latest = (
        _common(table.Panel(), "Latest offender by stage",
                "Where the run's most recent non-finite step in each stage began (what the pages name).", 12, 6)
        .with_target(query(f"max by (stage, site, pass, rank) ({mt.LATEST_OFFENDER_INFO.name}{{{RUN}}})",
                           instant=True, as_table=True))
        .with_transformation(organize(exclude=["Time", "Value"], order=["stage", "site", "pass", "rank"],
                                      rename={"stage": "Stage", "site": "Site", "pass": "Pass", "rank": "Rank"})))
    return [
        ts_panel("Non-finite values by stage", "Calls that held a NaN or Inf, per interval, by stage: train pages, "
                 "eval and generate are tickets.", query(by_stage, "{{stage}}")),
        latest,
        ts_panel("Non-finite values by site and pass",
                 "Calls that held a NaN or Inf, per interval, by module site and pass, summed over ranks.",
                 query(by_site, "{{site}} ({{pass}})")),
        ts_panel("Non-finite values by rank and kind", "Calls that held a NaN or Inf, per interval, on the selected "
                 "ranks (in job mode the ranks that held one send their own detail reports).",
                 query(by_rank, "rank {{rank}} {{pass}} {{kind}}")),
    ]


def attention_panels() -> list[Any]:
    calls = counted(mt.SDPA_CALLS, "backend", fn="rate", select=f'{RUN}, stage="train"')
    share = (ts_panel("SDPA backend share (train)", "Share of training attention calls by the SDPA backend "
                      "that ran. Red is the math kernel: O(S^2) memory, and in half precision the silent "
                      "fallback.", query(calls, "{{backend}}"), unit="percentunit", w=8)
             .stacking(cb.StackingConfig().mode(cm.StackingMode.PERCENT)).fill_opacity(60)
             .override_by_name("math", [fixed_color(RED)]))
    tau_line = [fixed_color(RED),
                dm.DynamicConfigValue(id_val="custom.lineStyle", value=cm.LineStyle(fill="dash", dash=[10, 10])),
                dm.DynamicConfigValue(id_val="custom.lineWidth", value=2),
                dm.DynamicConfigValue(id_val="custom.fillOpacity", value=0)]
    logits = (ts_panel("Attention-logit bound per layer vs tau", "Upper bound on the max scaled QK logit, max "
                       "over ranks and heads; the dashed red line is the collector's tau (NANWATCH_LOGIT_TAU).",
                       query(f"{mt.ATTENTION_LOGIT_MAX.name}{{{RUN}}}", "{{layer}}"),
                       query(f"run_id:nanwatch_collector_logit_tau:max{{{RUN}}}", "tau", ref="B"), w=8)
              .override_by_name("tau", tau_line))
    headroom = (ts_panel("Headroom by site kind", "amax / finfo.max per site kind, max over sites and ranks "
                         "(log scale). 1 is the overflow edge; +Inf once an Inf was seen. The alert fires above "
                         "0.1.", query(f"{mt.TENSOR_HEADROOM_RATIO.name}{{{RUN}}}", "{{site_kind}}"), w=8)
                .scale_distribution(cb.ScaleDistributionConfig().type(cm.ScaleDistribution.LOG).log(10))
                .thresholds(thresholds((None, GREEN), (0.1, ORANGE), (1, RED)))
                .thresholds_style(cb.GraphThresholdsStyleConfig().mode(cm.GraphThresholdsStyleMode.DASHED)))
    return [share, logits, headroom]


def rlhf_stat(stat_re: str) -> prometheus.Dataquery:
    return query(f'{mt.RLHF_STAT.name}{{{RUN}, stat=~"{stat_re}"}}', "{{stat}}")


def rlhf_panels() -> list[Any]:
    return [
        ts_panel("Policy ratio max", "Largest importance ratio pi/pi_old over the step's tokens (max over "
                 "ranks).", rlhf_stat("ratio_max"), w=6),
        ts_panel("KL (k1, k3, k3 x ratio means)", "Per-token KL estimators, mean over ranks; k3 x ratio is what "
                 "TRL's GRPO optimises by default.", rlhf_stat("kl_k1_mean|kl_k3_mean|kl_k3_ratio_mean"), w=6),
        ts_panel("Clip fraction", "Share of tokens whose ratio was clipped (mean over ranks).",
                 rlhf_stat("clip_fraction"), unit="percentunit", w=6),
        ts_panel("Min logprob", "Smallest token log-probability of the policy (min over ranks).",
                 rlhf_stat("logprob_min"), w=6),
    ]


def rollout_stat(stat_re: str) -> prometheus.Dataquery:
    """The rollout-vs-trainer figures (one line per stat however many jobs scrape the collector)."""
    return query(f'max by (stat) ({mt.ROLLOUT_MISMATCH.name}{{{RUN}, stat=~"{stat_re}"}})', "{{stat}}")


def weight_syncs(spec: mt.MetricSpec, legend: str, ref: str) -> prometheus.Dataquery:
    """Weight syncs per interval (0, not "No data", before the first one)."""
    return query(f"{counted(spec, 'run_id')}\nor on () vector(0)", legend, ref=ref)


def rollout_panels() -> list[Any]:
    """The rollout (sampler) against the trainer on the same tokens (#28): the figures over time, the
    classified events by cause, the sampler's own non-finite logprobs, and the weight syncs verified."""
    events = or_none(counted(mt.ROLLOUT_MISMATCH_EVENTS, "cause"), "cause")
    nonfinite = or_none(counted(mt.ROLLOUT_NONFINITE_VALUES, "run_id"), "run_id")
    drift = (ts_panel("Rollout mismatch |dlogp|", "Mean, 99th percentile and k3 KL of dlogp = trainer - rollout "
                      "on the same tokens, the latest step's (the job's, or combined over ranks). A synced run in "
                      "matching precision sits near 0.015; NanwatchRolloutDrift tickets above 0.05 for 30 "
                      "minutes; a step change is a jump (a weight sync).",
                      rollout_stat("abs_mean|abs_p99|k3_mean"), w=8)
             .thresholds(thresholds((None, GREEN), (0.05, ORANGE)))
             .thresholds_style(cb.GraphThresholdsStyleConfig().mode(cm.GraphThresholdsStyleMode.DASHED)))
    return [
        drift,
        ts_panel("Rollout truncated fraction", "Share of tokens whose ratio exp(dlogp) leaves [1/c, c] (c: the "
                 "truncation cap, TRL's or verl's): what importance-sampling truncation throws away.",
                 rollout_stat("truncated_fraction"), unit="percentunit", w=8),
        ts_panel("Rollout correlation and slope", "Pearson correlation of the two token-probability vectors (near "
                 "1 unless the weights differ) and the slope of rollout on trainer logprobs (1/T when only the "
                 "sampler divides by a temperature T: an offset, not a drift).",
                 rollout_stat("prob_correlation|logprob_slope"), w=8),
        ts_panel("Rollout mismatch events by cause", "Mismatches the trainer classified, per interval: jump "
                 "(a weight sync: pages), drift (precision or kernels), offset (sampler semantics), outliers "
                 "(a few sequences). \"(none)\": none so far.", query(events, "{{cause}}"), w=8),
        ts_panel("Sampler non-finite logprobs", "NaN/Inf in the rollout's own logprobs inside the mask, per "
                 "interval: counted, never replaced (NanwatchSamplerNonfinite pages).", query(nonfinite, "non-finite"),
                 w=8),
        ts_panel("Weight syncs verified and mismatched", "Weight versions whose fingerprints the rollout side "
                 "confirmed, and those it did not (NanwatchWeightSyncMismatch pages), per interval.",
                 weight_syncs(mt.WEIGHT_SYNCS_VERIFIED, "verified", "A"),
                 weight_syncs(mt.WEIGHT_SYNC_MISMATCHES, "mismatched", "B"), w=8)
        .override_by_name("mismatched", [fixed_color(RED)]),
    ]


def moe_panels() -> list[Any]:
    """MoE routing (#39): each router's disagreement with the rollout's routes, the tokens rerouted in any
    router, each router's expert load and logit max, and whether a claimed replay was applied."""
    per_layer = "max by (layer) ({metric}{{" + RUN + "}})"
    return [
        ts_panel("Router disagreement with the rollout", "Per MoE router, the fraction of unmasked tokens whose "
                 "expert set differs from the rollout's routes (rlhf(rollout_routes=)). Megatron-LM #4168 measured "
                 "about 10 % without replay; NanwatchRoutingDisagreement tickets above 5 % for 15 minutes.",
                 query(per_layer.format(metric=mt.MOE_ROUTING_DISAGREEMENT.name), "{{layer}}"),
                 unit="percentunit", w=8)
        .thresholds(thresholds((None, GREEN), (0.05, ORANGE)))
        .thresholds_style(cb.GraphThresholdsStyleConfig().mode(cm.GraphThresholdsStyleMode.DASHED)),
        ts_panel("Tokens rerouted, and replay not applied", "The fraction of unmasked tokens with at least one "
                 "router differing from the rollout's, and (under routing_replay verify/apply) 1 when a token "
                 "reached other experts than the rollout's: NanwatchRoutingReplayNotApplied pages.",
                 query(f"max by (run_id) ({mt.MOE_TOKENS_REROUTED.name}{{{RUN}}})", "rerouted", ref="A"),
                 query(f"max by (run_id) ({mt.MOE_REPLAY_NOT_APPLIED.name}{{{RUN}}})", "replay not applied", ref="B"),
                 unit="percentunit", w=8)
        .override_by_name("replay not applied", [fixed_color(RED)]),
        ts_panel("Expert load imbalance", "Per MoE router, the largest expert's share of the routed token slots "
                 "times the number of experts: 1 is balanced, the number of experts is one expert taking every "
                 "token (a collapsed router).",
                 query(per_layer.format(metric=mt.MOE_EXPERT_LOAD_MAX.name), "{{layer}}"), w=8),
        ts_panel("Router logit max", "Per MoE router, its largest logit in the latest step (max over ranks): "
                 "large logits make bf16 rounding flip near-ties between rollout and trainer.",
                 query(per_layer.format(metric=mt.MOE_ROUTER_LOGIT_MAX.name), "{{layer}}"), w=8),
    ]


def mode_panels() -> list[Any]:
    modes = (timeline_panel("Attention mode per rank", "The attention path each selected rank applies (none, "
                            "fp32, fused, eager_to_sdpa, skip_step).",
                            query(f"{mt.ATTENTION_MODE.name}{{{RUN_RANK}}}", "rank {{rank}}: {{mode}}"))
             .override_by_regexp(".*: skip_step", [fixed_color(RED)])
             .override_by_regexp(".*: none", [fixed_color(GREEN)]))
    directive = (timeline_panel("Directive over time", "The run's directive over time (mode and version); its "
                                "changes are also annotations on every panel.",
                                query(f"{mt.DIRECTIVE_INFO.name}{{{RUN}}}", "{{mode}} (v{{version}})"))
                 .override_by_regexp("none .*", [fixed_color(GREEN)]))
    return [modes, directive]


def guard_panels() -> list[Any]:
    skipped = ts_panel("Optimizer steps skipped", "Steps whose update the weight guard skipped because they saw "
                       "a non-finite value (the weights stayed as they were). Under torch.distributed the skip is "
                       "the job's, so each rank shown counts the same steps; job mode shows the reporting rank "
                       "and the ranks with detail reports.",
                       query(counted(mt.SKIPPED_STEPS, "rank", select=RUN_RANK), "rank {{rank}}"), w=12)
    # incidents exist only once a step was replayed
    # the run's totals: one collector shows them at a time (the database's), so the max over collectors
    incidents = or_none(f"max by (class) ({mt.INCIDENTS.name}{{{RUN}}})", "class")
    # the capsule path is a label of a bounded info series (one per run and class, latest incident), never of
    # a counter: the dashboards read Prometheus only
    capsules = (
        _common(table.Panel(), "Latest incident by class",
                "The run's latest incident of each class: the host and rank that saw it, and where its capsule "
                "was written (empty: none was). Replay it anywhere with `nanwatch replay CAPSULE` (the runbook "
                "says which --try to run for each class; `nanwatch status RUN` prints the command).", 24, 6)
        .with_target(query(f"max by (class, host, rank, capsule) ({mt.LATEST_INCIDENT_INFO.name}{{{RUN}}})",
                           instant=True, as_table=True))
        .with_transformation(organize(exclude=["Time", "Value"], order=["class", "host", "rank", "capsule"],
                                      rename={"class": "Class", "host": "Host", "rank": "Rank",
                                              "capsule": "Capsule"})))
    # both exist only once something happened (#29): "(none)" reads 0, not "No data"
    spikes = or_none(counted(mt.SPIKES, "site_kind"), "site_kind")
    divergences = or_none(counted(mt.INCIDENTS, "class", select=f'{RUN}, class="replica_divergence"'), "class")
    precursors = [
        ts_panel("Spike steps by site kind", "Steps in which a site of a kind jumped k times (spike_factor, 10) "
                 "over its running baseline without overflowing (backward sites: grad): a precursor, not an "
                 "incident (NanwatchSpikesSustained above 5 in 15 minutes). `nanwatch status RUN` names the "
                 "latest sites and factors. \"(none)\": no spike.", query(spikes, "{{site_kind}}"), w=12),
        ts_panel("Replica divergences", "Replica checks that found data-parallel replicas no longer "
                 "bit-identical (silent data corruption; NanwatchReplicaDivergence pages). The ranks and hosts "
                 "are in \"Latest incident by class\" (class replica_divergence). \"(none)\": none.",
                 query(divergences, "{{class}}"), w=12)]
    return [skipped,
            ts_panel("Incidents by class", "The trainer's verdict on non-finite steps: precision (a fallback "
                     "helps), data_mask, not_reproducible and optimizer (born in the optimizer update; no "
                     "fallback helps: a person must look), not_classified, replica_divergence (replicas that "
                     "stopped agreeing: never a fallback).", query(incidents, "{{class}}"), w=12),
            capsules, *precursors]


def reporting_panels() -> list[Any]:
    age = (ts_panel("Report age per rank", "Seconds since the collector last received a report from the rank "
                    "(the stale-rank alert fires above 120 s). In job mode a rank known only by its heartbeats "
                    "appears here once it is late (NANWATCH_RANK_LATE_S, 90 s).",
                    query(f"time() - {mt.LAST_REPORT_TIMESTAMP.name}{{{RUN_RANK}}}", "rank {{rank}}"),
                    unit="s", w=8)
           .thresholds(thresholds((None, GREEN), (60, ORANGE), (120, RED)))
           .thresholds_style(cb.GraphThresholdsStyleConfig().mode(cm.GraphThresholdsStyleMode.DASHED)))
    dropped = ts_panel("Reports dropped", "Reports a trainer rank could not deliver (queue full or collector "
                       "unreachable): those steps were never checked.",
                       # the trainer's own count: the same on every collector that shows the rank
                       query(f"max by (rank) (increase({mt.REPORTS_DROPPED.name}{{{RUN_RANK}}}"
                             "[$__rate_interval]))", "rank {{rank}}"), w=8)
    # the counter exists only once a step went unmeasured
    unmeasured = or_none(counted(mt.UNMEASURED_STEPS, "reason"), "reason")
    return [age, dropped,
            ts_panel("Unmeasured steps by reason", "Step reports in which part of the step went unmeasured, "
                     "summed over ranks. \"compiled\" is a configuration (attention inside torch.compile is "
                     "counted, not probed); the others mean nanwatch was blind. \"(none)\": no step went "
                     "unmeasured.", query(unmeasured, "{{reason}}"), w=8)]


def run_health() -> db.Dashboard:
    d = base_dashboard(RUN_HEALTH_UID, "nanwatch run health",
                       "Numerical health of one training run: non-finite values, SDPA backends, attention "
                       "logits, headroom, RLHF statistics, the rollout against the trainer, MoE routing, attention modes "
                       "and "
                       "reporting.")
    d = run_health_annotations(run_health_variables(d))
    sections = [("Overview", overview_panels()), ("Non-finite values", nonfinite_panels()),
                ("Attention and headroom", attention_panels()), ("RLHF", rlhf_panels()),
                ("Rollout vs trainer", rollout_panels()), ("MoE routing", moe_panels()),
                ("Attention mode and directive", mode_panels()), ("Weight guard", guard_panels()),
                ("Reporting and coverage", reporting_panels())]
    for title, panels in sections:
        # expanded rows: the panels follow the row (Grafana drops panels nested in an expanded row)
        d = d.with_row(db.Row(title))
        for panel in panels:
            d = d.with_panel(panel)
    return d


# ----------------------------------------------------------------------------------- fleet

#: one row per run: the query every column joins to; ``or 0 * LIVE`` gives a run without events a 0
LIVE = f"max by (run_id) ({mt.LIVE_RANKS.name})"


class Column(NamedTuple):
    """One column of the fleet table: an instant query by run_id, merged with the others on run_id.

    (A NamedTuple, not a dataclass: a dataclass needs its module in sys.modules, and the tests load this
    file with importlib.util.spec_from_file_location.)"""

    ref: str
    title: str
    expr: str
    steps: tuple[tuple[float | None, str], ...] = ()
    """Cell background thresholds; none: the value as plain text."""
    unit: str = "short"
    label: str | None = None
    """Show this label of the query's series instead of its value (an info metric's value is always 1)."""


FLEET_COLUMNS = (
    Column("A", "Live ranks", LIVE, ((None, RED), (1, GREEN))),
    Column("B", "Non-finite (5m)",
           f"sum by (run_id) (run_id_stage:nanwatch_nonfinite_calls:increase5m)\nor 0 * {LIVE}",
           ((None, GREEN), (0.001, RED))),
    Column("C", "Math-backend half calls (5m)",
           f"sum by (run_id) (run_id_dtype:nanwatch_sdpa_math_half_calls:increase5m)\nor 0 * {LIVE}",
           ((None, GREEN), (0.001, RED))),
    Column("D", "Max logit", "max by (run_id) (run_id:nanwatch_attention_logit_max:max)"),
    Column("E", "Max logit / tau", "max by (run_id) (run_id:nanwatch_attention_logit_max:max)\n"
           "/ on (run_id) run_id:nanwatch_collector_logit_tau:max",
           ((None, GREEN), (0.8, ORANGE), (1, RED)), unit="percentunit"),
    Column("F", "Directive", f"max by (run_id, mode) ({mt.DIRECTIVE_INFO.name})", label="mode"),
    Column("G", "Worst report age", "max by (run_id) (run_id_rank:nanwatch_report_age:seconds)",
           ((None, GREEN), (60, ORANGE), (120, RED)), unit="s"),
    Column("H", "Ranks missing", f"max by (run_id) ({mt.RUN_WORLD_SIZE.name}) - {LIVE}", ((None, GREEN), (1, RED))),
)


def run_link() -> dm.DashboardLink:
    """The data link from a run_id cell to that run's health dashboard (same data source, same time)."""
    return dm.DashboardLink(
        title="Run health of ${__value.raw}", type_val=dm.DashboardLinkType.LINK,
        url=f"/d/{RUN_HEALTH_UID}/nanwatch-run-health?var-datasource=${{datasource}}"
            "&var-run_id=${__value.raw}&${__url_time_range}")


def column_overrides(panel: table.Panel, col: Column) -> table.Panel:
    """Title, unit and cell colours of a value column (``Value #<ref>`` in Prometheus' table format)."""
    props = [dm.DynamicConfigValue(id_val="displayName", value=col.title),
             dm.DynamicConfigValue(id_val="unit", value=col.unit)]
    if col.steps:
        background = cm.TableColoredBackgroundCellOptions(mode=cm.TableCellBackgroundDisplayMode.BASIC)
        props += [dm.DynamicConfigValue(id_val="thresholds", value=thresholds(*col.steps).build()),
                  dm.DynamicConfigValue(id_val="custom.cellOptions", value=background)]
    return panel.override_by_name(f"Value #{col.ref}", props)


def fleet_table() -> table.Panel:
    panel = _common(table.Panel(), "Runs", "Every run with live ranks, one row each. Non-finite and math-backend "
                    "counts are over the last 5 minutes (the alerts' recording rules). Click a run for its "
                    "health dashboard.", 24, 12)
    for col in FLEET_COLUMNS:
        panel = panel.with_target(query(col.expr, ref=col.ref, instant=True, as_table=True))
    columns = organize(exclude=["Time"] + [f"Value #{c.ref}" for c in FLEET_COLUMNS if c.label],
                       order=["run_id"] + [c.label or f"Value #{c.ref}" for c in FLEET_COLUMNS],
                       rename={c.label: c.title for c in FLEET_COLUMNS if c.label})
    run_id = [dm.DynamicConfigValue(id_val="displayName", value="Run"),
              dm.DynamicConfigValue(id_val="links", value=[run_link()])]
    panel = (panel.with_transformation(dm.DataTransformerConfig(id_val="merge", options={}))
             .with_transformation(columns)
             .sort_by([cb.TableSortByFieldState().display_name("Non-finite (5m)").desc(True)])
             .override_by_name("run_id", run_id))
    for col in FLEET_COLUMNS:
        if col.label is None:
            panel = column_overrides(panel, col)
    return panel


def fleet() -> db.Dashboard:
    collector = ts_panel("Collector reports",
                         "Step reports the collector applied, and replays it acknowledged and ignored.",
                         query(f"sum(rate({mt.REPORTS_ACCEPTED.name}[$__rate_interval]))",
                               "accepted"),
                         query(f"sum(rate({mt.REPORTS_DUPLICATE.name}[$__rate_interval]))",
                               "duplicate", ref="B"), unit="reqps", w=24)
    return (base_dashboard(FLEET_UID, "nanwatch fleet", "Every run the collector sees, its health at a glance.")
            .annotation(builtin_annotation()).annotation(alerts_annotation('alertname=~"Nanwatch.*"'))
            .with_panel(fleet_table())
            .with_row(db.Row("Collector")).with_panel(collector))


# ----------------------------------------------------------------------------------- output


def _number_panels(model: dm.Dashboard) -> None:
    """Stable panel ids, in order (rows, and panels nested in collapsed rows, included)."""
    next_id = 1
    for panel in model.panels or []:
        for p in [panel, *(getattr(panel, "panels", None) or [])]:
            p.id_val = next_id
            next_id += 1


def to_json_model(builder: db.Dashboard) -> dict[str, Any]:
    """The dashboard's JSON model as plain dicts and lists."""
    model = builder.build()
    _number_panels(model)
    return json.loads(json.dumps(model, cls=JSONEncoder))


def dashboards() -> dict[str, dict[str, Any]]:
    """File name -> dashboard JSON model, for every dashboard this module generates."""
    return {"run-health.json": to_json_model(run_health()), "fleet.json": to_json_model(fleet())}


def render(model: dict[str, Any]) -> str:
    """The checked-in text of a dashboard: sorted keys, indent 2, trailing newline."""
    return json.dumps(model, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def panel_queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expr) of every Prometheus target of every panel (rows' nested panels included), then
    ("annotation: <name>", expr) of every annotation query."""
    found: list[tuple[str, str]] = []

    def visit(panels: list[dict[str, Any]]) -> None:
        for panel in panels:
            found.extend((panel.get("title", ""), t["expr"]) for t in panel.get("targets") or () if t.get("expr"))
            visit(panel.get("panels") or [])

    visit(dashboard.get("panels") or [])
    for anno in (dashboard.get("annotations") or {}).get("list") or ():
        expr = anno.get("expr") or (anno.get("target") or {}).get("expr")
        if expr:
            found.append((f"annotation: {anno.get('name', '')}", expr))
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Generate nanwatch's Grafana dashboards.")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a checked-in "
                        "dashboard differs from what would be generated")
    args = parser.parse_args(argv)
    drifted = []
    for name, model in dashboards().items():
        path, text = OUT_DIR / name, render(model)
        if args.check:
            if not path.is_file() or path.read_text(encoding="utf-8") != text:
                drifted.append(path)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            print(f"wrote {path}")
    for path in drifted:
        print(f"drifted: {path} (regenerate: python grafana/generate.py)", file=sys.stderr)
    return 1 if drifted else 0


if __name__ == "__main__":
    sys.exit(main())
