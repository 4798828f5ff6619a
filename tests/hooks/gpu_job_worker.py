"""One rank of the GPU job-step test (started by torchrun from test_gpu.py: 2 ranks, gloo, both on cuda:0).

Each rank trains two Mixers on the GPU with a fused AdamW, nanwatch attached with ``report_scope="job"`` (the
job reduction: the reporter thread's gloo all-reduces), the weight guard on, the capsule on (idle: the steps
are clean) and ``rlhf(..., rollout_logprobs=)`` every step; every step runs under
``torch.cuda.set_sync_debug_mode("error")`` with "probe failed" warnings turned into errors. What the ranks
saw goes to ``<out>/rank<r>.json``.

Not covered here, and why: the guard's cross-rank flag reduction and the replica check are collectives on the
training process group over device tensors. On one GPU that group cannot be NCCL (NCCL refuses two ranks on
one device), and gloo reducing a CUDA tensor synchronises its own copy stream, which sync-debug would blame on
nanwatch. So the guard decides on each rank's own flag here (``guard_reduce=False``) and the replica check is
off; both need two GPUs.
"""

import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support import Mixer  # noqa: E402

import nanwatch  # noqa: E402

STEPS = 4


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.cuda.set_device(0)
    torch.manual_seed(0)  # the same weights on both ranks; each rank its own batch
    model = torch.nn.Sequential(Mixer(128), Mixer(128)).cuda().to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    g = torch.Generator(device="cuda").manual_seed(rank)
    x = torch.randn(2, 64, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    lp = -torch.rand(2, 64, device="cuda", generator=g)
    mask = torch.rand(2, 64, device="cuda", generator=g) > 0.2
    capsules = Path(out_dir, f"capsules{rank}")
    posts, own, errors = [], {}, []
    mon = nanwatch.attach(model, run_id="gpu-job", report_scope="job", optimizer=opt, guard_reduce=False,
                          replica_check_every=0, capsule=True, capsule_dir=str(capsules), heartbeat_s=3600.0,
                          report_reduce_timeout_s=30.0, on_report=posts.append,
                          is_attention=lambda n, m: isinstance(m, Mixer))
    for n in range(STEPS):  # step 0 allocates slots and host buffers; the rest are the steady state
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*probe failed.*")
            torch.cuda.set_sync_debug_mode("error")
            try:
                with mon.step(n):
                    y = model(x)
                    mon.rlhf(logprobs=lp, old_logprobs=lp * 0.9, ref_logprobs=lp * 1.1, mask=mask,
                             rollout_logprobs=lp * 1.05)
                    y.float().square().mean().backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
            except Exception as exc:  # noqa: BLE001 - recorded: the test names what synced
                errors.append(f"step {n}: {exc!r}")
            finally:
                torch.cuda.set_sync_debug_mode("default")
        own[n] = mon.last_report().model_dump(mode="json")
    mon.close()
    # the mode is live in this process: a deliberate host read under it must raise (so the steps above could fail)
    torch.cuda.set_sync_debug_mode("error")
    try:
        x.sum().item()
        caught = False
    except RuntimeError:
        caught = True
    finally:
        torch.cuda.set_sync_debug_mode("default")
    out = {"rank": rank, "own": own, "posts": [json.loads(p.model_dump_json()) for p in posts], "errors": errors,
           "sync_debug_caught_item": caught,
           "capsule_files": sorted(p.name for p in capsules.rglob("*")) if capsules.exists() else []}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
