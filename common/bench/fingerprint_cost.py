"""``nanwatch bench fingerprint``: what the weight fingerprint (``nanwatch.fingerprint``) of a model-sized set
of tensors costs, as a ratio to one AdamW step on the same tensors.

The tensors are a transformer's shapes in fp32 (per layer: four ``[h, h]`` attention projections, three
``[4h, h]`` MLP matrices, two norms; plus an ``[8h, h]`` embedding), about ``--params`` elements in all.
Arms, each timed once per round with the order rotating by round: ``fingerprint`` (every tensor, chunked,
one host read at the end), ``publish`` (what ``Monitor.publish_weights`` computes before it posts: the
fingerprint and the fingerprint of every tensor cast to bfloat16, the default ``rollout_dtype``), ``adamw`` (torch's default AdamW implementation for the device, every tensor
with a gradient) and ``adamw_fused`` (``fused=True``). Reported: each arm's median and the fingerprint's
ratio (and the publish's) to each AdamW step from paired rounds (the median of each round's ratio). AdamW holds four copies
of the weights (weights, gradients, two moments: 16 bytes a parameter in fp32) plus its temporaries: size
``--params`` to the memory at hand (1e9 needs about 20 GB). The default is small (seconds).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

__all__ = ["ARMS", "main", "model_shapes", "run"]

ARMS = ("fingerprint", "publish", "adamw", "adamw_fused")


def model_shapes(params: int, hidden: int) -> list[tuple[int, ...]]:
    """A transformer's weight shapes of about ``params`` elements at width ``hidden`` (at least one layer)."""
    h = hidden
    per_layer = 4 * h * h + 3 * 4 * h * h + 2 * h
    layers = max(1, (params - 8 * h * h) // per_layer)
    shapes: list[tuple[int, ...]] = [(8 * h, h)]
    for _ in range(layers):
        shapes += [(h, h)] * 4 + [(4 * h, h)] * 3 + [(h,)] * 2
    return shapes


def run(*, device: str = "cpu", params: int = 4_000_000, hidden: int = 256, rounds: int = 5,
        warmup: int = 1, chunk_elements: int | None = None) -> dict:
    """One measurement; returns a JSON-ready dict."""
    import torch

    import nanwatch
    from nanwatch.hooks.rollout.weight_fingerprint import DEFAULT_CHUNK_ELEMENTS, fingerprint_with_casts

    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    chunk = chunk_elements or DEFAULT_CHUNK_ELEMENTS
    g = torch.Generator(device=dev).manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(s, generator=g, device=dev)) for s in model_shapes(params, hidden)]
    for w in weights:
        w.grad = torch.randn(w.shape, generator=g, device=dev) * 1e-3
    state = {f"w{i}": w for i, w in enumerate(weights)}
    opts = {"adamw": torch.optim.AdamW(weights, lr=1e-6), "adamw_fused": torch.optim.AdamW(weights, lr=1e-6, fused=True)}
    arms = {"fingerprint": lambda: nanwatch.fingerprint(state, chunk_elements=chunk),
            "publish": lambda: fingerprint_with_casts(state, [torch.bfloat16], chunk_elements=chunk),
            "adamw": opts["adamw"].step, "adamw_fused": opts["adamw_fused"].step}
    times: dict[str, list[float]] = {a: [] for a in ARMS}
    with torch.no_grad():
        for r in range(warmup + rounds):
            for name in ARMS[r % len(ARMS):] + ARMS[: r % len(ARMS)]:
                sync()
                t0 = time.perf_counter()
                arms[name]()
                sync()
                if r >= warmup:
                    times[name].append(time.perf_counter() - t0)
    n = sum(w.numel() for w in weights)
    out = {"device": device, "params": n, "tensors": len(weights), "hidden": hidden, "rounds": rounds,
           "chunk_elements": chunk, "machine": f"{platform.machine()} {os.cpu_count()} cpus",
           "threads": torch.get_num_threads(), "torch": torch.__version__,
           "cuda_device": torch.cuda.get_device_name() if dev.type == "cuda" else None}
    for name in ARMS:
        out[f"{name}_s"] = statistics.median(times[name])
    for opt in ("adamw", "adamw_fused"):
        out[f"ratio_to_{opt}"] = statistics.median(
            f / a for f, a in zip(times["fingerprint"], times[opt], strict=True))
        out[f"publish_ratio_to_{opt}"] = statistics.median(
            f / a for f, a in zip(times["publish"], times[opt], strict=True))
    out["publish_ratio_to_fingerprint"] = statistics.median(
        p / f for p, f in zip(times["publish"], times["fingerprint"], strict=True))
    return out


def format_table(r: dict) -> str:
    lines = [f"weight fingerprint vs one AdamW step: {r['device']}, {r['params'] / 1e6:.1f}M fp32 parameters in "
             f"{r['tensors']} tensors, {r['rounds']} rounds ({r['machine']}, {r['threads']} threads, torch {r['torch']})"]
    for name in ARMS:
        lines.append(f"{name:<14} {r[f'{name}_s'] * 1e3:10.1f} ms")
    lines.append(f"fingerprint / adamw        x{r['ratio_to_adamw']:.3f} (paired by round)")
    lines.append(f"fingerprint / adamw_fused  x{r['ratio_to_adamw_fused']:.3f} (paired by round)")
    lines.append(f"publish / adamw            x{r['publish_ratio_to_adamw']:.3f} (paired by round)")
    lines.append(f"publish / fingerprint      x{r['publish_ratio_to_fingerprint']:.3f} (the bf16 casts' share)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="nanwatch bench fingerprint", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--params", type=float, default=4e6, help="elements in all (1e9: a 1B model's weights)")
    p.add_argument("--hidden", type=int, default=256, help="the model width the shapes follow (2048 for 1B)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--chunk-elements", type=int, default=None, help="the fingerprint's chunk (default 4M)")
    p.add_argument("--json", dest="json_path", metavar="PATH", help="also write the result as JSON here")
    args = p.parse_args(argv)
    if args.params < 1 or args.hidden < 1 or args.rounds < 1 or args.warmup < 0:
        print("nanwatch bench fingerprint: need --params >= 1, --hidden >= 1, --rounds >= 1, --warmup >= 0")
        return 2
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("nanwatch bench fingerprint: --device cuda needs a GPU")
            return 2
    result = run(device=args.device, params=int(args.params), hidden=args.hidden, rounds=args.rounds,
                 warmup=args.warmup, chunk_elements=args.chunk_elements)
    print(format_table(result))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=2))
    return 0
