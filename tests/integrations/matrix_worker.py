"""One case of the callback matrix (test_callback_matrix.py): a tiny Qwen3 trained by a real HF ``Trainer``
under the given ``TrainingArguments`` with ``NanwatchCallback``, and what nanwatch did, as JSON-able facts.

Run in the test's process for the plain cases, and as ``python matrix_worker.py '<json args>' OUT_DIR`` for the
``deepspeed``/``fsdp`` ones, which initialise a process group and Accelerate state that must not outlive them.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from support import step_reports, tiny_qwen3  # noqa: E402

MAX_STEPS = 2


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def run_case(args: dict, out_dir: str) -> dict:
    """Train ``MAX_STEPS`` optimizer steps; return what the test checks."""
    import transformers
    from datasets import Dataset

    from nanwatch.hooks.integrations.transformers import NanwatchCallback

    ids = torch.randint(0, 64, (16, 12), generator=torch.Generator().manual_seed(0)).tolist()
    ds = Dataset.from_dict({"input_ids": ids, "labels": ids})
    base = dict(output_dir=os.path.join(out_dir, "out"), per_device_train_batch_size=2, use_cpu=True,
                max_steps=MAX_STEPS, logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
                seed=0, eval_steps=1)
    targs = transformers.TrainingArguments(**{**base, **args})
    model = tiny_qwen3("sdpa", vocab_size=64, hidden_size=32, intermediate_size=64, use_cache=False)
    reports = []
    log_dir = os.path.join(out_dir, "nanwatch")
    cb = NanwatchCallback(run_id="matrix", on_report=step_reports(reports), log_dir=log_dir)
    trainer = transformers.Trainer(model=model, args=targs, train_dataset=ds, eval_dataset=ds.select(range(4)),
                                   callbacks=[cb])
    logger, records = logging.getLogger("nanwatch"), _Records()
    logger.addHandler(records)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.train()
    finally:
        logger.removeHandler(records)
    last = cb.monitor.last_report(timeout=10) if cb.monitor is not None else None
    files = sorted(os.listdir(log_dir)) if os.path.isdir(log_dir) else []
    lines = [json.loads(line) for f in files for line in open(os.path.join(log_dir, f), encoding="utf-8")]
    return dict(
        wrapper=type(trainer.model_wrapped).__name__,
        train_steps=[r.step for r in reports if r.stage == "train"],
        stages=sorted({s.stage for r in reports for s in r.sites} | {r.stage for r in reports}),
        forwards=[r.coverage.forwards for r in reports if r.stage == "train"],
        attention_calls=[r.coverage.attention_calls for r in reports if r.stage == "train"],
        sites=sorted({s.site for r in reports for s in r.sites}),
        last_step=None if last is None else last.step,
        errors=[r.getMessage() for r in records.records if r.levelno >= logging.ERROR],
        failed=[r.getMessage() for r in records.records if "failed" in r.getMessage()],
        nanwatch_warnings=sorted({str(w.message) for w in caught if str(w.message).startswith("nanwatch")}),
        jsonl_files=len(files), jsonl_reports=sum("seq" in x and not x.get("final") for x in lines),
        jsonl_closed=sum(x.get("nanwatch_log") == "closed" or x.get("final") is True for x in lines), reports=len(reports),
        loss_logged=[h["loss"] for h in trainer.state.log_history if "loss" in h],
    )


if __name__ == "__main__":
    if sys.argv[3:] == ["--no-shm-op"]:
        # DeepSpeed JIT-compiles a C++ shared-memory all-reduce for the CPU on first use (150 s on 2 cores,
        # then cached); a world of one never all-reduces through it
        import deepspeed.comm.torch as ds_comm

        ds_comm.build_shm_op = lambda: None
    warnings.simplefilter("ignore")
    print("MATRIX " + json.dumps(run_case(json.loads(sys.argv[1]), sys.argv[2])))
