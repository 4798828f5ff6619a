"""One rank of the cross-rank directive test (run as a script by test_directives.py, gloo backend)."""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import nanwatch
from nanwatch.wire import Directive


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(16, 48)

    def forward(self, x):
        q, k, v = self.proj(x).view(2, 8, 3, 2, 8).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = Block()
    modes = []
    offers = {3: Directive(run_id="dist", version=1, mode="fp32", apply_at_step=7),
              9: Directive(run_id="dist", version=2, mode="fused", apply_at_step=5)}  # learned late
    with nanwatch.attach(model, run_id="dist", directive_check_every=2,
                         is_attention=lambda n, m: isinstance(m, Block)) as mon:
        for n in range(14):
            if rank == 0 and n in offers:  # stands in for rank 0's collector poller
                mon.directives.offer(offers[n])
            with mon.step(n):
                modes.append([n, mon.directives.mode, mon.directives.version])
                model(torch.randn(2, 8, 16)).sum().backward()
        reported = mon.last_report().attention_mode
    with open(out_path, "w") as f:
        json.dump({"rank": rank, "modes": modes, "reported": reported}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    os._exit(0)
