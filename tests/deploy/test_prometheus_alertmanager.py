"""deploy/prometheus and deploy/alertmanager, checked by the real tools (promtool, amtool from Debian's
packages) and against the collector's metric table and the runbook."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from support import load_script, require_tool

from nanwatch.monitor.read.metric_names import METRICS

ROOT = Path(__file__).resolve().parents[2]
PROM = ROOT / "deploy" / "prometheus"
RULES = PROM / "rules" / "nanwatch.yml"
TEMPLATE = PROM / "rules.in" / "nanwatch.yml"
AM = ROOT / "deploy" / "alertmanager" / "alertmanager.yml"
RUNBOOK = ROOT / "deploy" / "runbook.md"


def _run(*cmd: str) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout + out.stderr


gen = load_script(PROM / "generate.py", "nanwatch_rules_generate")


def _rules() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


ALERTS = [r for r in _rules() if "alert" in r]
RECORDS = {r["record"] for r in _rules() if "record" in r}


def test_promtool_checks_config_and_rules(tmp_path):
    promtool = require_tool("promtool")
    # the shipped file as it is, but for the scrape token's path (a compose secret), which promtool opens
    cfg = yaml.safe_load((PROM / "prometheus.yml").read_text())
    auth = cfg["scrape_configs"][0]["authorization"]
    assert auth == {"credentials_file": "/run/secrets/nanwatch_metrics_token"}
    (tmp_path / "token").write_text("t\n")
    auth["credentials_file"] = str(tmp_path / "token")
    cfg["rule_files"] = [str(PROM / "rules" / "*.yml")]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    _run(promtool, "check", "config", str(tmp_path / "prometheus.yml"))
    assert "SUCCESS: 40 rules found" in _run(promtool, "check", "rules", str(RULES))


def test_promtool_unit_tests_every_alert():
    promtool = require_tool("promtool")
    tests = sorted((PROM / "tests").glob("*.yml"))
    assert tests
    _run(promtool, "test", "rules", *map(str, tests))
    tested = set(re.findall(r"alertname: (\w+)", "".join(t.read_text() for t in tests)))
    assert tested == {a["alert"] for a in ALERTS}  # every alert, and only real ones


def test_every_alert_follows_the_conventions():
    assert len(ALERTS) >= 10
    for a in ALERTS:
        name = a["alert"]
        assert re.fullmatch(r"Nanwatch[A-Z][A-Za-z]+", name), name
        assert a["labels"]["severity"] in ("critical", "warning", "info", "none"), name
        assert (a["labels"]["severity"] == "none") == (name == "NanwatchWatchdog"), name
        assert re.fullmatch(r"\d+[smh]", a["for"]), name
        ann = a["annotations"]
        assert ann["summary"] and "{{" not in ann["summary"], name  # static summary
        assert "$labels" in ann["description"] or "$value" in ann["description"], name  # templated
        assert ann["runbook_url"] == f"{gen.DEFAULT_RUNBOOK_BASE}#{name.lower()}", name
        url = ann["dashboard_url"]
        assert url.startswith(f"{gen.DEFAULT_GRAFANA_BASE}/d/nanwatch-"), name
        assert "var-datasource=nanwatch-prometheus" in url and "from=now-6h&to=now" in url, name
        if "run_id" in a["expr"] and "nanwatch-run-health" in url:
            assert url.endswith("var-run_id={{ $labels.run_id | urlquery }}") or "var-rank=" in url, name


def test_rules_are_what_the_generator_renders_from_the_template():
    assert RULES.read_text() == gen.rendered()["nanwatch.yml"], "stale: python deploy/prometheus/generate.py"
    out = subprocess.run([sys.executable, str(PROM / "generate.py"), "--check"], capture_output=True, text=True,
                         cwd=ROOT, timeout=120, env={"PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr


def test_generator_bakes_in_the_bases_and_refuses_bad_ones(tmp_path):
    text = gen.rendered(runbook_base="https://runbooks.example.org/nanwatch",
                        grafana_base="https://grafana.example.org/")["nanwatch.yml"]
    alerts = [r for g in yaml.safe_load(text)["groups"] for r in g["rules"] if "alert" in r]
    for a in alerts:
        assert a["annotations"]["runbook_url"] == f"https://runbooks.example.org/nanwatch#{a['alert'].lower()}"
        assert a["annotations"]["dashboard_url"].startswith("https://grafana.example.org/d/nanwatch-")
    assert not re.search(r"@[A-Z_]+@", text)
    with pytest.raises(ValueError):
        gen.render("x", runbook_base="deploy/runbook.md")
    with pytest.raises(ValueError, match="@NOPE@"):
        gen.render("@NOPE@")
    assert gen.main(["--out", str(tmp_path), "--check"]) == 1  # missing
    assert gen.main(["--out", str(tmp_path)]) == 0 and gen.main(["--out", str(tmp_path), "--check"]) == 0
    (tmp_path / "nanwatch.yml").write_text((tmp_path / "nanwatch.yml").read_text().replace("for: 0m", "for: 1m", 1))
    assert gen.main(["--out", str(tmp_path), "--check"]) == 1  # edited by hand


def test_every_alert_has_a_runbook_section_with_checks_and_a_fix():
    text = RUNBOOK.read_text()
    sections = dict(re.findall(r"^## (\w+)\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S))
    assert set(sections) == {a["alert"] for a in ALERTS}
    for name, body in sections.items():
        assert "**Meaning:**" in body and "First three checks:" in body and "Fix:" in body, name
        assert re.search(r"^1\. .*^2\. .*^3\. ", body, flags=re.M | re.S), name



def test_rules_use_only_metrics_the_collector_exports():
    names = set(re.findall(r"\b(nanwatch_[a-z_]+|[a-z_]+:nanwatch_[a-z0-9_:]+)\b", RULES.read_text()))
    unknown = {n for n in names if n not in METRICS and n not in RECORDS}
    assert unknown == set()
    for rec in RECORDS:  # level:metric:operations
        assert re.fullmatch(r"[a-z_]+:nanwatch_[a-z_]+:[a-z0-9_]+", rec), rec


def test_amtool_checks_the_config():
    amtool = require_tool("amtool")
    _run(amtool, "check-config", str(AM))


@pytest.mark.parametrize("labels,receiver", [
    ({"severity": "critical", "alertname": "NanwatchNonFiniteValues", "run_id": "grpo-0412"}, "pager"),
    ({"severity": "critical", "alertname": "NanwatchLossScaleCollapsing", "run_id": "grpo-0412"}, "pager"),
    ({"severity": "warning", "alertname": "NanwatchNonFiniteOutsideTraining", "run_id": "grpo-0412"}, "tickets"),
    ({"severity": "warning", "alertname": "NanwatchRunCrashed", "run_id": "grpo-0412"}, "tickets"),
    ({"severity": "warning", "alertname": "NanwatchCollectorRejectingRequests", "reason": "unauthorized"}, "tickets"),
    ({"severity": "warning", "alertname": "NanwatchHostNotReproducible", "host": "gpu-7"}, "tickets"),
    ({"severity": "info", "alertname": "SomethingInformational", "run_id": "grpo-0412"}, "tickets"),
    ({"severity": "none", "alertname": "NanwatchWatchdog"}, "watchdog"),
])
def test_amtool_routes_each_alert_to_a_real_receiver(labels, receiver):
    amtool = require_tool("amtool")
    out = _run(amtool, "config", "routes", "test", f"--config.file={AM}", f"--verify.receivers={receiver}",
               *(f"{k}={v}" for k, v in labels.items()))
    assert out.strip().splitlines()[0] == receiver


def test_every_receiver_delivers_somewhere_and_the_watchdog_repeats_fast():
    cfg = yaml.safe_load(AM.read_text())
    for r in cfg["receivers"]:
        assert any(k.endswith("_configs") for k in r), f"receiver {r['name']} drops alerts"
    (wd,) = [r for r in cfg["route"]["routes"] if r["receiver"] == "watchdog"]
    assert wd["matchers"] == ['alertname="NanwatchWatchdog"'] and wd["repeat_interval"] == "1m"
    assert cfg["route"]["routes"][0] is wd  # before the severity routes


# ---- inhibition: Alertmanager's own semantics (matchers on source and target, equal labels, a missing label
# counting as equal), evaluated over the shipped rules. amtool has no inhibition test command.

def _matches(matcher: str, labels: dict[str, str]) -> bool:
    m = re.fullmatch(r'(\w+)\s*(=~|!~|!=|=)\s*"(.*)"', matcher)
    assert m, matcher
    name, op, value = m.groups()
    got = labels.get(name, "")
    return {"=": got == value, "!=": got != value, "=~": re.fullmatch(value, got) is not None,
            "!~": re.fullmatch(value, got) is None}[op]


def _inhibited(target: dict[str, str], firing: list[dict[str, str]]) -> bool:
    for rule in yaml.safe_load(AM.read_text())["inhibit_rules"]:
        if not all(_matches(m, target) for m in rule["target_matchers"]):
            continue
        for source in firing:
            if source is target or not all(_matches(m, source) for m in rule["source_matchers"]):
                continue
            if all(source.get(k, "") == target.get(k, "") for k in rule.get("equal", [])):
                return True
    return False


def _alert(name: str, **labels: str) -> dict[str, str]:
    severity = {a["alert"]: a["labels"]["severity"] for a in ALERTS}.get(name, labels.pop("severity", "warning"))
    return {"alertname": name, "severity": severity, **labels}


def test_inhibition_mutes_related_alerts_of_the_same_run_only():
    nan = _alert("NanwatchNonFiniteValues", run_id="a", stage="train")
    crash = _alert("NanwatchRunCrashed", run_id="c")
    down = _alert("NanwatchCollectorDown", instance="collector:8000", job="nanwatch-collector")
    firing = [nan, crash, down]
    assert _inhibited(_alert("NanwatchHeadroomLow", run_id="a", site_kind="logits"), firing)
    assert _inhibited(_alert("NanwatchStepsSkipped", run_id="a"), firing)
    assert _inhibited(_alert("NanwatchRankStale", run_id="c", rank="1"), firing)
    assert _inhibited(_alert("NanwatchAttentionLogitGrowing", run_id="b", layer="l0"),
                      [_alert("NanwatchAttentionLogitHigh", run_id="b", layer="l0")])
    # another run, an unrelated alert of the same run, an alert of another project, alerts without run_id
    assert not _inhibited(_alert("NanwatchHeadroomLow", run_id="b", site_kind="logits"), firing)
    assert not _inhibited(_alert("NanwatchRankStale", run_id="a", rank="1"), firing)
    assert not _inhibited(_alert("NanwatchAttentionLogitGrowing", run_id="b", layer="l1"),
                          [_alert("NanwatchAttentionLogitHigh", run_id="b", layer="l0")])
    assert not _inhibited(_alert("KubePodCrashLooping", severity="warning", run_id="a", pod="p"), firing)
    assert not _inhibited(_alert("NanwatchCollectorCapHit", cap="runs"), firing)
    assert not _inhibited(_alert("KubeCPUOvercommit", severity="warning"), firing)
    # a source without run_id never inhibits (two missing labels would count as equal)
    assert not _inhibited(_alert("NanwatchHeadroomLow", site_kind="logits"),
                          [_alert("NanwatchNonFiniteValues", stage="train")])


def test_every_inhibition_names_real_alerts_and_requires_run_id():
    names = {a["alert"] for a in ALERTS}
    for rule in yaml.safe_load(AM.read_text())["inhibit_rules"]:
        assert 'run_id=~".+"' in rule["source_matchers"] and "run_id" in rule["equal"], rule
        for m in rule["source_matchers"] + rule["target_matchers"]:
            if m.startswith("alertname"):
                alternatives = re.fullmatch(r'alertname=~?"(.*)"', m).group(1).split("|")
                assert set(alternatives) <= names, m
