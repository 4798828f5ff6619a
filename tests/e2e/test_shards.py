"""Two collector shards and one Prometheus, real processes on loopback: each run lives on one shard (as a
trainer's stable hash of its run id puts it), Prometheus scrapes both with the shipped scrape job and rule
file, and a run on either shard is charted (its series, every dashboard query answering) and alerted (a
NaN run on each shard fires NanwatchNonFiniteValues with its run_id). One shard's runs report per rank, the
other's as a job (job report, detail reports, heartbeats), so both modes are proven across shards too.

Reports are posted over HTTP as trainers send them (the trainer's shard choice is tested on its side).
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request

import httpx
import pytest
import yaml
from e2e.test_stack import ROOT, VARIABLES, _dashboards, _query, _wait_for, _wait_ready
from support import JSON, CollectorProcess, free_port, require_tool, step_report

from nanwatch.bench.jobs import heartbeat, job_step
from nanwatch.wire import ReportBatch

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

WORLD, LAYER = 4, "model.layers.1.self_attn"
#: shard -> (how its runs report, its NaN run, its healthy run)
RUNS = {0: ("rank", "shard0-nan", "shard0-ok"), 1: ("job", "shard1-nan", "shard1-ok")}
ALERT_WITHIN_S = 60  # scrape 1 s, evaluation 1 s, for: 0m


def _prometheus_config(ports: list[int], token_file) -> dict:
    """The shipped scrape job pointed at the two shards, the shipped rule file, no Alertmanager."""
    shipped = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    job = shipped["scrape_configs"][0]
    job["static_configs"] = [{"targets": [f"127.0.0.1:{p}" for p in ports]}]
    job.pop("dns_sd_configs", None)  # compose's replicas, by their compose DNS name
    job["authorization"]["credentials_file"] = str(token_file)
    return {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(ROOT / "deploy/prometheus/rules/nanwatch.yml")], "scrape_configs": [job]}


def _steps(run_id: str, *, nan: bool) -> list[list]:
    """Three steps of a 4-rank run; with ``nan``, rank 2 holds a NaN in layer 1 at step 1."""
    return [[step_report(run_id=run_id, rank=k, world_size=WORLD, seq=s, step=s, skipped=nan and s == 1,
                         nan_at=LAYER if nan and (k, s) == (2, 1) else None, nan=2 if nan and (k, s) == (2, 1) else 0)
             for k in range(WORLD)] for s in range(3)]


def _send(url: str, mode: str, run_id: str, *, nan: bool) -> None:
    def post(reports) -> None:
        r = httpx.post(f"{url}/v1/reports", content=ReportBatch(reports=reports).model_dump_json(), headers=JSON)
        assert r.status_code == 200, r.text

    if mode == "rank":
        for step in _steps(run_id, nan=nan):
            post(step)
        return
    post([heartbeat(run_id=run_id, rank=k, world_size=WORLD, seq=0, step=0) for k in range(WORLD)])
    seq = dict.fromkeys(range(WORLD), 0)
    for step in _steps(run_id, nan=nan):
        job, details = job_step(step)
        batch = []
        for r in [job, *details]:
            batch.append(r.model_copy(update={"seq": seq[r.rank]}))
            seq[r.rank] += 1
        post(batch)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    prometheus = require_tool("prometheus")
    tmp = tmp_path_factory.mktemp("shards")
    (tmp / "metrics_token").write_text("shards-metrics-token\n")
    env = {"NANWATCH_METRICS_TOKEN_FILE": str(tmp / "metrics_token")}
    with CollectorProcess(db_path=tmp / "c0.db", env=env) as c0, CollectorProcess(db_path=tmp / "c1.db", env=env) as c1:
        collectors = [c0, c1]
        prom_port = free_port()
        (tmp / "prom.yml").write_text(yaml.safe_dump(_prometheus_config([c.port for c in collectors],
                                                                        tmp / "metrics_token")))
        with open(tmp / "prometheus.log", "wb") as log:
            proc = subprocess.Popen([prometheus, f"--config.file={tmp / 'prom.yml'}",
                                     f"--storage.tsdb.path={tmp / 'prom'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
                                    stdout=log, stderr=log)
        try:
            _wait_ready(f"http://127.0.0.1:{prom_port}/-/ready", proc, "prometheus")
            for shard, (mode, bad, good) in RUNS.items():
                _send(collectors[shard].url, mode, bad, nan=True)
                _send(collectors[shard].url, mode, good, nan=False)
            yield {"prometheus": f"http://127.0.0.1:{prom_port}", "collectors": collectors}
        finally:
            proc.terminate()
            proc.wait(10)


def _firing(prometheus: str, alertname: str) -> list[dict]:
    with urllib.request.urlopen(f"{prometheus}/api/v1/alerts", timeout=10) as r:
        alerts = json.loads(r.read())["data"]["alerts"]
    return [a for a in alerts if a["labels"]["alertname"] == alertname and a["state"] == "firing"]


def test_a_nan_run_on_each_shard_fires_with_its_run_id(shards):
    want = {bad for _, bad, _ in RUNS.values()}
    fired = _wait_for(lambda: (got := {a["labels"]["run_id"]: a for a in _firing(
        shards["prometheus"], "NanwatchNonFiniteValues")}).keys() >= want and got, ALERT_WITHIN_S, "both NaN pages")
    assert set(fired) == want  # the healthy runs on either shard page nobody
    for run_id in want:  # and each page names the first offender, from its own shard's event log
        labels = fired[run_id]["labels"]
        assert (labels["site"], labels["pass"], labels["rank"]) == (LAYER, "forward", "2"), labels


def test_each_run_is_charted_from_its_own_shard(shards):
    prom = shards["prometheus"]
    _wait_for(lambda: len(_query(prom, "nanwatch_live_ranks")) == 4, ALERT_WITHIN_S, "every run's series")
    for shard, runs in RUNS.items():
        for run_id in runs[1:]:
            [series] = _query(prom, f'nanwatch_live_ranks{{run_id="{run_id}"}}')
            assert series["metric"]["instance"] == f"127.0.0.1:{shards['collectors'][shard].port}"
            assert series["value"][1] == str(WORLD)
            [world] = _query(prom, f'nanwatch_run_world_size{{run_id="{run_id}"}}')
            assert world["value"][1] == str(WORLD)
    # every dashboard query answers for a run on either shard (none errors on two targets' series), and the
    # panels that chart a run's measurements have its data
    gen = _dashboards()
    for run_id in ("shard0-nan", "shard1-nan"):
        for dashboard in gen.dashboards().values():
            for title, expr in gen.panel_queries(dashboard):
                for var, value in {**VARIABLES, "$run_id": run_id, "${run_id}": run_id}.items():
                    expr = expr.replace(var, value)
                if title in ("Non-finite values by site and pass", "Ranks missing", "Live ranks", "Runs"):
                    # a rate over a counter needs two scrapes of it
                    _wait_for(lambda expr=expr: _query(prom, expr), ALERT_WITHIN_S, f"{run_id}: {title}")
                else:
                    _query(prom, expr)  # asserts the query succeeded


def test_every_rule_evaluates_without_error_across_shards(shards):
    # both shards' series in (one tau per shard: a join on () would fail on them), then a few evaluations
    _wait_for(lambda: len(_query(shards["prometheus"], "nanwatch_collector_logit_tau")) == 2
              and _query(shards["prometheus"], "nanwatch_attention_logit_max"), ALERT_WITHIN_S, "both shards' series")
    time.sleep(3)
    with urllib.request.urlopen(f"{shards['prometheus']}/api/v1/rules", timeout=10) as r:
        groups = json.loads(r.read())["data"]["groups"]
    bad = [(rule["name"], rule.get("lastError")) for g in groups for rule in g["rules"] if rule["health"] != "ok"]
    assert groups and bad == []
