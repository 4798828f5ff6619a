"""``nanwatch bench replica``: what the replica check costs a data-parallel step, per check and amortised at
the default ``replica_check_every``.

Each rank trains a tiny Qwen3 under DistributedDataParallel with fused AdamW under the weight guard, the
replica check built but never due (so the step is the Monitor's usual one); the step is timed, then the
check alone (``ReplicaCheck.compare``: every parameter's and AdamW state tensor's fingerprint, the one
all-gather, the verdict) in a loop, every rank together. The ratios are to the median step. CPU runs on
gloo; ``--device cuda`` on NCCL, one GPU per rank, a device sync closing each timed call.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
import warnings
import weakref
from pathlib import Path

__all__ = ["main", "run"]


def _setup(rank: int, world: int, port: int, device: str):
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    return torch.device(device, rank) if device == "cuda" else torch.device("cpu")


def _worker(rank: int, world: int, port: int, device: str, steps: int, checks: int, seq: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    import nanwatch
    from nanwatch.bench.step import lm_step
    from nanwatch.bench.tiny_models import tiny_qwen3
    from nanwatch.hooks.config import WeightsConfig
    from nanwatch.hooks.failsafe import WarnOnce
    from nanwatch.hooks.measure.recorder import Recorder
    from nanwatch.hooks.remedies.replica_check import ReplicaCheck

    warnings.simplefilter("ignore")
    dev = _setup(rank, world, port, device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(tiny_qwen3("sdpa", vocab_size=128, use_cache=False).to(dev))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    mon = nanwatch.attach(model, run_id="bench-replica", optimizer=opt, replica_check_every=10**9)
    ids = torch.randint(0, 128, (2, seq), generator=torch.Generator().manual_seed(0)).to(dev)
    step = lm_step(mon, model, opt, ids)
    step_s, check_s = [], []
    for n in range(steps + 5):
        sync()
        t0 = time.perf_counter()
        step(n)
        sync()
        if n >= 5:
            step_s.append(time.perf_counter() - t0)
    # a check of its own on the same model and optimizer, timed alone (the Monitor's is built, never due)
    check = ReplicaCheck(opt, model=weakref.ref(model.module), rec=Recorder(dev), optimizers=lambda: [opt],
                         config=WeightsConfig(replica_check_every=10**9),
                         timeout_s=mon.config.reports.reduce_timeout_s, warn=WarnOnce())
    for i in range(checks + 3):
        sync()
        t0 = time.perf_counter()
        check.compare()
        sync()
        if i >= 3:
            check_s.append(time.perf_counter() - t0)
    tensors = len(check.layout.names)
    check.remove()
    mon.close()
    dist.barrier()
    dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"step": step_s, "check": check_s, "tensors": tensors}))


def run(*, ranks: int = 2, device: str = "cpu", steps: int = 40, checks: int = 30, seq: int = 64) -> dict:
    """One measurement with ``ranks`` processes; returns a JSON-ready dict (rank 0's times)."""
    import torch
    import torch.multiprocessing as mp

    from nanwatch.bench.serve import free_port
    from nanwatch.hooks import MonitorConfig

    with tempfile.TemporaryDirectory(prefix="nanwatch-replica-") as tmp:
        mp.start_processes(_worker, args=(ranks, free_port(), device, steps, checks, seq, tmp), nprocs=ranks,
                           start_method="spawn")
        res = json.loads(Path(tmp, "rank0.json").read_text())
    step_s, check_s = statistics.median(res["step"]), statistics.median(res["check"])
    every = MonitorConfig(run_id="r").weights.replica_check_every
    return {"ranks": ranks, "device": device, "seq": seq, "tensors": res["tensors"], "step_s": step_s,
            "check_s": check_s, "check_share_of_step": check_s / step_s, "default_every": every,
            "amortised_share_of_step": check_s / step_s / every,
            "machine": f"{platform.machine()} {os.cpu_count()} cpus", "torch": torch.__version__,
            "cuda_device": torch.cuda.get_device_name() if device == "cuda" else None}


def format_table(r: dict) -> str:
    return "\n".join([
        f"replica check: {r['ranks']} ranks, {r['device']} (tiny Qwen3 under DDP, fused AdamW, seq {r['seq']}, "
        f"{r['tensors']} tensors compared; {r['machine']}, torch {r['torch']})",
        f"{'a training step':<34} {r['step_s'] * 1e3:9.2f} ms",
        f"{'one check':<34} {r['check_s'] * 1e3:9.2f} ms  {r['check_share_of_step'] * 100:7.2f} % of a step",
        f"{'amortised, every ' + str(r['default_every']) + ' steps':<34} {r['check_s'] / r['default_every'] * 1e3:9.3f} ms"
        f"  {r['amortised_share_of_step'] * 100:7.3f} % of a step",
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="nanwatch bench replica", description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2, help="processes (gloo on CPU, NCCL with --device cuda)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--checks", type=int, default=30)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--json", dest="json_path", metavar="PATH", help="also write the result as JSON here")
    args = p.parse_args(argv)
    if args.ranks < 2 or args.steps < 1 or args.checks < 1 or args.seq < 1:
        print("nanwatch bench replica: need --ranks >= 2 (one replica compares nothing), --steps, --checks, --seq >= 1")
        return 2
    if args.device == "cuda":
        import torch

        if torch.cuda.device_count() < args.ranks:
            print(f"nanwatch bench replica: --device cuda needs one GPU per rank ({args.ranks}), "
                  f"found {torch.cuda.device_count()}")
            return 2
    result = run(ranks=args.ranks, device=args.device, steps=args.steps, checks=args.checks, seq=args.seq)
    print(format_table(result))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=2))
    return 0
