"""One rank of the per-rank vs job-level comparison (started by torchrun from test_job_level.py, gloo, 2
ranks): a tiny Qwen3 in DDP, a fused AdamW under the weight guard, a real collector. Rank 1 gets a NaN at
the output of ``model.layers.0.mlp`` at step 2; with ``kill`` rank 1 instead dies abruptly after step 2
while rank 0 trains on (no DDP then: a dead partner would hang its all-reduce, which is not what is tested).
"""

import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support import SMALL, tiny_qwen3, token_ids  # noqa: E402

import nanwatch  # noqa: E402

STEPS, NAN_STEP, KILLED_RUN_STEPS = 5, 2, 14


def main(url: str, run_id: str, scope: str, mode: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = tiny_qwen3("sdpa", **SMALL, use_cache=False)
    wrapped = torch.nn.parallel.DistributedDataParallel(model) if mode == "nan" else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    mlp = model.get_submodule("model.layers.0.mlp")
    options = dict(report_scope=scope, heartbeat_s=1.0, report_reduce_timeout_s=3.0, rerun=False)
    with nanwatch.attach(wrapped, run_id=run_id, collector=url, optimizer=opt, **options) as mon:
        for n in range(STEPS if mode == "nan" else KILLED_RUN_STEPS if rank == 0 else NAN_STEP + 1):
            poison = mlp.register_forward_hook(  # before nanwatch's own hook: the NaN is born in the MLP
                lambda m, a, out: out.index_fill(1, torch.tensor([0]), math.nan), prepend=True) \
                if (mode == "nan" and rank == 1 and n == NAN_STEP) else None
            with mon.step(n):
                ids = token_ids(seed=10 * n + rank)
                wrapped(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad()
            if poison is not None:
                poison.remove()
            mon.last_report()
            if mode == "kill" and rank == 0 and n >= NAN_STEP:
                time.sleep(1.0)  # rank 0 lives on, well past rank 1's heartbeat interval and the TTL
        if mode == "kill" and rank == 1:
            time.sleep(2.0)  # what it sent reaches the collector (a loaded machine delays the sender thread)
            os._exit(0)  # then abruptly: no final report, no close
    finite = all(torch.isfinite(p).all() for p in model.parameters())
    Path(os.environ["NW_OUT"], f"{run_id}.rank{rank}").write_text("finite" if finite else "non-finite")
    if mode == "nan":
        dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:5])
