"""One rank of the job-report test (started by torchrun from test_job_report.py, gloo, 2 ranks).

A TinyNet per rank, nanwatch attached with ``report_scope="job"``; every step each rank keeps its own report
(``last_report()``) and everything it posts (``on_report``). The steps, by number:

0 clean; 1 NaN on rank 1 at ``blocks.1.out``; 2 NaN on rank 0 at ``blocks.1.out`` and on rank 1 at ``blocks.0.qkv`` (earlier);
3 NaN on both at ``blocks.1.out`` (a tie: the lowest rank); 4 the ranks watch different names (rank 1's NaN);
5 rank 1 runs attention on the math kernel; 6 rank 1 skips the step (catch-up); 7, 8 clean;
9, 10 rank 0 alone: rank 1 stops reporting (waits in a barrier), so the reduction times out and rank 0
falls back to per-rank reports. Every step, RLHF figures from per-rank seeded tensors.
"""

import json
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support import TinyNet, token_ids  # noqa: E402

import nanwatch  # noqa: E402

NAN_AT = {(1, 1): "blocks.1.out", (2, 0): "blocks.1.out", (2, 1): "blocks.0.qkv", (3, 0): "blocks.1.out", (3, 1): "blocks.1.out"}
TIMEOUT_S = 3.0


def rlhf_batch(step: int, rank: int, b: int = 3, t: int = 10):
    g = torch.Generator().manual_seed(100 * step + rank)
    lp = -torch.rand(b, t, generator=g) * 3 - 0.01
    old = lp + torch.randn(b, t, generator=g) * 0.3
    ref = lp + torch.randn(b, t, generator=g) * 0.5
    adv = torch.randn(b, generator=g) * (1 + rank)
    mask = torch.rand(b, t, generator=g) > 0.25
    rollout = lp - torch.randn(b, t, generator=g) * 0.05 * (1 + step)  # the sampler's view of the same tokens
    if (step, rank) in NAN_AT:  # a sampler NaN (in or out of the mask) where this rank differs anyway
        rollout[rank, step % t] = math.nan
    return dict(logprobs=lp, old_logprobs=old, ref_logprobs=ref, advantages=adv, mask=mask, rollout_logprobs=rollout)


def run_step(mon, model, n: int, rank: int) -> None:
    where = NAN_AT.get((n, rank))
    hook = None
    if where:
        hook = model.get_submodule(where).register_forward_pre_hook(  # the module's input: its output is NaN
            lambda m, a: (a[0].index_fill(0, torch.tensor([0]), math.nan),))
    with mon.step(n):
        x = model(token_ids(seed=10 * n + rank, vocab=64))
        if n == 4:
            mon.watch("extra.rank1" if rank else "extra.rank0", x * (math.nan if rank else 1.0))
        x.float().logsumexp(-1).mean().backward()
        mon.rlhf(**rlhf_batch(n, rank), kl_optimised="k3")
    if hook is not None:
        hook.remove()


def pooled_rlhf(n: int):
    """The RLHF figures of both ranks' step ``n`` seen by one process: what the job report must say."""
    with nanwatch.attach(torch.nn.Linear(2, 2), run_id="pooled", rank=0, world_size=1) as mon:
        with mon.step(n):
            for r in (0, 1):
                mon.rlhf(**rlhf_batch(n, r), kl_optimised="k3")
        return mon.last_report().rlhf.model_dump(mode="json")


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyNet()
    posts, own = [], {}
    mon = nanwatch.attach(model, run_id="job", report_scope="job", heartbeat_s=3600.0,
                          report_reduce_timeout_s=TIMEOUT_S, on_report=posts.append,
                          is_attention=lambda name, m: name.startswith("blocks.") and name.count(".") == 1)
    for n in range(9):
        if n == 6 and rank == 1:
            continue
        if n == 5 and rank == 1:
            with sdpa_kernel(SDPBackend.MATH):
                run_step(mon, model, n, rank)
        else:
            run_step(mon, model, n, rank)
        own[n] = mon.last_report().model_dump(mode="json")
    if rank == 0:
        for n in (9, 10):
            run_step(mon, model, n, rank)
            own[n] = mon.last_report().model_dump(mode="json")
        mon.close()
    dist.barrier()  # rank 1 waits here, not reporting, while rank 0 runs steps 9 and 10 and closes
    if rank == 1:
        mon.close(timeout=2 * TIMEOUT_S)  # its "closing" header finds no partner: bounded by the group timeout
    out = {"rank": rank, "own": own, "posts": [json.loads(p.model_dump_json()) for p in posts]}
    if rank == 0:
        out["pooled_rlhf"] = {n: pooled_rlhf(n) for n in range(9)}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
