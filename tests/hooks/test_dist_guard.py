"""The skip is the job's decision, under every wrapper people train with (#16). Two gloo ranks under
torchrun, a tiny Qwen3, a NaN injected on rank 1 only, in one MLP, at step K: every rank skips step K,
every rank's weights (or FSDP2 shards) stay finite, every rank's report says rank 1 held the NaN, and rank
1's report names the MLP as the first offender. Without the guard's reduction the same runs leave rank 0's
weights NaN at step K (measured, DDP and FSDP2: the failure the issue reports).

One torchrun job runs every wrapper in turn (``dist_guard_worker.py``), once per test session: the
xdist workers share it through a file lock. It has a hard timeout that fails the tests rather than waits,
and the process group a 60 s collective timeout, so a hang (FSDP2's forward re-run on one rank, before)
is a failure.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from filelock import FileLock
from support import free_port

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

WORKER = Path(__file__).with_name("dist_guard_worker.py")
DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
WRAPPERS = ("ddp", "fsdp2", "accelerate", "trainer", "ddp_sync", "subgroups", "ddp_closure", "ddp_closure_sgd", *(("zero1", "zero2") if DEEPSPEED else ()))
K, LAYER, TIMEOUT_S = 2, "model.layers.0.mlp", 300


def _run_job(out: Path) -> str | None:
    """Run the job into ``out``; None, or why it failed (its output's tail)."""
    # DeepSpeed JIT-compiles its shared-memory op into torch's extensions folder under a lock file; a process
    # killed mid-build (anywhere on this machine, earlier) leaves the lock, and every later job waits on it
    # forever (seen here: zero1 and zero2 hung at init_distributed). The session's own folder: ~30 s a build.
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parents[1]),
               TORCH_EXTENSIONS_DIR=str(out / "torch_extensions"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "--master_addr=127.0.0.1", str(WORKER), str(out), *WRAPPERS]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and both ranks: the job's own session
        text, _ = proc.communicate()
        return f"the job did not finish within {TIMEOUT_S} s (a hang):\n{text[-3000:]}"
    return None if proc.returncode == 0 else f"the job failed (rc {proc.returncode}):\n{text[-4000:]}"


@pytest.fixture(scope="session")
def runs(tmp_path_factory) -> dict[str, list[list[dict]]]:
    """{wrapper: [rank 0's rows, rank 1's rows]}, from the one job of this session."""
    root = tmp_path_factory.getbasetemp()  # this session's (under xdist: the worker's; its parent the session's)
    root = root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root
    out = root / "dist-guard"
    with FileLock(str(root / "dist-guard.lock")):
        if not (out / "done.json").exists():
            out.mkdir(exist_ok=True)
            (out / "done.json").write_text(json.dumps({"error": _run_job(out)}))
    error = json.loads((out / "done.json").read_text())["error"]
    if error:
        pytest.fail(error)
    return {w: [json.loads((out / f"{w}.rank{r}.json").read_text()) for r in range(2)] for w in WRAPPERS}


def _assert_the_job_skipped_step_k(rank0: list[dict], rank1: list[dict]) -> None:
    for rank, rows in enumerate((rank0, rank1)):
        assert [r["step"] for r in rows] == list(range(len(rows))) and len(rows) > K + 1, rows
        assert [r["skipped"] for r in rows] == [n == K for n in range(len(rows))], (rank, rows)
        assert all(r["finite"] for r in rows), (rank, rows)
        assert [r["nonfinite_rank"] for r in rows] == [1 if n == K else None for n in range(len(rows))], (rank, rows)
    assert rank1[K]["first"] == LAYER and rank0[K]["first"] is None
    assert all(r["first"] is None for rows in (rank0, rank1) for r in rows if r["step"] != K)


@pytest.mark.slow
def test_ddp_with_gradient_accumulation_every_rank_skips_the_step_rank_1_saw_a_nan_in(runs):
    """Two micro-batches per step, the NaN in the first (under ``no_sync``): the flag covers both. Under
    DDP the replay runs on rank 1 alone, on the inner module (no collective), and finds the MLP."""
    rank0, rank1 = runs["ddp"]
    _assert_the_job_skipped_step_k(rank0, rank1)
    assert rank1[K]["incident"]["birth"] == LAYER and rank0[K]["incident"] is None


