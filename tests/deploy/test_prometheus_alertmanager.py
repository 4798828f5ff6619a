"""deploy/prometheus and deploy/alertmanager, checked by the real tools (promtool, amtool from Debian's
packages) and against the collector's metric table and the runbook."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml
from support import require_tool

from nanwatch.monitor.metric_names import METRICS

ROOT = Path(__file__).resolve().parents[2]
PROM = ROOT / "deploy" / "prometheus"
RULES = PROM / "rules" / "nanwatch.yml"
AM = ROOT / "deploy" / "alertmanager" / "alertmanager.yml"
RUNBOOK = ROOT / "deploy" / "runbook.md"


def _run(*cmd: str) -> str:
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout + out.stderr


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
    assert "SUCCESS: 22 rules found" in _run(promtool, "check", "rules", str(RULES))


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
        assert a["labels"]["severity"] in ("critical", "warning", "info"), name
        assert re.fullmatch(r"\d+[smh]", a["for"]), name
        ann = a["annotations"]
        assert ann["summary"] and "{{" not in ann["summary"], name  # static summary
        assert "$labels" in ann["description"] or "$value" in ann["description"], name  # templated
        assert ann["runbook_url"] == f"deploy/runbook.md#{name.lower()}", name
        assert ann["dashboard_url"].startswith("/d/nanwatch-"), name


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


@pytest.mark.parametrize("severity,receiver", [("critical", "pager"), ("warning", "tickets"), ("info", "blackhole")])
def test_amtool_routes_each_severity(severity, receiver):
    amtool = require_tool("amtool")
    out = _run(amtool, "config", "routes", "test", f"--config.file={AM}", f"--verify.receivers={receiver}",
               f"severity={severity}", "run_id=grpo-0412", "alertname=NanwatchNonFiniteValues")
    assert out.strip().splitlines()[0] == receiver


def test_critical_inhibits_warning_for_the_same_run():
    (rule,) = yaml.safe_load(AM.read_text())["inhibit_rules"]
    assert rule["source_matchers"] == ['severity="critical"'] and rule["target_matchers"] == ['severity="warning"']
    assert rule["equal"] == ["run_id"]
