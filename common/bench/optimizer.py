"""``nanwatch bench optimizer``: what guarding a non-fused optimizer and checking its update cost a step.

Four tiny Qwen3s (same weights, same batch), each with a non-fused AdamW (torch's default implementation
for the device) under its own Monitor: ``bare`` (nanwatch attached, ``guard="off"``,
``optimizer_check=False``), ``guard`` (the weight guard's one host read of the step's flag per optimizer
step), ``check`` (the post-step ``_foreach_norm(inf)`` of the updated parameters, no host read) and
``both`` (the defaults). The rerun is off in all four (it reads the flag too, on CPU). Each round runs a
block of steps of every arm back to back, the order rotating by round, and closes the block with one
device sync: on a GPU the host read's real cost is the CPU's lost head start over the device, which a sync
after every step would hide. Reported per arm: the median step, and its ratio to ``bare`` from paired
rounds (the median over rounds of each round's ratio), so drift and other load hit all arms alike. The
check's device work is also timed alone (``torch._foreach_norm(ord=inf)`` over the model's parameters, in
a loop, after training): on a loaded machine that figure is steadier than a difference of two steps.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import time
import warnings
from pathlib import Path

__all__ = ["ARMS", "main", "run"]

#: arm -> the MonitorConfig options it differs by
ARMS: dict[str, dict] = {
    "bare": {"guard": "off", "optimizer_check": False},
    "guard": {"guard": "auto", "optimizer_check": False},
    "check": {"guard": "off", "optimizer_check": True},
    "both": {"guard": "auto", "optimizer_check": True},
}


step_params: dict[str, list] = {}  # the first arm's parameters, for timing the check alone


def _arm(name: str, dev, *, seq: int, layers: int):
    """One model, its non-fused AdamW and Monitor; returns (monitor, step function)."""
    import torch

    import nanwatch
    from nanwatch.bench.step import lm_step
    from nanwatch.bench.tiny_models import tiny_qwen3

    model = tiny_qwen3("sdpa", vocab_size=128, use_cache=False, num_hidden_layers=layers).to(dev)
    step_params.setdefault("params", list(model.parameters()))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)  # no fused=: the host-read path
    mon = nanwatch.attach(model, run_id=f"bench-optimizer-{name}", optimizer=opt, rerun=False, **ARMS[name])
    ids = torch.randint(0, 128, (2, seq), generator=torch.Generator().manual_seed(0)).to(dev)
    return mon, lm_step(mon, model, opt, ids)


def run(*, device: str = "cpu", rounds: int = 30, warmup: int = 3, block: int = 4, seq: int = 64,
        layers: int = 2) -> dict:
    """One measurement; returns a JSON-ready dict."""
    import torch

    warnings.simplefilter("ignore")
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    arms = {name: _arm(name, dev, seq=seq, layers=layers) for name in ARMS}
    names = list(ARMS)
    times: dict[str, list[float]] = {name: [] for name in names}
    n = 0
    try:
        for r in range(warmup + rounds):
            order = names[r % len(names):] + names[: r % len(names)]
            for name in order:
                step = arms[name][1]
                sync()
                t0 = time.perf_counter()
                for _ in range(block):
                    step(n)
                    n += 1
                sync()
                if r >= warmup:
                    times[name].append((time.perf_counter() - t0) / block)
    finally:
        for mon, _ in arms.values():
            mon.close()
    params, alone = step_params.pop("params"), []
    for i in range(200):
        sync()
        t0 = time.perf_counter()
        torch.stack(torch._foreach_norm(params, ord=math.inf))
        sync()
        if i >= 20:
            alone.append(time.perf_counter() - t0)
    bare = times["bare"]
    out = {"device": device, "rounds": rounds, "block": block, "seq": seq, "layers": layers,
           "machine": f"{platform.machine()} {os.cpu_count()} cpus", "torch": torch.__version__,
           "cuda_device": torch.cuda.get_device_name() if dev.type == "cuda" else None}
    out["check_alone_s"] = statistics.median(alone)
    out["check_alone_share_of_step"] = out["check_alone_s"] / statistics.median(bare)
    for name in names:
        out[f"step_{name}_s"] = statistics.median(times[name])
        out[f"ratio_{name}"] = statistics.median(t / b for t, b in zip(times[name], bare, strict=True))
    return out


def format_table(r: dict) -> str:
    lines = [f"non-fused AdamW under nanwatch: {r['device']}, {r['rounds']} rounds of {r['block']} steps per arm "
             f"(tiny Qwen3, {r['layers']} layers, seq {r['seq']}; {r['machine']}, torch {r['torch']})"]
    what = {"bare": "guard off, no check", "guard": "guard (host read)", "check": "post-step check",
            "both": "guard + check (default)"}
    for name in ARMS:
        lines.append(f"{what[name]:<26} {r[f'step_{name}_s'] * 1e3:9.2f} ms  x{r[f'ratio_{name}']:.4f} of bare")
    lines.append(f"{'the check alone':<26} {r['check_alone_s'] * 1e3:9.3f} ms  "
                 f"{r['check_alone_share_of_step'] * 100:7.2f} % of a bare step")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="nanwatch bench optimizer", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--block", type=int, default=4, help="steps of one arm between two device syncs")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--json", dest="json_path", metavar="PATH", help="also write the result as JSON here")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0 or args.block < 1 or args.seq < 1 or args.layers < 1:
        print("nanwatch bench optimizer: need --rounds >= 1, --warmup >= 0, --block >= 1, --seq >= 1, --layers >= 1")
        return 2
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("nanwatch bench optimizer: --device cuda needs a GPU")
            return 2
    result = run(device=args.device, rounds=args.rounds, warmup=args.warmup, block=args.block, seq=args.seq,
                 layers=args.layers)
    print(format_table(result))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=2))
    return 0
