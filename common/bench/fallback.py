"""``nanwatch bench fallback``: how long from the first non-finite step to the fallback, at defaults.

A tiny fp16 eager Qwen3 per rank, fused AdamW under the weight guard, a real collector (``nanwatch serve``
on loopback, default settings), and attention that overflows at ``--spike-at`` (on the last rank only when
there are several). For one rank and for two gloo ranks it reports the steps and seconds from the start of
the non-finite step to the start of the first step on the fp32 path, the steps the guard skipped, the
differential rerun's one-time cost, and the cost of the ranks' agreement (one all-reduce of four int64
over gloo per ``directive_check_every`` steps, default every step) as a share of a step.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

__all__ = ["main", "run"]


def _worker(rank: int, world: int, port: int, url: str, spike_at: int, steps: int, out_dir: str) -> None:
    import torch
    import torch.distributed as dist

    import nanwatch
    from nanwatch.bench.tiny_models import tiny_qwen3

    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        torch.set_num_threads(1)
    model = tiny_qwen3("eager", dtype=torch.float16, vocab_size=64, use_cache=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    attn = model.model.layers[0].self_attn
    reports: list = []
    rows = []
    with nanwatch.attach(model, run_id=f"bench-fallback-{world}", collector=url, optimizer=opt,
                         on_report=reports.append) as mon:
        for n in range(steps):
            if n == spike_at and rank == world - 1:
                with torch.no_grad():
                    attn.q_norm.weight.mul_(100.0)
                    attn.k_norm.weight.mul_(100.0)
            ids = torch.randint(0, 64, (2, 32), generator=torch.Generator().manual_seed(n))
            start = time.perf_counter()
            with mon.step(n):
                mode = mon.directive_state.mode
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad()
            rows.append({"step": n, "start": start, "seconds": time.perf_counter() - start, "mode": mode})
            if world > 1:
                dist.barrier()  # data-parallel ranks run in lockstep
        mon.last_report()
    agree = None
    if world > 1:
        t = torch.zeros(4, dtype=torch.int64)
        times = []
        for _ in range(300):
            t0 = time.perf_counter()
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            times.append(time.perf_counter() - t0)
        agree = statistics.median(times[50:])
        dist.destroy_process_group()
    by_step = {r.step: r for r in reports}
    for row in rows:
        r = by_step.get(row["step"])
        row["skipped"] = bool(r is not None and r.step_skipped)
        row["rerun_s"] = r.incident.seconds if r is not None and r.incident is not None else None
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"rows": rows, "agree_s": agree}))


def run(*, ranks: int, spike_at: int = 5, steps: int = 12) -> dict:
    """One measurement with ``ranks`` processes (1: in this process); returns a JSON-ready dict."""
    import torch.multiprocessing as mp

    from nanwatch.bench.serve import CollectorProcess, free_port

    with tempfile.TemporaryDirectory(prefix="nanwatch-fallback-") as tmp, \
            CollectorProcess(db_path=os.path.join(tmp, "c.db")) as c:
        if ranks == 1:
            _worker(0, 1, 0, c.url, spike_at, steps, tmp)
        else:
            mp.start_processes(_worker, args=(ranks, free_port(), c.url, spike_at, steps, tmp), nprocs=ranks,
                               start_method="spawn")
        results = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(ranks)]
    rows = results[-1]["rows"]  # the rank that broke
    modes = [[row["mode"] for row in res["rows"]] for res in results]
    applied = next((row for row in rows if row["mode"] == "fp32"), None)
    clean = [row["seconds"] for row in rows[:spike_at]]
    step_s = statistics.median(clean) if clean else None
    agree = [res["agree_s"] for res in results if res["agree_s"] is not None]
    return {
        "ranks": ranks, "spike_at": spike_at, "same_step_on_every_rank": all(m == modes[0] for m in modes),
        "fallback_step": applied["step"] if applied else None,
        "steps_to_fallback": applied["step"] - spike_at if applied else None,
        "seconds_to_fallback": applied["start"] - rows[spike_at]["start"] if applied else None,
        "skipped_steps": [row["step"] for row in rows if row["skipped"]],
        "rerun_seconds": next((row["rerun_s"] for row in rows if row["rerun_s"] is not None), None),
        "step_seconds": step_s,
        "agree_seconds": statistics.median(agree) if agree else None,
        "agree_share_of_step": statistics.median(agree) / step_s if agree and step_s else None,
    }


def format_table(results: list[dict]) -> str:
    lines = [f"{'ranks':>5} {'NaN at':>6} {'fp32 at':>7} {'steps':>5} {'seconds':>8} {'skipped':<10} "
             f"{'rerun s':>8} {'step ms':>8} {'agree us':>8} {'agree/step':>10} same step"]
    for r in results:
        def f(v, fmt):
            return format(v, fmt) if v is not None else "-"
        lines.append(f"{r['ranks']:>5} {r['spike_at']:>6} {f(r['fallback_step'], 'd'):>7} "
                     f"{f(r['steps_to_fallback'], 'd'):>5} {f(r['seconds_to_fallback'], '.3f'):>8} "
                     f"{str(r['skipped_steps']):<10} {f(r['rerun_seconds'], '.3f'):>8} "
                     f"{f(r['step_seconds'] and r['step_seconds'] * 1e3, '.1f'):>8} "
                     f"{f(r['agree_seconds'] and r['agree_seconds'] * 1e6, '.0f'):>8} "
                     f"{f(r['agree_share_of_step'] and r['agree_share_of_step'] * 100, '.3f'):>9}% "
                     f"{r['same_step_on_every_rank']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="nanwatch bench fallback", description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", default="1,2", help="comma-separated process counts (gloo when > 1)")
    p.add_argument("--spike-at", type=int, default=5)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--json", dest="json_path", metavar="PATH", help="also write the results as JSON here")
    args = p.parse_args(argv)
    counts = [int(x) for x in args.ranks.split(",") if x.strip()]
    if not counts or min(counts) < 1 or not 0 < args.spike_at < args.steps - 2:
        print("nanwatch bench fallback: need ranks >= 1 and 0 < --spike-at < --steps - 2")
        return 2
    results = [run(ranks=n, spike_at=args.spike_at, steps=args.steps) for n in counts]
    print(format_table(results))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(results, indent=2))
    return 0
