"""What nanwatch does with collectives: the weight guard's one reduction, and which models' forwards issue
collectives of their own (so that nothing nanwatch runs alone on one rank may call them).

Measured before this module (#16): under DDP a NaN born on rank 1 at step k made rank 1 skip its optimizer
step while rank 0, whose own activations were finite, applied the gradient DDP's all-reduce had made NaN;
every replica went NaN. The skip has to be the job's decision. :class:`FlagReduction` makes it so with one
all-reduce (MAX) of two numbers over the training process group, ``[flag, flag * (W - rank)]``: the first
is the job's flag, the second gives the lowest rank that held a non-finite value (``W - max``), for the
report's ``nonfinite_rank``. It is issued with ``async_op=True`` and waited on with ``work.wait()``: on
CUDA (NCCL) that makes the current stream, the optimizer's, wait for the collective, with no host sync;
on a CPU (gloo) it is the same code and the wait is the host's.

A collective only works when every rank issues it. The guard reduces under conditions that are the same
on every rank (the optimizer's kind, ``sync=``, the agreed ``skip_step`` mode, ``MonitorConfig``), never
a local value, and issues nothing before it when its preparation could fail on one rank only.

Under FSDP (FSDP1 or FSDP2 ``fully_shard``), tensor/sequence parallelism (DTensor parameters), DeepSpeed
ZeRO-3 or ``SyncBatchNorm`` a forward issues collectives itself: a forward that one rank re-runs alone
(the differential rerun) waits for partners that never come. Measured: the job hung at the NaN step
until killed. :func:`collective_forward` names such a model's wrapper, so the rerun can decline and say
why.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

__all__ = ["FlagReduction", "collective_forward", "reduction_active"]


def reduction_active(group: Any = None) -> bool:
    """The guard's flag is reduced: torch.distributed is initialised and ``group`` (None: the default
    group) has more than one rank."""
    d = torch.distributed
    return d.is_available() and d.is_initialized() and d.get_world_size(group) > 1


def _needs_cpu_group(backend: str, device: torch.device) -> bool:
    """A CPU flag on a group whose backend reduces only device tensors (NCCL alone)."""
    return device.type == "cpu" and not any(b in backend for b in ("gloo", "mpi"))


class FlagReduction:
    """The step's non-finite flag, reduced (MAX) over the training process group; training thread only.

    Example usage::

        red = FlagReduction(group=None)                 # the default group
        job_flag, lowest = red.reduce(rank_flag)        # a collective: every rank, same step
    """

    def __init__(self, group: Any = None) -> None:
        self._group = group
        self._cpu_group: Any = None

    def _group_for(self, device: torch.device) -> Any:
        """The group to reduce a flag on ``device`` over. A CPU flag on an NCCL-only default group goes
        over a gloo group made once, by every rank at its first guarded step (``new_group`` is itself a
        collective of the default group, so this is only done for the default group)."""
        d = torch.distributed
        if not _needs_cpu_group(str(d.get_backend(self._group)), device):
            return self._group
        if self._group is not None:
            raise RuntimeError("MonitorConfig.weights.process_group reduces device tensors only (NCCL) and the model is "
                               "on the CPU: pass a gloo group")
        if self._cpu_group is None:
            self._cpu_group = d.new_group(backend="gloo")
        return self._cpu_group

    def reduce(self, flag: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``flag`` (0-d float32, 1.0: this rank's step held a non-finite value) -> (the job's flag, 0-d
        float32; ``-r`` where ``r`` is the lowest rank whose flag was set, ``-inf`` when none). Device
        ops and one collective; no host sync on CUDA."""
        d = torch.distributed
        group = self._group_for(flag.device)
        world, rank = d.get_world_size(), d.get_rank()  # global ranks: what the reports carry
        flag = flag.to(torch.float32)
        t = torch.stack((flag, flag * float(world - rank)))  # exact in float32 up to 2**24 ranks
        work = d.all_reduce(t, op=d.ReduceOp.MAX, group=group, async_op=True)
        work.wait()  # CUDA: the current stream waits for the collective; the host does not
        lowest = torch.where(t[0] > 0, t[1] - float(world), torch.full_like(t[1], -float("inf")))
        return t[0], lowest


def collective_forward(model: torch.nn.Module) -> str | None:
    """Why a forward of ``model`` issues collectives (a wrapper that gathers parameters or statistics), or
    None when it issues none (plain modules, or inside DDP, whose collectives run in backward)."""
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    for module in model.modules():
        names = {c.__name__ for c in type(module).__mro__}
        if "FSDPModule" in names:
            return "FSDP2 (fully_shard) all-gathers parameters in every forward"
        if "FullyShardedDataParallel" in names:
            return "FSDP (FullyShardedDataParallel) all-gathers parameters in every forward"
        if "SyncBatchNorm" in names:
            return "SyncBatchNorm all-gathers batch statistics in a training forward"
    for p in model.parameters():
        if dtensor is not None and isinstance(p, dtensor):
            return "DTensor (tensor/sequence-parallel) parameters issue collectives in forward"
        if hasattr(p, "ds_status"):
            return "DeepSpeed ZeRO-3 gathers partitioned parameters in every forward"
    return None
