"""One rank of the distributed weight-guard test (started by test_weight_guard.py, gloo): a tiny fp16 eager
Qwen3 per rank, fused AdamW guarded by nanwatch, attention overflowing on rank 1 only at step K. Every
step's mode, skip flag and weight finiteness go to a file."""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support import guarded_step, overflow_attention, tiny_qwen3  # noqa: E402

import nanwatch  # noqa: E402

K, STEPS = 3, 10


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    model = tiny_qwen3("eager", dtype=torch.float16, vocab_size=64, use_cache=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    rows = []
    with nanwatch.attach(model, run_id="guard-dist", optimizer=opt,
                         collector=os.environ.get("NANWATCH_COLLECTOR")) as mon:
        for n in range(STEPS):
            if n == K and rank == 1:
                overflow_attention(model)
            rows.append(guarded_step(mon, model, opt, n)[1])
            dist.barrier()  # steps in lockstep, as data-parallel training is
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
