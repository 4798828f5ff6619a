"""``nanwatch bench rollout``: what ``Monitor.rlhf()`` costs a GRPO-shaped step, with and without the rollout
comparison (``rollout_logprobs=``), side by side.

Three arms on one tiny Qwen3 (same weights, same batch, the same Monitor at its defaults, weight guard off),
each step the same work: forward, the completion's logprobs (``log_softmax`` and ``gather``), a
policy-gradient loss, backward, a fused AdamW step. ``bare`` calls no ``rlhf()``; ``rlhf`` calls it with old
and reference logprobs, per-sequence advantages and a mask; ``rollout`` adds the sampler's logprobs.
Rounds run a block of steps of every arm back to back, the order rotating, so drift and other load hit all
arms alike; reported per arm: the median step and its ratio to ``bare`` (the median over rounds of each
round's ratio). The ``rlhf()`` call is also timed alone, in a loop, for each arm's arguments: on a loaded
machine that figure is steadier than a difference of two steps.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
import warnings
from pathlib import Path

__all__ = ["ARMS", "main", "run"]

ARMS = ("bare", "rlhf", "rollout")


def _batch(vocab: int, batch: int, seq: int, completion: int, dev):
    import torch

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (batch, seq), generator=g).to(dev)
    noise = torch.randn(batch, completion, generator=g).to(dev)
    mask = (torch.rand(batch, completion, generator=g) > 0.1).to(dev)
    advantages = torch.randn(batch, generator=g).to(dev)
    return ids, noise, mask, advantages


def _arm(name: str, dev, *, seq: int, completion: int, layers: int, batch: int):
    """One model, its fused AdamW and Monitor; returns (monitor, step function, the rlhf() arguments)."""
    import torch

    import nanwatch
    from nanwatch.bench.tiny_models import tiny_qwen3

    model = tiny_qwen3("sdpa", vocab_size=128, use_cache=False, num_hidden_layers=layers,
                       max_position_embeddings=max(seq, 64)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=dev.type in ("cpu", "cuda"))
    mon = nanwatch.attach(model, run_id=f"bench-rollout-{name}", guard="off", rerun=False)
    ids, noise, mask, advantages = _batch(128, batch, seq, completion, dev)

    def arguments(logprobs):
        lp = logprobs.detach()
        kw = dict(logprobs=logprobs, old_logprobs=lp, ref_logprobs=lp + 0.1 * noise, advantages=advantages,
                  mask=mask)
        return kw if name == "rlhf" else {**kw, "rollout_logprobs": lp - 0.01 * noise}

    def step(n: int) -> None:
        with mon.step(n):
            logits = model(input_ids=ids).logits[:, -completion - 1:-1].float()
            logprobs = logits.log_softmax(-1).gather(-1, ids[:, -completion:, None]).squeeze(-1)
            if name != "bare":
                mon.rlhf(**arguments(logprobs))
            (-(advantages[:, None] * logprobs * mask).sum() / mask.sum()).backward()
            opt.step()
            opt.zero_grad()

    return mon, step, arguments(torch.randn(batch, completion, device=dev) - 3)


def run(*, device: str = "cpu", rounds: int = 30, warmup: int = 3, block: int = 4, seq: int = 128,
        completion: int = 96, layers: int = 2, batch: int = 4) -> dict:
    """One measurement; returns a JSON-ready dict."""
    import torch

    warnings.simplefilter("ignore")
    dev = torch.device(device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    arms = {name: _arm(name, dev, seq=seq, completion=completion, layers=layers, batch=batch) for name in ARMS}
    times: dict[str, list[float]] = {name: [] for name in ARMS}
    alone: dict[str, float] = {}
    n = 0
    try:
        for r in range(warmup + rounds):
            for name in ARMS[r % 3:] + ARMS[: r % 3]:
                sync()
                t0 = time.perf_counter()
                for _ in range(block):
                    arms[name][1](n)
                    n += 1
                sync()
                if r >= warmup:
                    times[name].append((time.perf_counter() - t0) / block)
        for name in ("rlhf", "rollout"):
            mon, _, kw = arms[name]
            samples = []
            for i in range(120):
                with mon.step(n):
                    sync()
                    t0 = time.perf_counter()
                    mon.rlhf(**kw)
                    sync()
                    if i >= 20:
                        samples.append(time.perf_counter() - t0)
                n += 1
            alone[name] = statistics.median(samples)
    finally:
        for mon, _, _ in arms.values():
            mon.close()
    bare = times["bare"]
    out = {"device": device, "rounds": rounds, "block": block, "seq": seq, "completion": completion,
           "layers": layers, "batch": batch, "machine": f"{platform.machine()} {os.cpu_count()} cpus",
           "torch": torch.__version__, "cuda_device": torch.cuda.get_device_name() if dev.type == "cuda" else None}
    for name in ARMS:
        out[f"step_{name}_s"] = statistics.median(times[name])
        out[f"ratio_{name}"] = statistics.median(t / b for t, b in zip(times[name], bare, strict=True))
    for name, s in alone.items():
        out[f"call_{name}_s"] = s
        out[f"call_{name}_share_of_step"] = s / statistics.median(bare)
    return out


def format_table(r: dict) -> str:
    lines = [f"Monitor.rlhf() in a GRPO-shaped step: {r['device']}, {r['rounds']} rounds of {r['block']} steps per "
             f"arm (tiny Qwen3, {r['layers']} layers, batch {r['batch']} x seq {r['seq']}, completion "
             f"{r['completion']}; {r['machine']}, torch {r['torch']})"]
    what = {"bare": "no rlhf()", "rlhf": "rlhf()", "rollout": "rlhf(rollout_logprobs=)"}
    for name in ARMS:
        lines.append(f"{what[name]:<26} {r[f'step_{name}_s'] * 1e3:9.2f} ms  x{r[f'ratio_{name}']:.4f} of bare")
    for name in ("rlhf", "rollout"):
        lines.append(f"{what[name] + ' call alone':<36} {r[f'call_{name}_s'] * 1e3:8.3f} ms  "
                     f"{r[f'call_{name}_share_of_step'] * 100:6.2f} % of a bare step")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="nanwatch bench rollout", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--block", type=int, default=4, help="steps of one arm between two device syncs")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--completion", type=int, default=96)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--json", dest="json_path", metavar="PATH", help="also write the result as JSON here")
    args = p.parse_args(argv)
    if min(args.rounds, args.block, args.seq, args.layers, args.batch, args.completion) < 1 or args.warmup < 0 \
            or args.completion >= args.seq:
        print("nanwatch bench rollout: need --rounds, --block, --layers, --batch >= 1, --warmup >= 0, "
              "1 <= --completion < --seq")
        return 2
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("nanwatch bench rollout: --device cuda needs a GPU")
            return 2
    result = run(device=args.device, rounds=args.rounds, warmup=args.warmup, block=args.block, seq=args.seq,
                 completion=args.completion, layers=args.layers, batch=args.batch)
    print(format_table(result))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(result, indent=2))
    return 0
