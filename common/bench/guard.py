"""``nanwatch bench guard``: what the weight guard's cross-rank reduction costs a data-parallel step.

Each rank trains two identical tiny Qwen3s under DistributedDataParallel, each with fused AdamW under the
weight guard: one with the guard's reduction (``guard_reduce=True``, the default: one async all-reduce of
two float32 per optimizer step, ``nanwatch.hooks.measure.collective``), one without (each rank decides alone).
Their steps are interleaved round by round (the order alternating), so drift and the other load on the
machine hit both alike; the added time is the median over rounds of each round's difference. The
reduction is also timed alone (``FlagReduction.reduce`` in a loop, after training). CPU runs on gloo;
``--device cuda`` on NCCL, one GPU per rank, a device sync closing each timed step.
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


def _arm(dev, *, reduce: bool, seq: int):
    """One DDP model, its guarded fused AdamW and Monitor; returns (monitor, step function)."""
    import torch

    import nanwatch
    from nanwatch.bench.step import lm_step
    from nanwatch.bench.tiny_models import tiny_qwen3

    model = torch.nn.parallel.DistributedDataParallel(
        tiny_qwen3("sdpa", vocab_size=128, use_cache=False).to(dev))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    mon = nanwatch.attach(model, run_id=f"bench-guard-{'on' if reduce else 'off'}", optimizer=opt,
                          guard_reduce=reduce)
    ids = torch.randint(0, 128, (2, seq), generator=torch.Generator().manual_seed(0)).to(dev)
    return mon, lm_step(mon, model, opt, ids)


def _worker(rank: int, world: int, port: int, device: str, rounds: int, warmup: int, seq: int,
            out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    from nanwatch.hooks.measure.collective import FlagReduction

    warnings.simplefilter("ignore")
    dev = _setup(rank, world, port, device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    arms = {"on": _arm(dev, reduce=True, seq=seq), "off": _arm(dev, reduce=False, seq=seq)}
    times: dict[str, list[float]] = {"on": [], "off": []}
    for r in range(warmup + rounds):
        for name in (("on", "off") if r % 2 == 0 else ("off", "on")):
            sync()
            t0 = time.perf_counter()
            arms[name][1](r)
            sync()
            if r >= warmup:
                times[name].append(time.perf_counter() - t0)
    for mon, _ in arms.values():
        mon.close()
    red, flag, alone = FlagReduction(), torch.zeros((), device=dev), []
    for i in range(300):
        sync()
        t0 = time.perf_counter()
        red.reduce(flag)
        sync()
        if i >= 50:
            alone.append(time.perf_counter() - t0)
    dist.barrier()  # no rank tears the group down while a peer's last reduction is still in flight (SIGABRT)
    dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({**times, "alone": alone}))


def run(*, ranks: int = 2, device: str = "cpu", rounds: int = 60, warmup: int = 5, seq: int = 64) -> dict:
    """One measurement with ``ranks`` processes; returns a JSON-ready dict (rank 0's times)."""
    import torch
    import torch.multiprocessing as mp

    from nanwatch.bench.serve import free_port

    with tempfile.TemporaryDirectory(prefix="nanwatch-guard-") as tmp:
        mp.start_processes(_worker, args=(ranks, free_port(), device, rounds, warmup, seq, tmp), nprocs=ranks,
                           start_method="spawn")
        res = json.loads(Path(tmp, "rank0.json").read_text())
    on, off, alone = res["on"], res["off"], res["alone"]
    off_s = statistics.median(off)
    added = statistics.median(a - b for a, b in zip(on, off, strict=True))
    reduce_s = statistics.median(alone)
    return {"ranks": ranks, "device": device, "rounds": rounds, "seq": seq,
            "step_off_s": off_s, "step_on_s": statistics.median(on), "added_s": added,
            "added_share_of_step": added / off_s, "reduce_s": reduce_s, "reduce_share_of_step": reduce_s / off_s,
            "machine": f"{platform.machine()} {os.cpu_count()} cpus", "torch": torch.__version__,
            "cuda_device": torch.cuda.get_device_name() if device == "cuda" else None}


def format_table(r: dict) -> str:
    return "\n".join([
        f"weight guard's cross-rank reduction: {r['ranks']} ranks, {r['device']}, {r['rounds']} interleaved rounds "
        f"(tiny Qwen3 under DDP, fused AdamW, seq {r['seq']}; {r['machine']}, torch {r['torch']})",
        f"{'step, reduction off':<28} {r['step_off_s'] * 1e3:9.2f} ms",
        f"{'step, reduction on':<28} {r['step_on_s'] * 1e3:9.2f} ms",
        f"{'added (paired median)':<28} {r['added_s'] * 1e3:9.3f} ms  {r['added_share_of_step'] * 100:7.2f} % of a step",
        f"{'the reduction alone':<28} {r['reduce_s'] * 1e3:9.3f} ms  {r['reduce_share_of_step'] * 100:7.2f} % of a step",
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="nanwatch bench guard", description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2, help="processes (gloo on CPU, NCCL with --device cuda)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--json", dest="json_path", metavar="PATH", help="also write the result as JSON here")
    args = p.parse_args(argv)
    if args.ranks < 2 or args.rounds < 1 or args.warmup < 0 or args.seq < 1:
        print("nanwatch bench guard: need --ranks >= 2 (one rank reduces nothing), --rounds >= 1, --seq >= 1")
        return 2
    if args.device == "cuda":
        import torch

        if torch.cuda.device_count() < args.ranks:
            print(f"nanwatch bench guard: --device cuda needs one GPU per rank ({args.ranks}), "
                  f"found {torch.cuda.device_count()}")
            return 2
    result = run(ranks=args.ranks, device=args.device, rounds=args.rounds, warmup=args.warmup, seq=args.seq)
    print(format_table(result))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=2))
    return 0