@pytest.mark.slow
def test_a_non_fused_optimizer_guarded_with_sync_reads_the_jobs_flag(runs):
    _assert_the_job_skipped_step_k(*runs["ddp_sync"])


@pytest.mark.slow
@pytest.mark.parametrize("wrapper", ["ddp_closure", "ddp_closure_sgd"], ids=["adamw_fused", "sgd"])
def test_ddp_stepped_by_a_closure_every_rank_skips_the_step_rank_1_saw_a_nan_in(runs, wrapper):
    """``opt.step(closure)``: the forward and backward run inside the step, after the guard was entered; the
    guard runs the closure first, so the job's flag (reduced over both ranks) covers them (#26)."""
    _assert_the_job_skipped_step_k(*runs[wrapper])


@pytest.mark.slow
def test_fsdp2_with_the_cpu_defaults_finishes_and_every_shard_stays_finite(runs):
    """Replay on (the CPU default): it declines under ``fully_shard`` and says so, rather than re-running a
    forward on rank 1 alone (which hung the job in FSDP's all-gathers)."""
    rank0, rank1 = runs["fsdp2"]
    _assert_the_job_skipped_step_k(rank0, rank1)
    incident = rank1[K]["incident"]
    assert incident["cls"] == "not_classified" and "fully_shard" in incident["note"], incident
    assert rank0[K]["incident"] is None
    assert all(r["params_checked"] > 0 for r in rank0 + rank1)  # the sweep read the local shards


@pytest.mark.slow
def test_accelerate_every_rank_skips_the_step_rank_1_saw_a_nan_in(runs):
    _assert_the_job_skipped_step_k(*runs["accelerate"])


@pytest.mark.slow
def test_hf_trainer_with_the_callback_under_torchrun_every_rank_skips_the_nan_step(runs):
    """``TrainingArguments(use_cpu=True, ddp_backend="gloo")``, gradient accumulation 2, HF's default
    fused AdamW: the callback's guard reduces across ranks with no option set."""
    rank0, rank1 = runs["trainer"]
    _assert_the_job_skipped_step_k(rank0, rank1)
    assert rank1[K]["incident"]["birth"] == LAYER


@pytest.mark.slow
@pytest.mark.skipif(not DEEPSPEED, reason="deepspeed is not installed")
@pytest.mark.parametrize("stage", [1, 2])
def test_deepspeed_zero_keeps_every_rank_finite_and_the_guard_never_hangs(runs, stage):
    """ZeRO-1/2 (fp32, CPU): DeepSpeed's own check (a global gradient norm, reduced over its data-parallel
    group) skips step K on every rank before its optimizer reaches the guarded torch optimizer, so the
    guard does not decide at K (``step_skipped`` None on both ranks, no reduction issued by either); at
    every other step it decides, and reduces, on both."""
    rank0, rank1 = runs[f"zero{stage}"]
    for rows in (rank0, rank1):
        assert [r["skipped"] for r in rows] == [None if n == K else False for n in range(len(rows))], rows
        assert all(r["finite"] for r in rows), rows
    assert rank1[K]["first"] == LAYER and rank1[K]["incident"]["birth"] == LAYER  # no collective in forward


@pytest.mark.slow
def test_each_rank_its_own_process_group_decides_alone(runs):
    """``MonitorConfig.weights.process_group`` reaches the guard: ranks that share no gradients, each its own group,
    do not skip for each other."""
    rank0, rank1 = runs["subgroups"]
    assert [r["skipped"] for r in rank1] == [n == K for n in range(len(rank1))]
    assert not any(r["skipped"] for r in rank0) and all(r["finite"] for r in rank0 + rank1)
    assert all(r["nonfinite_rank"] is None for r in rank0 + rank1)  # a group of one reduces nothing
