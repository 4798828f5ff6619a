"""The replica check (#29) on real gloo process groups, one process per rank (``replica_worker.py``): a bit
flipped in one replica's weights is found at the next check, with the ranks that disagree with the
majority (with two replicas, both) and the parameter named; with three replicas and repair on, the
majority's weights are broadcast and the replicas are bit-identical again; FSDP2 HSDP compares each shard
across its replicate group; 500 healthy steps (AdamW, dropout, gradient accumulation) raise no alarm; a rank
that raises inside the check's step leaves the other with a warning, not a hang."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import free_port

WORKER = Path(__file__).with_name("replica_worker.py")
K, PARAM, TIMEOUT_S = 2, "0.weight", 120


def _job(scenario: str, world: int, out: Path) -> list[dict]:
    """Run ``scenario`` on ``world`` ranks (each its own process, so that one that fails stops no other);
    every rank's result."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               WORLD_SIZE=str(world), PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    procs = [subprocess.Popen([sys.executable, str(WORKER), scenario, str(out)], env=dict(env, RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    texts = []
    for p in procs:
        try:
            texts.append(p.communicate(timeout=TIMEOUT_S)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"{scenario}: a rank did not finish within {TIMEOUT_S} s (a hang)")
    results = []
    for r in range(world):
        f = out / f"rank{r}.json"
        assert f.exists(), f"rank {r} wrote nothing:\n" + texts[r][-3000:]
        results.append(json.loads(f.read_text()))
    return results


def _incidents(result: dict) -> dict[int, dict]:
    return {row["step"]: row["incident"] for row in result["rows"] if row["incident"] is not None}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_a_bit_flipped_in_one_ddp_replica_is_found_at_the_next_check(tmp_path, world):
    results = _job("flip", world, tmp_path)
    expected = [0, 1] if world == 2 else [1]  # two replicas: no majority, both named
    for res in results:
        incidents = _incidents(res)
        assert list(incidents) == [K + 1, K + 3, K + 5][: len(incidents)] and K + 1 in incidents, res["rows"]
        first = incidents[K + 1]
        assert first["ranks"] == expected and first["params"][0] == PARAM, first
        assert len(first["hosts"]) == len(expected) and all(first["hosts"]), first
        assert first["repaired"] is None
        if world == 2:
            assert "no majority" in first["note"], first
    assert results[0]["fingerprints"] != results[1]["fingerprints"]  # nothing repaired them


@pytest.mark.slow
def test_with_three_replicas_repair_makes_them_bit_identical_again(tmp_path):
    results = _job("repair", 3, tmp_path)
    for res in results:
        incidents = _incidents(res)
        assert list(incidents) == [K + 1], res["rows"]  # repaired: the later checks pass
        inc = incidents[K + 1]
        assert inc["ranks"] == [1] and inc["params"][0] == PARAM and inc["repaired"] is True, inc
    assert results[0]["fingerprints"] == results[1]["fingerprints"] == results[2]["fingerprints"]


@pytest.mark.slow
def test_fsdp2_hsdp_compares_each_shard_across_its_replicas(tmp_path):
    """Mesh (replicate 2, shard 2): ranks 1 and 3 hold the same shard. The flip on rank 1's shard is seen
    by that replicate group (two replicas: both named), not by ranks 0 and 2, whose shards agree."""
    pytest.importorskip("torch.distributed.fsdp")
    results = _job("hsdp", 4, tmp_path)
    for rank, res in enumerate(results):
        incidents = _incidents(res)
        if rank in (0, 2):
            assert incidents == {}, (rank, incidents)
            continue
        inc = incidents[K + 1]
        assert inc["ranks"] == [1, 3] and inc["params"][0] == PARAM, (rank, inc)


@pytest.mark.slow
def test_500_healthy_ddp_steps_with_adamw_dropout_and_accumulation_raise_no_alarm(tmp_path):
    results = _job("healthy", 2, tmp_path)
    for res in results:
        assert len(res["rows"]) == 500 and _incidents(res) == {}, _incidents(res)
        assert not [w for w in res["warnings"] if "replica" in w], res["warnings"]
    assert results[0]["fingerprints"] == results[1]["fingerprints"]


@pytest.mark.slow
def test_a_rank_raising_in_the_checks_step_leaves_the_other_warned_not_hung(tmp_path):
    rank0, rank1 = _job("raise", 2, tmp_path)
    assert "optimizer step" in rank1["raised"]
    assert "raised" not in rank0, rank0
    assert [w for w in rank0["warnings"] if "replica check" in w and "failed" in w], rank0["warnings"]


def test_the_verdict_names_the_minority_and_says_when_there_is_no_majority():
    import torch

    from nanwatch.hooks.measure.replica_verdict import MAX_NAMED, verdict

    table = torch.zeros((3, 5, 2), dtype=torch.int64)
    table[1, 3, 0] = 7  # replica 1 differs in tensor 3
    values, src = verdict(table)
    checked, differ, no_majority, *rest = values.tolist()
    assert (checked, differ, no_majority) == (1, 1, 0)
    assert rest[:3] == [0, 1, 0] and rest[3:3 + MAX_NAMED] == [4] + [0] * (MAX_NAMED - 1)
    assert src.tolist() == [-1, -1, -1, 0, -1]  # copy tensor 3 from replica 0
    values, src = verdict(table[:2])  # two replicas: both out, no majority, nothing to copy from
    assert values[:5].tolist() == [1, 1, 1, 1, 1] and src.tolist() == [-1] * 5
