"""One rank of the distributed weight-guard test (started by test_weight_guard.py, gloo): a tiny fp16 eager
Qwen3 per rank, fused AdamW guarded by nanwatch, attention failing in half precision on rank 1 only from
step K. Every step's mode, skip flag and weight finiteness go to a file.

The fault is injected, not computed (#26): scaling the q/k norms until fp16's QK product overflows made the
run depend on the CPU's kernels (on an AVX-512 Xeon with bf16 units, rank 1's fp16 MLP overflowed again
under the fp32 attention path, and that step was skipped too). Here layer 0's attention output is NaN
exactly while attention runs on the half-precision path -- from step K, in training and in the trainer's
differential re-run alike -- and finite once the fp32 directive routes it through fp32, whatever the CPU."""

import json
import math
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support import guarded_step, tiny_qwen3  # noqa: E402

import nanwatch  # noqa: E402

K, STEPS = 3, 10


def fail_attention_in_half(mon, model, layer: int = 0) -> None:
    """From now on, ``layer``'s self-attention returns NaN unless the Monitor's attention mode is ``fp32``
    (the directive, or the differential re-run's forced fp32 path): an fp16 attention overflow that the fp32
    fallback fixes, made exact. Registered ahead of nanwatch's own hooks, which therefore measure it there."""

    def hook(module, args, out):
        if mon.directive_state.mode == "fp32":
            return out
        if isinstance(out, tuple):
            return (torch.full_like(out[0], math.nan), *out[1:])
        return torch.full_like(out, math.nan)

    model.model.layers[layer].self_attn.register_forward_hook(hook, prepend=True)


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    model = tiny_qwen3("eager", dtype=torch.float16, vocab_size=64, use_cache=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    rows = []
    with nanwatch.attach(model, run_id="guard-dist", optimizer=opt,
                         collector=os.environ.get("NANWATCH_COLLECTOR")) as mon:
        for n in range(STEPS):
            if n == K and rank == 1:
                fail_attention_in_half(mon, model)
            rows.append(guarded_step(mon, model, opt, n)[1])
            dist.barrier()  # steps in lockstep, as data-parallel training is
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(rows))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
