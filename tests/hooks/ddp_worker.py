"""One rank of the DDP test (started by torchrun from test_ddp.py, gloo backend): a tiny Qwen3 wrapped in
DistributedDataParallel, nanwatch attached to the wrapper, one training step; the report goes to a file."""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support import SMALL, tiny_qwen3, token_ids  # noqa: E402

import nanwatch  # noqa: E402


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    ddp = torch.nn.parallel.DistributedDataParallel(tiny_qwen3("sdpa", **SMALL, use_cache=False))
    with nanwatch.attach(ddp, run_id="ddp") as mon:
        for n in range(2):
            with mon.step(n):
                ids = token_ids(seed=rank)
                ddp(input_ids=ids, labels=ids).loss.backward()
        r = mon.last_report()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({
        "rank": r.rank, "world_size": r.world_size, "sites": [[s.site, s.phase] for s in r.sites],
        "coverage": r.coverage.model_dump(), "first_offender": r.first_offender}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
