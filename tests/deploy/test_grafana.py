"""grafana/: the generated dashboards (grafana/generate.py) and Grafana's provisioning files.

The JSON is checked in, so it must be exactly what the generator writes; every query must name real
metrics (the collector's table or a recording rule), parse with promtool, and return a series in a
synthetic run that looks like the e2e scenario (NaNs, math backend, RLHF stats, a directive change, a
dropped report), evaluated by promtool together with the real recording rules.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support import load_script, require_tool

from nanwatch.monitor.data.metric_table import METRICS
from nanwatch.monitor.data.rollout_figures import STATS as ROLLOUT_STATS

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "grafana"
RULE_FILES = sorted((ROOT / "deploy" / "prometheus" / "rules").glob("*.yml"))
PROMETHEUS_YML = ROOT / "deploy" / "prometheus" / "prometheus.yml"
DATASOURCES = GRAFANA / "provisioning" / "datasources" / "prometheus.yml"
PROVIDERS = GRAFANA / "provisioning" / "dashboards" / "nanwatch.yml"


def _load_generator():
    return load_script(GRAFANA / "generate.py", "nanwatch_grafana_generate")


gen = _load_generator()
DASHBOARDS = gen.dashboards()
RUN_HEALTH, FLEET = DASHBOARDS["run-health.json"], DASHBOARDS["fleet.json"]

#: Grafana's variables, as tests/e2e substitutes them (the synthetic run below is "r1", its ranks 0 and 1)
SUBSTITUTIONS = {"$__rate_interval": "1m", "$__interval": "1m", "$run_id": "r1", "$rank": "0"}
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool", "and", "or",
             "unless", "inf", "nan"}


def substitute(expr: str) -> str:
    for var, value in SUBSTITUTIONS.items():
        expr = expr.replace(var, value)
    assert "$" not in expr, expr
    return expr


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (strings, matchers, ranges and label lists removed;
    a name followed by "(" is a function)."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', substitute(expr))
    e = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", e)
    e = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    found = re.finditer(r"(?<![\w.:])([A-Za-z_:][\w:]*)\s*(\()?", e)
    return {m.group(1) for m in found if not m.group(2) and m.group(1).lower() not in _KEYWORDS}


def recording_rules() -> set[str]:
    return {r["record"] for f in RULE_FILES for g in yaml.safe_load(f.read_text())["groups"]
            for r in g["rules"] if "record" in r}


def all_queries() -> list[tuple[str, str, str]]:
    """(dashboard file, panel title, expr) of every query of every dashboard."""
    return [(name, title, expr) for name, d in DASHBOARDS.items() for title, expr in gen.panel_queries(d)]


def variables(dashboard: dict) -> dict[str, dict]:
    return {v["name"]: v for v in dashboard["templating"]["list"]}


def leaf_panels(dashboard: dict) -> list[dict]:
    out = []
    for p in dashboard["panels"]:
        out += [p] if p["type"] != "row" else p.get("panels", [])
    return out


def variable_selectors() -> list[tuple[str, str, str]]:
    """("<file>", "variable <name>", selector) for every label_values(<selector>, label) variable query."""
    out = []
    for name, d in DASHBOARDS.items():
        for v in d["templating"]["list"]:
            if v["type"] == "query" and (m := re.fullmatch(r"label_values\((.+),\s*\w+\)", v["query"])):
                out.append((name, f"variable {v['name']}", m.group(1)))
    return out


# ------------------------------------------------------------------------------------------------ drift


def test_checked_in_json_is_what_the_generator_writes():
    for name, model in DASHBOARDS.items():
        path = GRAFANA / "dashboards" / name
        assert path.read_text(encoding="utf-8") == gen.render(model), f"{path} drifted: python grafana/generate.py"
    assert sorted(p.name for p in (GRAFANA / "dashboards").glob("*.json")) == sorted(DASHBOARDS)


def test_generation_is_deterministic_and_check_mode_agrees():
    again = gen.dashboards()
    assert {n: gen.render(m) for n, m in again.items()} == {n: gen.render(m) for n, m in DASHBOARDS.items()}
    out = subprocess.run([sys.executable, str(GRAFANA / "generate.py"), "--check"], capture_output=True,
                         text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_check_mode_names_a_drifted_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gen, "OUT_DIR", tmp_path)
    assert gen.main([]) == 0
    (tmp_path / "fleet.json").write_text("{}\n")
    assert gen.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert "fleet.json" in err and "run-health.json" not in err


# ------------------------------------------------------------------------------------------------ queries


def test_panel_queries_cover_every_target_nested_rows_and_annotations():
    from grafana_foundation_sdk.builders import dashboard as db
    from grafana_foundation_sdk.builders import prometheus, timeseries

    nested = gen.to_json_model(db.Dashboard("t").with_row(
        db.Row("r").with_panel(timeseries.Panel().title("p").with_target(prometheus.Dataquery().expr("up")))))
    assert nested["panels"][0]["collapsed"] is True
    assert gen.panel_queries(nested) == [("p", "up")]

    targets = sum(len(p.get("targets", [])) for d in DASHBOARDS.values() for p in leaf_panels(d))
    annotations = sum(1 for d in DASHBOARDS.values() for a in d["annotations"]["list"] if a.get("expr"))
    assert len(all_queries()) == targets + annotations
    assert annotations == 4 and len(gen.panel_queries(RUN_HEALTH)) >= 20


#: the weight-sync counters the dashboard's rollout row queries (issue #28)
WEIGHT_SYNC = ("nanwatch_weight_syncs_verified_total", "nanwatch_weight_sync_mismatches_total")


def test_every_metric_is_exported_by_the_collector_or_recorded_by_a_rule():
    known = set(METRICS) | recording_rules() | {"ALERTS"}
    assert "run_id_stage:nanwatch_nonfinite_calls:increase5m" in known  # the rules were found
    for name, title, expr in all_queries() + variable_selectors():
        used = metric_names(expr)
        assert used, f"{name} / {title}: no metric in {expr!r}"
        assert used <= known, f"{name} / {title}: unknown {sorted(used - known)} in {expr!r}"


def test_every_query_parses_with_promtool(tmp_path):
    promtool = shutil.which("promtool") or require_tool("promtool")
    queries = all_queries()
    records = [{"record": f"nanwatch_dashboard_query_{i}", "expr": substitute(expr)}
               for i, (_, _, expr) in enumerate(queries)]
    rules = {"groups": [{"name": "dashboards", "rules": records}]}
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump(rules, sort_keys=False))
    out = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(queries)} rules found" in out.stdout + out.stderr


# A short run: rank 0 reports NaNs from 1m15s, attention runs flash and math (bf16) kernels, RLHF stats come
# in, the directive moves from none to fp32 at 2m30s, rank 0 drops a report; no step goes unmeasured.
_L = 'job="nanwatch-collector", instance="collector:8000"'
_SCENARIO = [
    ('nanwatch_live_ranks{run_id="r1"}', "2x20"),
    ('nanwatch_run_world_size{run_id="r1"}', "2x20"),
    # born at zero (the collector's first render of a new series is 0)
    ('nanwatch_run_nonfinite_calls_total{run_id="r1", stage="train", pass="forward", kind="nan"}', "0x4 7x15"),
    ('nanwatch_latest_offender_info{run_id="r1", stage="train", site="model.layers.0.self_attn", pass="forward", '
     'rank="0"}', "_x4 1x15"),
    # a second run on a second collector shard: no query may break on two targets' series
    ('nanwatch_live_ranks{job="nanwatch-collector", instance="collector-1:8000", run_id="r2"}', "4x20"),
    ('nanwatch_run_world_size{job="nanwatch-collector", instance="collector-1:8000", run_id="r2"}', "4x20"),
    ('nanwatch_attention_logit_max{job="nanwatch-collector", instance="collector-1:8000", run_id="r2", '
     'layer="model.layers.0.self_attn"}', "7x20"),
    ('nanwatch_collector_logit_tau{job="nanwatch-collector", instance="collector-1:8000"}', "30x20"),
    ('nanwatch_nonfinite_calls_total{run_id="r1", rank="0", pass="forward", kind="nan"}', "0x4 7x15"),
    ('nanwatch_nonfinite_calls_total{run_id="r1", rank="1", pass="forward", kind="nan"}', "0x20"),
    ('nanwatch_site_nonfinite_calls_total{run_id="r1", site="model.layers.0.self_attn", pass="forward"}',
     "_x3 0 7x15"),
    ('nanwatch_sdpa_calls_total{run_id="r1", backend="flash", dtype="bfloat16", stage="train"}', "0+8x20"),
    ('nanwatch_sdpa_calls_total{run_id="r1", backend="math", dtype="bfloat16", stage="train"}', "0+2x20"),
    ('nanwatch_attention_logit_max{run_id="r1", layer="model.layers.0.self_attn"}', "5+0.5x20"),
    ('nanwatch_tensor_headroom_ratio{run_id="r1", site_kind="attention"}', "0.001x20"),
    ('nanwatch_tensor_headroom_ratio{run_id="r1", site_kind="grad"}', "0.01x20"),
    ('nanwatch_attention_mode{run_id="r1", rank="0", mode="none"}', "1x9 stale"),
    ('nanwatch_attention_mode{run_id="r1", rank="0", mode="fp32"}', "_x10 1x10"),
    ('nanwatch_attention_mode{run_id="r1", rank="1", mode="none"}', "1x9 stale"),
    ('nanwatch_attention_mode{run_id="r1", rank="1", mode="fp32"}', "_x10 1x10"),
    ('nanwatch_directive_info{run_id="r1", mode="none", version="0"}', "1x9 stale"),
    ('nanwatch_directive_info{run_id="r1", mode="fp32", version="1"}', "_x10 1x10"),
    ('nanwatch_last_report_timestamp_seconds{run_id="r1", rank="0"}', "0+15x20"),
    ('nanwatch_last_report_timestamp_seconds{run_id="r1", rank="1"}', "0+15x20"),
    ('nanwatch_reports_dropped_total{run_id="r1", rank="0"}', "0x10 1x10"),
    ('nanwatch_reports_dropped_total{run_id="r1", rank="1"}', "0x20"),
    ('nanwatch_skipped_steps_total{run_id="r1", rank="0"}', "0x4 1x15"),
    ('nanwatch_first_offender_info{run_id="r1", site="model.layers.0.self_attn", pass="forward", '
     'stage="train", rank="0"}', "_x4 1x15"),
    ('nanwatch_latest_incident_info{run_id="r1", class="precision", host="gpu-0", rank="0", '
     'capsule="/capsules/r1/step5.rank0.nwcap"}', "_x5 1x14"),
    *[(f'nanwatch_rlhf_stat{{run_id="r1", stat="{s}"}}', "0.1x20")
      for s in ("ratio_max", "clip_fraction", "kl_k1_mean", "kl_k3_mean", "kl_k3_ratio_mean", "kl_k1_max",
                "kl_k3_max", "logprob_min", "advantage_std")],
    # the rollout against the trainer (#28): its figures, a jump born at zero, sampler NaNs, weight syncs
    *[(f'nanwatch_rollout_mismatch{{run_id="r1", stat="{s}"}}', "0.02x20") for s in ROLLOUT_STATS],
    ('nanwatch_rollout_mismatch_events_total{run_id="r1", cause="jump"}', "_x4 0 1x14"),
    ('nanwatch_rollout_nonfinite_values_total{run_id="r1"}', "0x4 3x15"),
    ('nanwatch_weight_syncs_verified_total{run_id="r1"}', "0+1x20"),
    ('nanwatch_weight_sync_mismatches_total{run_id="r1"}', "0x20"),
    # #29: spike steps born at zero, a replica divergence
    ('nanwatch_spikes_total{run_id="r1", site_kind="grad"}', "_x3 0 1 2x15"),
    ('nanwatch_incidents_total{run_id="r1", class="replica_divergence"}', "_x5 0 1x14"),
    # #39: MoE routers, a replay claimed and not applied from 1m15s
    *[(f'nanwatch_moe_{m}{{run_id="r1", layer="model.layers.{i}.mlp.gate"}}', v) for i in (0, 1)
      for m, v in (("routing_disagreement", "0.08x20"), ("expert_load_max", "1.5x20"), ("router_logit_max", "9x20"))],
    ('nanwatch_moe_tokens_rerouted{run_id="r1"}', "0.3x20"),
    ('nanwatch_moe_replay_not_applied{run_id="r1"}', "0x4 1x15"),
    ("nanwatch_collector_logit_tau", "30x20"),
    ('nanwatch_events_total{run_id="r1", kind="first_nonfinite"}', "_x4 1x15"),
    ('nanwatch_events_total{run_id="r1", kind="directive_set"}', "_x9 1x10"),
    ('nanwatch_events_total{run_id="r1", kind="mode_applied"}', "_x10 2x10"),
    ("nanwatch_collector_reports_accepted_total", "0+4x20"),
    ("nanwatch_collector_reports_duplicate_total", "0x20"),
]


def _with_target_labels(series: str) -> str:
    if "instance=" in series:  # a series of another shard says which
        return series
    return series.replace("{", "{" + _L + ", ", 1) if "{" in series else series + "{" + _L + "}"


@pytest.mark.parametrize("eval_time", ["3m", "5m"])
def test_every_query_returns_a_series_in_a_synthetic_run(tmp_path, eval_time):
    """Each query Q becomes an alert "vector(1) unless count(Q)" that fires only if Q is empty: promtool
    evaluates them beside the real recording rules over the scenario above and expects none to fire."""
    promtool = shutil.which("promtool") or require_tool("promtool")
    queries = all_queries() + variable_selectors()
    alerts = [{"alert": f"DashboardQueryEmpty{i}", "expr": f"vector(1) unless on () count({substitute(expr)})",
               "labels": {"query": f"{name} / {title}"}} for i, (name, title, expr) in enumerate(queries)]
    (tmp_path / "queries.yml").write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": alerts}]}))
    test = {"rule_files": [str(f) for f in RULE_FILES] + ["queries.yml"], "evaluation_interval": "15s",
            "tests": [{"interval": "15s",
                       "input_series": [{"series": _with_target_labels(s), "values": v} for s, v in _SCENARIO],
                       "alert_rule_test": [{"eval_time": eval_time, "alertname": a["alert"], "exp_alerts": []}
                                           for a in alerts]}]}
    (tmp_path / "test.yml").write_text(yaml.safe_dump(test, sort_keys=False))
    out = subprocess.run([promtool, "test", "rules", "test.yml"], capture_output=True, text=True, cwd=tmp_path,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


#: the panels (and fleet columns) that must show a NaN run's NaN, not a flat zero
NAN_PANELS = {"Non-finite values", "Non-finite values by stage", "Non-finite values by site and pass",
              "Non-finite values by rank and kind", "Latest offender by stage", "First offender",
              "Sampler non-finite logprobs", "annotation: Alerts"}


def test_every_nonfinite_panel_shows_the_nan_of_a_run_that_had_one(tmp_path):
    """Counters born at zero, the collector scraped by two jobs: over the minutes after the NaN, each NaN panel's
    query (its max over that range) is above zero, so a graph or a stat shows the NaN, not a flat 0."""
    promtool = shutil.which("promtool") or require_tool("promtool")
    queries = [(n, title, e) for n, title, e in all_queries() if title in NAN_PANELS]
    fleet = [(n, title, e) for n, title, e in all_queries() if n == "fleet.json" and title == "Runs"
             and "nonfinite" in e]
    assert {t for _, t, _ in queries} == NAN_PANELS and len(fleet) == 1
    alerts = [{"alert": f"NanNotShown{i}",
               "expr": f"vector(1) unless on () count(max_over_time(({substitute(e)})[4m:15s]) > 0)",
               "labels": {"query": f"{n} / {title}"}} for i, (n, title, e) in enumerate(queries + fleet)]
    (tmp_path / "queries.yml").write_text(yaml.safe_dump({"groups": [{"name": "nan", "rules": alerts}]}))
    second = 'job="nanwatch-collector-2", instance="collector:8000"'
    series = [(_with_target_labels(s), v) for s, v in _SCENARIO]
    series += [(s.replace(_L, second), v) for s, v in series if _L in s]  # the same collector, a second job
    test = {"rule_files": [str(f) for f in RULE_FILES] + ["queries.yml"], "evaluation_interval": "15s",
            "tests": [{"interval": "15s", "input_series": [{"series": s, "values": v} for s, v in series],
                       "alert_rule_test": [{"eval_time": "4m", "alertname": a["alert"], "exp_alerts": []}
                                           for a in alerts]}]}
    (tmp_path / "test.yml").write_text(yaml.safe_dump(test, sort_keys=False))
    out = subprocess.run([promtool, "test", "rules", "test.yml"], capture_output=True, text=True, cwd=tmp_path,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr


def test_runbook_base_agrees_with_the_rules_generator():
    rules_gen = load_script(ROOT / "deploy" / "prometheus" / "generate.py", "nanwatch_rules_gen")
    assert gen.RUNBOOK_BASE == rules_gen.DEFAULT_RUNBOOK_BASE


# ------------------------------------------------------------------------------------------------ variables


def test_run_health_variables():
    v = variables(RUN_HEALTH)
    assert list(v) == ["datasource", "run_id", "rank"]
    assert v["datasource"]["type"] == "datasource" and v["datasource"]["query"] == "prometheus"
    assert v["run_id"]["type"] == "query"
    assert v["run_id"]["query"] == "label_values(nanwatch_live_ranks, run_id)"
    rank = v["rank"]
    assert rank["query"] == 'label_values(nanwatch_last_report_timestamp_seconds{run_id="$run_id"}, rank)'
    assert rank["multi"] is True and rank["includeAll"] is True and rank["allValue"] == ".*"
    for var in (v["run_id"], rank):
        assert var["datasource"] == {"type": "prometheus", "uid": "${datasource}"}


def test_fleet_has_the_datasource_variable():
    v = variables(FLEET)
    assert v["datasource"]["type"] == "datasource" and v["datasource"]["query"] == "prometheus"


def test_every_panel_target_and_annotation_uses_the_datasource_variable():
    ds = {"type": "prometheus", "uid": "${datasource}"}
    for d in DASHBOARDS.values():
        for p in leaf_panels(d):
            assert p["datasource"] == ds, p["title"]
            assert p["targets"] and all(t["datasource"] == ds for t in p["targets"]), p["title"]
        for a in d["annotations"]["list"]:
            if not a.get("builtIn"):
                assert a["datasource"] == ds, a["name"]


def test_no_query_uses_a_variable_its_dashboard_lacks():
    builtin = {"__rate_interval", "__interval"}
    for name, title, expr in all_queries():
        used = set(re.findall(r"\$(\w+)", expr))
        assert used <= set(variables(DASHBOARDS[name])) | builtin, f"{name} / {title}: {used}"


# ------------------------------------------------------------------------------------------------ content


def _panel(dashboard: dict, title: str) -> dict:
    matches = [p for p in leaf_panels(dashboard) if p["title"] == title]
    assert len(matches) == 1, title
    return matches[0]


def test_panel_titles_are_unique():
    for name, d in DASHBOARDS.items():
        titles = [p["title"] for p in leaf_panels(d)]
        assert len(titles) == len(set(titles)), name


def test_run_health_content():
    assert RUN_HEALTH["uid"] == "nanwatch-run-health" and FLEET["uid"] == "nanwatch-fleet"
    share = _panel(RUN_HEALTH, "SDPA backend share (train)")
    assert share["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "percent"
    math = [o for o in share["fieldConfig"]["overrides"] if o["matcher"] == {"id": "byName", "options": "math"}]
    assert math[0]["properties"] == [{"id": "color", "value": {"mode": "fixed", "fixedColor": "red"}}]
    logits = _panel(RUN_HEALTH, "Attention-logit bound per layer vs tau")
    assert any("nanwatch_collector_logit_tau" in t["expr"] for t in logits["targets"])
    headroom = _panel(RUN_HEALTH, "Headroom by site kind")
    assert headroom["fieldConfig"]["defaults"]["custom"]["scaleDistribution"] == {"type": "log", "log": 10}
    capsules = _panel(RUN_HEALTH, "Latest incident by class")  # the capsule path: a label of a bounded info
    assert capsules["type"] == "table" and "nanwatch_latest_incident_info" in capsules["targets"][0]["expr"]
    organize = capsules["transformations"][0]["options"]
    assert "capsule" not in organize["excludeByName"] and organize["renameByName"]["capsule"] == "Capsule"
    offender = _panel(RUN_HEALTH, "First offender")
    assert offender["type"] == "table" and offender["targets"][0]["instant"] is True
    assert _panel(RUN_HEALTH, "Attention mode per rank")["type"] == "state-timeline"
    names = {a["name"]: a for a in RUN_HEALTH["annotations"]["list"]}
    assert names["nanwatch events"]["titleFormat"] == "{{kind}}"
    assert names["Alerts"]["expr"] == 'ALERTS{alertstate="firing", run_id="$run_id"}'
    for d in DASHBOARDS.values():
        assert {"title": "Runbook", "url": gen.RUNBOOK_BASE}.items() <= {
            k: v for link in d["links"] if link["title"] == "Runbook" for k, v in link.items()}.items()
    assert "nanwatch_events_total" in names["nanwatch events"]["expr"]
    assert "nanwatch_directive_info" in names["Directive changes"]["expr"]
    exprs = " ".join(e for _, e in gen.panel_queries(RUN_HEALTH))
    for needle in ("nanwatch_site_nonfinite_calls_total", "nanwatch_first_offender_info", 'stat=~"ratio_max"',
                   "kl_k3_ratio_mean", 'stat=~"clip_fraction"', 'stat=~"logprob_min"', "nanwatch_attention_mode",
                   "nanwatch_reports_dropped_total", "nanwatch_last_report_timestamp_seconds",
                   "nanwatch_unmeasured_steps_total", 'stat=~"abs_mean|abs_p99|k3_mean"', 'stat=~"truncated_fraction"',
                   'stat=~"prob_correlation|logprob_slope"', "nanwatch_rollout_mismatch_events_total",
                   "nanwatch_rollout_nonfinite_values_total", *WEIGHT_SYNC):
        assert needle in exprs, needle
    # #29: spike steps by site kind and replica divergences, each "(none)" at 0 while nothing happened
    spikes = _panel(RUN_HEALTH, "Spike steps by site kind")["targets"][0]
    assert "nanwatch_spikes_total" in spikes["expr"] and spikes["legendFormat"] == "{{site_kind}}"
    assert '"site_kind", "(none)"' in spikes["expr"]
    divergences = _panel(RUN_HEALTH, "Replica divergences")["targets"][0]["expr"]
    assert 'class="replica_divergence"' in divergences and '"class", "(none)"' in divergences


def test_fleet_table_one_row_per_run_linked_to_run_health():
    runs = _panel(FLEET, "Runs")
    assert runs["type"] == "table"
    assert all(t["instant"] is True and t["format"] == "table" for t in runs["targets"])
    assert all(re.search(r"\bby \(run_id(, mode)?\)", t["expr"]) for t in runs["targets"])
    assert [t["id"] for t in runs["transformations"]] == ["merge", "organize"]
    exprs = " ".join(t["expr"] for t in runs["targets"])
    for rule in ("run_id_stage:nanwatch_nonfinite_calls:increase5m", "run_id_dtype:nanwatch_sdpa_math_half_calls:increase5m",
                 "run_id:nanwatch_attention_logit_max:max", "nanwatch_directive_info", "nanwatch_live_ranks"):
        assert rule in exprs, rule
    run_id = [o for o in runs["fieldConfig"]["overrides"] if o["matcher"]["options"] == "run_id"][0]
    link = [p for p in run_id["properties"] if p["id"] == "links"][0]["value"][0]["url"]
    assert link.startswith("/d/nanwatch-run-health/") and "var-run_id=${__value.raw}" in link
    nonfinite = [o for o in runs["fieldConfig"]["overrides"] if o["matcher"]["options"] == "Value #B"][0]
    steps = [p for p in nonfinite["properties"] if p["id"] == "thresholds"][0]["value"]["steps"]
    assert steps[0]["color"] == "green" and steps[-1]["color"] == "red"


# ------------------------------------------------------------------------------------------------ provisioning


def test_provisioned_datasource_is_what_the_dashboards_pick():
    """The provisioned data source has the fixed uid the ``datasource`` variables default to, and their
    type, so every dashboard opens on it (and the variable lists it)."""
    sources = yaml.safe_load(DATASOURCES.read_text())
    assert sources["apiVersion"] == 1
    (prom,) = sources["datasources"]
    assert prom["uid"] == gen.DATASOURCE_UID == "nanwatch-prometheus"
    assert prom["type"] == "prometheus" and prom["url"] == "http://prometheus:9090" and prom["isDefault"] is True
    scrape = yaml.safe_load(PROMETHEUS_YML.read_text())["global"]["scrape_interval"]
    assert prom["jsonData"]["timeInterval"] == scrape  # $__rate_interval needs the real scrape interval
    for d in DASHBOARDS.values():
        var = variables(d)["datasource"]
        assert var["query"] == prom["type"]
        assert var["current"] == {"text": prom["name"], "value": prom["uid"]}


def test_dashboard_provider_reads_the_mounted_directory():
    providers = yaml.safe_load(PROVIDERS.read_text())
    assert providers["apiVersion"] == 1
    (p,) = providers["providers"]
    assert p["type"] == "file" and p["folder"] == "nanwatch"
    assert p["options"]["path"] == "/var/lib/grafana/dashboards/nanwatch"
