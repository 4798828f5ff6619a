"""Monitoring never breaks training, whatever ``TrainingArguments`` a user sets: ``NanwatchCallback`` in a real
HF ``Trainer`` over the combinations of ``torch_compile``, gradient checkpointing, gradient accumulation,
precision (fp32, bf16, fp16) and evaluation strategy, plus the ``deepspeed`` and ``fsdp`` settings.

The full product is 48 runs; a pairwise covering array of 6 runs meets every pair of values of any two
settings (checked below, so that a case cannot be dropped silently). ``deepspeed`` and ``fsdp`` run once
each, in a child process: they start a (one-rank, gloo) process group and Accelerate state that must not
leak into other tests. Every case checks that training finished, that every optimizer step was reported
once, that the Monitor measured the user's model through the wrapper (site names without a wrapper's
prefix), that it stays readable after ``train()``, that the local JSONL record holds every report and its
closing record, and that nanwatch logged no failure.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("datasets")

WORKER = Path(__file__).with_name("matrix_worker.py")
_spec = importlib.util.spec_from_file_location("matrix_worker", WORKER)
worker = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(worker)

#: the settings and their values; ``torch_compile`` uses the ``aot_eager`` backend (the same dynamo graphs
#: without Inductor's C++ compile, too slow for a 2-core CI)
FACTORS = {
    "precision": ("fp32", "bf16", "fp16"),
    "torch_compile": (False, True),
    "gradient_checkpointing": (False, True),
    "gradient_accumulation_steps": (1, 2),
    "eval_strategy": ("no", "steps"),
}
#: a pairwise covering array: each precision twice, its two rows complementary in the four two-valued
#: settings, the three row pairs chosen (0000, 0011, 0101) so that every two settings meet in every combination
PAIRWISE = [
    ("fp32", False, False, 1, "no"), ("fp32", True, True, 2, "steps"),
    ("bf16", False, False, 2, "steps"), ("bf16", True, True, 1, "no"),
    ("fp16", False, True, 1, "steps"), ("fp16", True, False, 2, "no"),
]


def _args(case: tuple) -> dict:
    precision, compiled, ckpt, ga, evals = case
    args = dict(torch_compile=compiled, gradient_checkpointing=ckpt, gradient_accumulation_steps=ga,
                eval_strategy=evals, bf16=precision == "bf16", fp16=precision == "fp16")
    if compiled:
        args["torch_compile_backend"] = "aot_eager"
    return args


def test_the_cases_cover_every_pair_of_settings():
    names = list(FACTORS)
    for (i, a), (j, b) in itertools.combinations(enumerate(names), 2):
        seen = {(row[i], row[j]) for row in PAIRWISE}
        assert seen == set(itertools.product(FACTORS[a], FACTORS[b])), (a, b)


def _check(facts: dict, *, wrapper_prefixes=("module.", "_orig_mod.", "_fsdp_wrapped_module.")) -> None:
    steps = list(range(1, worker.MAX_STEPS + 1))  # numbered as HF logs them (global_step)
    assert facts["train_steps"] == steps, facts  # one report per optimizer step, GA micro-batches included
    assert facts["last_step"] == steps[-1]  # callback.monitor.last_report() after train()
    assert all(n > 0 for n in facts["forwards"]) and all(n > 0 for n in facts["attention_calls"]), facts
    assert "model.layers.0.self_attn" in facts["sites"] or facts["attention_calls"], facts
    assert not [s for s in facts["sites"] if s.startswith(wrapper_prefixes)], facts["sites"]
    assert facts["jsonl_files"] == 1 and facts["jsonl_reports"] == facts["reports"], facts
    assert facts["jsonl_closed"] == 1
    assert facts["errors"] == [] and facts["failed"] == [], facts
    assert not [w for w in facts["nanwatch_warnings"] if "failed" in w], facts["nanwatch_warnings"]
    assert len(facts["loss_logged"]) == worker.MAX_STEPS


@pytest.mark.parametrize("case", PAIRWISE, ids=lambda c: "-".join(map(str, c)))
def test_training_arguments_combination(case, tmp_path):
    facts = worker.run_case(_args(case), str(tmp_path))
    _check(facts)
    if case[1]:  # torch.compile: the callback got the compiled wrapper and saw through it
        assert facts["wrapper"] == "OptimizedModule", facts["wrapper"]
    if case[4] == "steps":
        assert "eval" in facts["stages"], facts["stages"]  # the evaluation's forwards were seen, labelled


def _child(args: dict, tmp_path: Path, *extra: str) -> dict:
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(WORKER), json.dumps(args), str(tmp_path), *extra], env=env,
                          capture_output=True, text=True, timeout=300)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("MATRIX ")), None)
    assert proc.returncode == 0 and line is not None, (proc.stdout + proc.stderr)[-4000:]
    return json.loads(line.removeprefix("MATRIX "))


def _free_port() -> int:
    from support import free_port

    return free_port()


def test_deepspeed_string(tmp_path):
    """``deepspeed=<config>`` (ZeRO stage 0, one rank on the CPU accelerator): the callback is handed a
    ``DeepSpeedEngine``, which nanwatch unwraps (``.module``) so sites keep the user's names."""
    pytest.importorskip("deepspeed")
    config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "zero_optimization": {"stage": 0}}
    facts = _child({"deepspeed": config, "gradient_accumulation_steps": 2}, tmp_path, "--no-shm-op")
    assert facts["wrapper"] == "DeepSpeedEngine"
    _check(facts)


def test_fsdp_string(tmp_path):
    """``fsdp="full_shard"`` on one CPU rank: Accelerate wraps the model as it chooses for that setting
    (recorded in ``wrapper``), and training is monitored through it."""
    facts = _child({"fsdp": "full_shard", "gradient_accumulation_steps": 2}, tmp_path)
    assert facts["wrapper"] in ("FullyShardedDataParallel", "DistributedDataParallel"), facts["wrapper"]
    _check(facts)
