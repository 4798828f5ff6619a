"""One rank of the replica-check tests (started by test_replicas.py, one process per rank, gloo): a tiny MLP
with dropout, AdamW, under DDP or FSDP2 HSDP, nanwatch attached with ``replica_check_every``; each step's
replica incident, the warnings and the final weight fingerprints go to ``<out>/rank<r>.json``.

Scenarios: ``flip`` (one bit of ``0.weight`` flipped on rank 1 at the start of step K, through an integer
view: no NaN), ``repair`` (the same with ``replica_repair=True``), ``hsdp`` (2 replicate x 2 shard mesh, the
flip on rank 1's local shard), ``healthy`` (500 steps, 2 micro-batches each, no fault), ``raise`` (rank 1
raises inside its optimizer step at the first check: rank 0 must warn and finish).
"""

import datetime
import json
import logging
import os
import sys
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support import step_reports  # noqa: E402

import nanwatch  # noqa: E402

K = 2  # the flip: at the start of step K (0-based); with a check every 2 optimizer steps, found at step K + 1
PARAM = "0.weight"


def _model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial weights on every rank
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Dropout(0.1), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _flip(model: torch.nn.Module) -> None:
    p = dict(model.named_parameters())[PARAM]
    local = p._local_tensor if hasattr(p, "_local_tensor") else p.data
    with torch.no_grad():
        local.view(-1).view(torch.int32)[1] ^= 1 << 3  # a real bit flip in one element's mantissa


def _wrap(scenario: str, model: torch.nn.Module) -> torch.nn.Module:
    if scenario != "hsdp":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    return fully_shard(model, mesh=mesh)


def _train(scenario: str, rank: int, steps: int, micro: int, options: dict) -> tuple[list, list[str], dict]:
    model = _model()
    torch.manual_seed(1000 + rank)  # from here on each rank's own RNG: dropout masks differ across ranks
    wrapped = _wrap(scenario, model)
    inner = wrapped.module if hasattr(wrapped, "module") else wrapped
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-2)
    if scenario == "raise" and rank == 1:
        calls = []

        def boom(*_):  # inside step(), after the weight guard's reduction: at the optimizer step of the check
            calls.append(1)
            if len(calls) == 2:
                raise RuntimeError("rank 1 fails inside its optimizer step")
        opt.register_step_pre_hook(boom)
    reports: list = []
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nanwatch.attach(wrapped, run_id=f"replica-{scenario}", optimizer=opt, on_report=step_reports(reports),
                             **options) as mon:
            for n in range(steps):
                with mon.step(n):
                    if n == K and rank == 1 and scenario in ("flip", "repair", "hsdp"):
                        _flip(inner)
                    for m in range(micro):
                        x = torch.randn(4, 8, generator=gen)
                        ctx = wrapped.no_sync() if m < micro - 1 and hasattr(wrapped, "no_sync") else _null()
                        with ctx:
                            (wrapped(x).square().mean() / micro).backward()
                    opt.step()
                    opt.zero_grad()
            mon.last_report()
    return [_row(r) for r in reports], [str(w.message) for w in caught], _fingerprints(inner)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _row(r) -> dict:
    inc = r.incident
    if inc is None or inc.cls != "replica_divergence":
        return {"step": r.step, "incident": None}
    return {"step": r.step, "incident": {"ranks": inc.ranks, "hosts": inc.hosts, "params": inc.params,
                                         "repaired": inc.repaired, "note": inc.note}}


def _fingerprints(model: torch.nn.Module) -> dict:
    return nanwatch.fingerprint({n: (p._local_tensor if hasattr(p, "_local_tensor") else p)
                                 for n, p in model.named_parameters()})


def main(scenario: str, out_dir: str) -> None:
    rank = int(os.environ["RANK"])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING)
    every = {"healthy": 1}.get(scenario, 2)
    steps, micro = (500, 2) if scenario == "healthy" else (6, 1)
    options = {"replica_check_every": every, "replica_repair": scenario == "repair", "report_reduce_timeout_s": 3.0,
               "rerun": False, "capsule": False, "param_check_every": 0}
    result: dict = {"rank": rank}
    try:
        result["rows"], result["warnings"], result["fingerprints"] = _train(scenario, rank, 2 if scenario == "raise" else steps, micro,
                                                    options)
    except RuntimeError as exc:
        result["raised"] = str(exc)
        result["traceback"] = traceback.format_exc()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # no destroy_process_group: under "raise" a peer is gone


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
