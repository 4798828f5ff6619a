"""The same two-rank training run, reported per rank and as one job report per step, against one real
collector: `/metrics` gives the same answers (site counters, SDPA calls, first offender and its rank, the
per-rank non-finite and skipped-step counters), the guard kept every rank's weights finite, and in job mode a
rank that dies is seen stale from its missing heartbeats (``heartbeat_s`` 1 s here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from support import CollectorProcess, free_port, scrape

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("job_level_worker.py")
#: families whose samples must be the same whichever way the run was reported (run_id aside)
SAME = ("nanwatch_site_nonfinite_calls_total", "nanwatch_sdpa_calls_total", "nanwatch_first_offender_info",
        "nanwatch_nonfinite_calls_total", "nanwatch_skipped_steps_total", "nanwatch_run_world_size")


def _train(url: str, run_id: str, scope: str, mode: str, out: Path) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", NW_OUT=str(out))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "--master_addr=127.0.0.1", str(WORKER), url, run_id, scope, mode]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _finish(proc: subprocess.Popen) -> str:
    try:
        out, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"the training job did not finish in 300 s: {out[-3000:]}")
    return out


def _samples(metrics: dict, run_id: str) -> dict[tuple[str, frozenset], float]:
    """The run's samples of the compared families, without run_id, zeros dropped (a per-rank report makes
    a series for a clean rank at 0 that a job report has no reason to make)."""
    return {(name, frozenset((k, v) for k, v in labels if k != "run_id")): value
            for (name, labels), value in metrics.items()
            if name.removesuffix("_total") in {f.removesuffix("_total") for f in SAME}
            and ("run_id", run_id) in labels and value != 0}


@pytest.fixture(scope="module")
def both_ways(tmp_path_factory):
    out = tmp_path_factory.mktemp("job_level")
    with CollectorProcess(db_path=out / "nanwatch.db") as c:
        for scope in ("rank", "job"):
            proc = _train(c.url, f"cmp-{scope}", scope, "nan", out)
            log = _finish(proc)
            assert proc.returncode == 0, log[-3000:]
        yield c, scrape(c.url), out


def test_every_rank_kept_its_weights_finite_both_ways(both_ways):
    _, _, out = both_ways
    assert {p.name: p.read_text() for p in sorted(out.glob("cmp-*.rank*"))} == {
        f"cmp-{s}.rank{r}": "finite" for s in ("rank", "job") for r in (0, 1)}


def test_metrics_say_the_same_in_both_modes(both_ways):
    _, metrics, _ = both_ways
    per_rank, job = _samples(metrics, "cmp-rank"), _samples(metrics, "cmp-job")
    assert per_rank == job
    names = {name for name, _ in job}
    # both runs ended (every rank sent its final report): the per-rank series left with them, the run's stay
    assert {"nanwatch_site_nonfinite_calls_total", "nanwatch_first_offender_info",
            "nanwatch_sdpa_calls_total"} <= names, names
    assert not {"nanwatch_skipped_steps_total", "nanwatch_attention_mode"} & names, names
    first = [dict(labels) for name, labels in job if name == "nanwatch_first_offender_info"]
    assert [(f["site"], f["rank"]) for f in first] == [("model.layers.0.mlp", "1")]


def test_the_run_page_names_the_same_first_offender_and_rank(both_ways):
    c, _, _ = both_ways
    views = {}
    for scope in ("rank", "job"):
        with urllib.request.urlopen(f"{c.url}/v1/runs/cmp-{scope}", timeout=10) as r:
            fo = json.loads(r.read())["first_offender"]
        views[scope] = (fo["site"], fo["rank"], fo["step"])
    assert views["rank"] == views["job"] == ("model.layers.0.mlp", 1, 2)


def test_a_rank_that_dies_in_job_mode_goes_stale(tmp_path):
    """Rank 1 exits abruptly after step 2; rank 0 trains on for about ten seconds. With
    ``NANWATCH_RANK_TTL_S`` at 3 s (three heartbeat intervals), rank 1 leaves the live ranks while the run's
    world size stays 2: the signal ``NanwatchRankStale`` compares."""
    with CollectorProcess(db_path=tmp_path / "nanwatch.db", env={"NANWATCH_RANK_TTL_S": "3"}) as c:
        proc = _train(c.url, "killed", "job", "kill", tmp_path)
        seen = []
        try:
            while proc.poll() is None and (not seen or seen[-1] != (1.0, 2.0)):
                m = scrape(c.url)
                seen.append((m.get(("nanwatch_live_ranks", frozenset({("run_id", "killed")}))),
                             m.get(("nanwatch_run_world_size", frozenset({("run_id", "killed")})))))
                time.sleep(0.5)
        finally:
            log = _finish(proc)
        assert (2.0, 2.0) in seen and seen[-1] == (1.0, 2.0), (seen, log[-2000:])
