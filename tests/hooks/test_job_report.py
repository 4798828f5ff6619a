"""Job-level reports under torchrun (2 gloo ranks, a TinyNet each, ``report_scope="job"``): the job's report
against the ranks' own reports of the same steps, who posts what, the catch-up after a skipped step, and the
fallback when a peer stops reporting. One run of ``job_worker.py`` serves every test (its docstring lists the
steps); the run has a hard timeout that fails rather than waits."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import free_port

from nanwatch.hooks.report.job_stats import Table, merge_tables

STEPS_BOTH = [0, 1, 2, 3, 4, 5, 7, 8]  # steps both ranks ran (rank 1 skipped 6 and stopped after 8)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("job")
    worker = Path(__file__).with_name("job_worker.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "--master_addr=127.0.0.1", str(worker), str(out_dir)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"),
                         timeout=240)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    ranks = [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]
    return {"own": [{int(k): v for k, v in r["own"].items()} for r in ranks], "posts": [r["posts"] for r in ranks],
            "pooled_rlhf": {int(k): v for k, v in ranks[0]["pooled_rlhf"].items()}}


def _job(run, step):
    jobs = [p for p in run["posts"][0] if p["scope"] == "job" and p["step"] == step]
    assert len(jobs) == 1, (step, [(p["scope"], p["step"]) for p in run["posts"][0]])
    return jobs[0]


def _key(s):
    return s["site"], s["phase"], s["stage"]


def _max(values):
    finite = [v for v in values if not math.isnan(v)]
    return max(finite) if finite else math.nan


def _same(a, b):
    return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b)


@pytest.mark.slow
@pytest.mark.parametrize("step", STEPS_BOTH)
def test_job_report_sums_and_maxes_what_the_ranks_reported(run, step):
    job, own = _job(run, step), [run["own"][r][step] for r in (0, 1)]
    assert (job["rank"], job["world_size"], job["ranks_reporting"]) == (0, 2, 2)
    per_rank = [{_key(s): s for s in r["sites"]} for r in own]
    sites = {_key(s): s for s in job["sites"]}
    assert set(sites) == set(per_rank[0]) | set(per_rank[1])  # the union, also when the ranks' sets differ
    for key, s in sites.items():
        mine = [p[key] for p in per_rank if key in p]
        for field in ("calls", "numel", "nan", "inf"):
            assert s[field] == sum(m[field] for m in mine), (key, field)
        assert _same(s["amax"], _max([m["amax"] for m in mine])), key
        assert _same(s["headroom"], _max([m["headroom"] for m in mine])), key
    calls = {}
    for r in own:
        for c in r["sdpa"]:
            k = (c["site"], c["backend"], c["shape"], c["stage"])
            calls[k] = calls.get(k, 0) + c["calls"]
    assert {(c["site"], c["backend"], c["shape"], c["stage"]): c["calls"] for c in job["sdpa"]} == calls
    bounds = {}  # a NaN figure on any rank is the job's (the signal), else the largest
    for r in own:
        for lg in r["logits"]:
            bounds.setdefault(lg["layer"], []).append(lg["bound"])
    want = {k: math.nan if any(map(math.isnan, v)) else max(v) for k, v in bounds.items()}
    got = {lg["layer"]: lg["bound"] for lg in job["logits"]}
    assert got.keys() == want.keys() and all(_same(got[k], want[k]) for k in want), (got, want)
    for field in ("forwards", "attention_calls", "attention_probed", "params_checked"):
        assert job["coverage"][field] == sum(r["coverage"][field] for r in own), field
    # the first offender: the earliest in execution order (the job's site order), ties to the lowest rank
    order = [_key(s) for s in job["sites"]]
    held = [(order.index((r["first_offender"], r["first_offender_phase"], r["first_offender_stage"])), rank)
            for rank, r in enumerate(own) if r["first_offender"]]
    want = min(held) if held else None
    got = (order.index((job["first_offender"], job["first_offender_phase"], job["first_offender_stage"])),
           job["first_offender_rank"]) if job["first_offender"] else None
    assert got == want


@pytest.mark.slow
def test_first_offender_and_its_rank_at_the_injected_steps(run):
    got = {n: (_job(run, n)["first_offender"], _job(run, n)["first_offender_rank"]) for n in STEPS_BOTH}
    assert got == {0: (None, None), 1: ("blocks.1.out", 1), 2: ("blocks.0.qkv", 1), 3: ("blocks.1.out", 0), 4: ("extra.rank1", 1),
                   5: (None, None), 7: (None, None), 8: (None, None)}


@pytest.mark.slow
@pytest.mark.parametrize("step", STEPS_BOTH)
def test_job_rlhf_is_what_one_process_sees_of_both_ranks_batches(run, step):
    job, pooled = _job(run, step)["rlhf"], run["pooled_rlhf"][step]
    assert job.keys() == pooled.keys()
    for k, v in pooled.items():
        if isinstance(v, dict) and k == "rollout":  # the rollout mismatch too: sums summed, maxima maxed
            assert v["tokens"] and job[k].keys() == v.keys(), k
            for stat, x in v.items():
                assert job[k][stat] == (pytest.approx(x, rel=1e-9) if isinstance(x, float) else x), stat
        else:
            assert job[k] == (pytest.approx(v) if isinstance(v, float) else v), k


@pytest.mark.slow
def test_rank0_alone_posts_job_reports_and_a_detail_comes_only_from_a_rank_that_differs(run):
    posts0, posts1 = run["posts"]
    assert {p["rank"] for p in posts0} == {0} and {p["rank"] for p in posts1} == {1}
    assert not [p for p in posts1 if p["scope"] in ("job", "rank") and not p["final"]]  # (its final is its own)
    # rank 1: NaN at 1-4, the math kernel at 5; rank 0: NaN at 2 and 3
    assert [p["step"] for p in posts1 if p["scope"] == "detail"] == [1, 2, 3, 4, 5]
    assert [p["step"] for p in posts0 if p["scope"] == "detail"] == [2, 3]
    for p in posts0 + posts1:
        if p["scope"] == "detail" and p["first_offender"]:
            assert p["first_offender_rank"] == p["rank"]
    # rank 1 has nothing to add at 0, 7, 8: one heartbeat (heartbeat_s=3600: its first step), no report
    assert [(p["scope"], p["step"]) for p in posts1 if p["scope"] == "heartbeat"] == [("heartbeat", 0)]
    beat = next(p for p in posts1 if p["scope"] == "heartbeat")
    assert not (beat["sites"] or beat["sdpa"] or beat["logits"] or beat["rlhf"])
    for posts in (posts0, posts1):  # the idempotency key: never reused by a rank
        assert len({p["seq"] for p in posts}) == len(posts)


@pytest.mark.slow
def test_a_step_one_rank_skipped_goes_per_rank_and_the_next_is_the_jobs_again(run):
    assert [(p["scope"], p["step"]) for p in run["posts"][0] if p["step"] in (6, 7)] == [("rank", 6), ("job", 7)]


@pytest.mark.slow
def test_a_peer_that_stops_reporting_turns_rank0_to_per_rank_reports_without_stalling_it(run):
    # rank 1 stopped after step 8; rank 0's reduction of step 9 timed out (3 s), and rank 0 went on
    assert [(p["scope"], p["step"]) for p in run["posts"][0] if p["step"] >= 8 and not p["final"]] == [
        ("job", 8), ("rank", 9), ("rank", 10)]
    assert sorted(run["own"][0]) == list(range(11))


def test_a_site_only_one_rank_saw_joins_the_table_in_its_execution_order():
    def table(*sites):
        return Table(sites=tuple((s, "forward", "train", "module", "float32") for s in sites), sdpa=(), logits=(),
                     forwards=())
    merged = merge_tables([table("emb", "l0.router", "l1", "head"), table("emb", "l0.router", "l0.expert3", "l1",
                                                                          "head", "watch.x")])
    assert [s[0] for s in merged.sites] == ["emb", "l0.router", "l0.expert3", "l1", "head", "watch.x"]
    assert merged.digest() != table("emb").digest() and merged.digest() == merge_tables([merged, merged]).digest()


@pytest.mark.slow
def test_every_rank_sends_its_own_final_report_and_nothing_hangs(run):
    """#18: a normal close sends the rank's final report as its own (no job reduction: rank 0 closed while
    rank 1 waited in a barrier, and the run finished within its timeout)."""
    for r in (0, 1):
        posts = run["posts"][r]
        finals = [p for p in posts if p["final"]]
        assert finals == [posts[-1]], r
        assert (finals[0]["scope"], finals[0]["rank"], finals[0]["sites"]) == ("rank", r, [])
    assert run["posts"][0][-1]["step"] == 10 and run["posts"][1][-1]["step"] == 8
    seqs = [p["seq"] for p in run["posts"][0]]
    assert len(seqs) == len(set(seqs))  # numbered in the job's sequence: the idempotency key stays unique
