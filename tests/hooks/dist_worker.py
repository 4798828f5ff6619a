"""One rank of the cross-rank directive tests (run as a script by test_directives.py, gloo backend).

Offline (no ``NANWATCH_COLLECTOR``): rank 0 is handed directives in-process at fixed steps. Online: both
ranks report to a real collector, rank 0 long-polls it, and the test sets the directive over HTTP; the
ranks keep stepping until they have run ``AFTER`` steps under it (or ``MAX_STEPS``).
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import nanwatch
from nanwatch.wire import Directive

AFTER, MAX_STEPS = 5, 2000


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 48)

    def forward(self, x):
        q, k, v = self.proj(x).view(2, 8, 3, 2, 8).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def _steps(mon, model, rank, collector):
    offers = {3: Directive(run_id="dist", version=1, mode="fp32", apply_at_step=7),
              9: Directive(run_id="dist", version=2, mode="fused", apply_at_step=5)}  # learned late
    modes, applied_at = [], None
    for n in range(MAX_STEPS if collector else 14):
        if not collector and rank == 0 and n in offers:  # stands in for rank 0's collector poller
            mon.directive_state.offer(offers[n])
        with mon.step(n):
            modes.append([n, mon.directive_state.mode, mon.directive_state.version])
            model(torch.randn(2, 8, 16)).sum().backward()
        if collector:
            time.sleep(0.02)  # a training step takes time; give the test room to set the directive
            applied_at = applied_at if applied_at is not None or mon.directive_state.version == 0 else n
            done = torch.tensor([applied_at is not None and n - applied_at >= AFTER], dtype=torch.int32)
            dist.all_reduce(done, op=dist.ReduceOp.MIN)  # stop together (test harness, not nanwatch)
            if done.item():
                break
    return modes


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Block()
    collector = os.environ.get("NANWATCH_COLLECTOR")
    with nanwatch.attach(model, run_id="dist", collector=collector, directive_check_every=2,
                         is_attention=lambda n, m: isinstance(m, Block)) as mon:
        modes = _steps(mon, model, rank, collector)
        reported = mon.last_report().attention_mode
    with open(out_path, "w") as f:
        json.dump({"rank": rank, "modes": modes, "reported": reported}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    os._exit(0)
