"""``nanwatch bench spikes``: what the spike baseline (``nanwatch.hooks.measure.spikes``) costs per report, on
the reporter thread, next to the training step it describes.

The sites are a real report's: a tiny Qwen3 of ``--layers`` layers trained one step under a Monitor (every
forward and gradient site of the default set, the loss watched). Arms, timed in rounds: ``baseline`` (one
``SpikeDetector.observe`` of those sites per report, the values jittered per step so the window turns over,
after its warm-up) and ``step`` (one training step of the same model without nanwatch). Reported: the sites,
the baseline's median microseconds per report and its ratio to the step. The baseline adds nothing to the
training thread (it runs where the report is built); the ratio says how much of a reporter thread's
budget, one report per step, it takes.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
import warnings

__all__ = ["main", "run"]


def run(*, layers: int = 4, reports: int = 2000, steps: int = 20) -> dict:
    import torch

    import nanwatch
    from nanwatch.bench.tiny_models import tiny_qwen3
    from nanwatch.hooks.measure.spikes import SpikeDetector

    model = tiny_qwen3("sdpa", num_hidden_layers=layers, use_cache=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 128, (4, 64), generator=torch.Generator().manual_seed(0))

    def step() -> None:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.attach(model, run_id="bench-spikes", optimizer=opt) as mon:
            with mon.step(0):
                loss = model(input_ids=ids, labels=ids).loss
                mon.watch("loss", loss)
                loss.backward()
                opt.step()
                opt.zero_grad()
            sites = [s for s in mon.last_report().sites if s.stage == "train"]
    rng = random.Random(0)
    steps_per = [[s.model_copy(update={"amax": s.amax * rng.uniform(0.8, 1.2)}) for s in sites] for _ in range(64)]
    det = SpikeDetector()
    for n in range(det.warmup + det.window):  # past the warm-up, the window full
        det.observe(n, steps_per[n % 64])
    t0 = time.perf_counter()
    for n in range(reports):
        det.observe(1000 + n, steps_per[n % 64])
    per_report = (time.perf_counter() - t0) / reports
    step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    step_s = statistics.median(times)
    return dict(layers=layers, sites=len(sites), baseline_us_per_report=per_report * 1e6,
                step_ms=step_s * 1e3, ratio_to_step=per_report / step_s, machine=platform.processor() or
                platform.machine(), torch=torch.__version__, threads=torch.get_num_threads())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="nanwatch bench spikes", description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--reports", type=int, default=2000)
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    args = p.parse_args(argv)
    r = run(layers=args.layers, reports=args.reports)
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        print(f"spike baseline: {r['sites']} sites ({r['layers']}-layer tiny Qwen3): "
              f"{r['baseline_us_per_report']:.1f} us per report on the reporter thread; a step {r['step_ms']:.1f} "
              f"ms ({r['ratio_to_step'] * 100:.3f} % of it; 0 on the training thread)")
    return 0
