"""Two ``nanwatch serve`` replicas on one PostgreSQL database and one real Prometheus scraping both with the
shipped scrape job and rules (docs/replicas.md#metrics): a NaN committed after the exporting replica's last
scrape, then that replica killed -9, still pages, and the recorded count reads it once.

The gap is made certain, not left to timing: the exporter is frozen (SIGSTOP) first, so Prometheus's next
scrapes of it fail and no scrape of it can show the NaN; the NaN is posted through the other replica; then
the frozen one is killed (SIGKILL). PostgreSQL ends its session and its run lease, the other replica takes
the run and starts its series where the dead one's last export stood.
"""

from __future__ import annotations

import signal
import time

import httpx
import pytest
import yaml
from e2e.test_shards import ALERT_WITHIN_S, _firing, _prometheus_config
from e2e.test_stack import _query, _wait_for, _wait_ready
from support import JSON, CollectorProcess, free_port, require_tool, step_report

from nanwatch.wire import ReportBatch

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

RUN, SITE = "handover", "model.layers.1.self_attn"
TOTAL = f'nanwatch_run_nonfinite_calls_total{{run_id="{RUN}", stage="train", pass="forward", kind="nan"}}'
COUNT = f'run_id_stage:nanwatch_nonfinite_calls:increase5m{{run_id="{RUN}", stage="train"}}'


def _post(url: str, report) -> None:
    body = ReportBatch(reports=[report]).model_dump_json()
    for _ in range(200):  # a replica behind the database's revision asks for a retry, as the trainer's sender does
        resp = httpx.post(f"{url}/v1/reports", content=body, headers=JSON)
        if resp.status_code != 503:
            break
        time.sleep(0.02)
    assert resp.status_code == 200, resp.text


def test_a_nan_in_the_gap_before_the_exporter_is_killed_pages_and_counts_once(pg_url, tmp_path):
    import subprocess

    prometheus = require_tool("prometheus")
    (tmp_path / "metrics_token").write_text("replicas-metrics-token\n")
    env = {"NANWATCH_DATABASE_URL": pg_url, "NANWATCH_DATABASE_REFRESH_S": "0.2",
           "NANWATCH_METRICS_TOKEN_FILE": str(tmp_path / "metrics_token")}
    with CollectorProcess(db_path=tmp_path / "a.db", env=env) as a, \
            CollectorProcess(db_path=tmp_path / "b.db", env=env) as b:
        port = free_port()
        (tmp_path / "prom.yml").write_text(yaml.safe_dump(_prometheus_config([a.port, b.port],
                                                                             tmp_path / "metrics_token")))
        with open(tmp_path / "prometheus.log", "wb") as log:
            proc = subprocess.Popen([prometheus, f"--config.file={tmp_path / 'prom.yml'}",
                                     f"--storage.tsdb.path={tmp_path / 'prom'}", f"--web.listen-address=127.0.0.1:{port}"],
                                    stdout=log, stderr=log)
        try:
            prom = f"http://127.0.0.1:{port}"
            _wait_ready(f"{prom}/-/ready", proc, "prometheus")
            for seq in range(3):  # a healthy run, rank 0 through a and rank 1 through b: live on both
                _post(a.url, step_report(run_id=RUN, rank=0, world_size=2, seq=seq, step=seq, dtype="float32"))
                _post(b.url, step_report(run_id=RUN, rank=1, world_size=2, seq=seq, step=seq, dtype="float32"))
            # one replica exports the run, its zero scraped a few times
            [series] = _wait_for(lambda: (got := _query(prom, f"count_over_time({TOTAL}[1m]) >= 3")) and got,
                                 ALERT_WITHIN_S, "the run's series scraped from its exporter")
            owner, other = (a, b) if series["metric"]["instance"] == f"127.0.0.1:{a.port}" else (b, a)
            owner_instance = series["metric"]["instance"]

            owner.proc.send_signal(signal.SIGSTOP)  # no scrape of it succeeds from now on
            _post(other.url, step_report(run_id=RUN, rank=1, world_size=2, seq=3, step=3, nan_at=SITE, nan=1,
                                         dtype="float32"))
            owner.kill()

            fired = _wait_for(lambda: [x for x in _firing(prom, "NanwatchNonFiniteValues")
                                       if x["labels"]["run_id"] == RUN], ALERT_WITHIN_S, "the NaN page")
            assert len(fired) == 1
            # the dead exporter's series never showed the NaN: the gap was real, the page came through the
            # other replica's series, which started at 0 (the dead one's last export) and moved to 1
            [dead] = _query(prom, f'max_over_time({TOTAL[:-1]}, instance="{owner_instance}"}}[10m])')
            assert float(dead["value"][1]) == 0
            # counted once over both replicas' series, exactly: each instance's rise in the window, summed
            [rise] = _query(prom, f"sum by (run_id) (max by (run_id, instance) (max_over_time({TOTAL}[5m]) "
                                  f"- min_over_time({TOTAL}[5m])))")
            assert float(rise["value"][1]) == 1
            # and the recorded count (increase() extrapolates towards the window's end: with the new series' few
            # samples 1 s apart it reads up to ~1.9 at first, then settles at the one NaN)
            _wait_for(lambda: 0.9 <= float(_query(prom, COUNT)[0]["value"][1]) < 1.5, ALERT_WITHIN_S,
                      "the recorded count at one")
        finally:
            proc.terminate()
            proc.wait(10)
