"""The replica check: the parameters (and the covered optimizers' state) that must be bit-identical across
data-parallel replicas, compared every ``MonitorConfig.weights.replica_check_every`` optimizer steps; a
disagreement is an incident of class ``replica_divergence`` (docs/distributed.md, "Replicas that must
agree").

Why: most silent data corruption never becomes a NaN. A bit flipped in one replica's weights (a faulty
core, a bad DIMM) trains a different model from then on, and DDP's all-reduce hides it: the gradients are
averaged, the weights are not compared. Megatron-LM compares weight hashes across data-parallel replicas
every N iterations, with a host sync; this does it on the device.

How, at the post-step hook of the first optimizer a Monitor covers, at the same optimizer-step count on
every rank (the optimizer steps together on every replica; a step the weight guard skips is the job's
decision, so skipped everywhere):

* each tensor's integer fingerprint (``nanwatch.hooks.rollout.weight_fingerprint``'s exact kernel, its two
  lane sums, kept on the device) makes one int64 ``[P, 2]`` table: the model's parameters in
  ``named_parameters()`` order, then each covered optimizer's tensor state (``param:exp_avg``...);
* one collective gathers the replicas' tables (``all_gather_single``, async; on CUDA the stream waits for
  it, the host does not; on the CPU the host waits at most ``report_reduce_timeout_s``);
* on the device: per tensor, how many replicas hold each replica's value; a replica is out when at most
  half agree with it (with two replicas that disagree, both are), and the verdict (ranks out, the first
  16 differing tensors, whether a majority exists) goes into the step's slot buffer, which the reporter
  thread decodes from the step's one copy (``nanwatch.hooks.measure.replica_verdict``). No host read.

Which replicas: DDP and ZeRO-1/2 compare over ``MonitorConfig.weights.process_group`` (the default group when
None); FSDP2 HSDP (``fully_shard`` on a 2-D mesh, replicate x shard) over the mesh's replicate dimension,
each rank's local shards against the same shards of the other replicas. Plain FSDP2 (shard only) has one
replica of each shard: nothing to compare, said once. ZeRO-style optimizers (``ZeroRedundancyOptimizer``,
DeepSpeed's) shard their state: only the parameters are compared there. On CUDA a CPU tensor of the
state (a non-capturable Adam's ``step`` count) is left out: bringing it over would be a host sync.

Repair (``replica_repair=True``): the verdict is on the device of every rank after the gather, so every
rank reads it (one host read per check, the price of the option) and all agree on what to do: each
differing tensor that has a majority is broadcast from its first majority replica to the others, and the
check runs again at once; ``repaired`` says whether it then passed. Without a majority (two replicas, or
a tie), repair is impossible and the incident says so.

Never a hang: a check that fails (a peer that raised before its check and never joins) waits at most
``report_reduce_timeout_s`` on the CPU (the process group's own timeout on CUDA, 60 s by default, as the
weight guard's reduction), warns, and turns the check off for the rest of the run.
"""

from __future__ import annotations

import datetime
import logging
import socket
import weakref
from collections.abc import Callable
from typing import Any

import torch

from nanwatch.hooks.config import WeightsConfig
from nanwatch.hooks.failsafe import WarnOnce
from nanwatch.hooks.measure.recorder import Recorder
from nanwatch.hooks.measure.replica_verdict import REPAIRED, ReplicaLayout, verdict, verdict_keys
from nanwatch.hooks.rollout.weight_fingerprint import fingerprint_rows

__all__ = ["ReplicaCheck", "replica_group"]

log = logging.getLogger("nanwatch")


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, else the tensor; detached (it shares the storage)."""
    local = getattr(t, "_local_tensor", None)
    return (local if isinstance(local, torch.Tensor) else t).detach()


def replica_group(model: torch.nn.Module, group: Any) -> tuple[Any, str | None]:
    """(the group whose ranks hold replicas of this rank's parameters, None), or (None, why there is none
    to compare with; "" when torch.distributed is not in use)."""
    d = torch.distributed
    if not (d.is_available() and d.is_initialized()):
        return None, ""
    for p in model.parameters():
        mesh, placements = getattr(p, "device_mesh", None), getattr(p, "placements", None)
        if mesh is None or placements is None:
            continue
        dims = [i for i, pl in enumerate(placements) if pl.is_replicate()]
        if not dims:
            return None, ("the parameters are sharded (FSDP2, no replicate dimension): one replica of each "
                          "shard, nothing to compare")
        group = mesh.get_group(dims[0])
        break
    group = group if group is not None else d.group.WORLD
    if d.get_world_size(group) < 2:
        return None, "one replica in the data-parallel group: nothing to compare"
    return group, None


class ReplicaCheck:
    """The replica check of one Monitor, on its first covered optimizer; ``remove()`` takes it off.

    Example usage::

        check = ReplicaCheck(opt, model=model_ref, rec=rec, config=cfg.weights, timeout_s=60.0,
                             optimizers=hooks.optimizers, warn=WarnOnce())   # a collective (the hosts): every rank, together
        ...                                      # every replica_check_every-th opt.step() compares
        check.remove()
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, model: weakref.ref[torch.nn.Module], rec: Recorder,
                 config: WeightsConfig, timeout_s: float, optimizers: Callable[[], list], warn: WarnOnce) -> None:
        self._model, self._rec, self._optimizers, self._warn = model, rec, optimizers, warn
        self._every, self._repair = config.replica_check_every, config.replica_repair
        self._timeout = datetime.timedelta(seconds=timeout_s)  # a peer that never joins (report_reduce_timeout_s)
        self._steps, self._handle, self._layout = 0, None, None
        self._entries: list[tuple[str, Callable[[], torch.Tensor | None]]] = []
        model_now = model()
        self._group, why = replica_group(model_now, config.process_group) if model_now is not None else (None, "")
        if why:
            log.info("nanwatch: replica check off: %s", why)
        if self._group is None:
            return
        d = torch.distributed
        self._ranks = tuple(d.get_process_group_ranks(self._group))
        hosts: list[Any] = [None] * len(self._ranks)
        d.all_gather_object(hosts, socket.gethostname(), group=self._group)  # once, at attach: every rank
        self._hosts = tuple(str(h)[:255] for h in hosts)
        self._keys = verdict_keys(len(self._ranks))
        self._handle = optimizer.register_step_post_hook(self._after_step)

    @property
    def active(self) -> bool:
        """The check is on (a group of two or more replicas, and no failure yet)."""
        return self._handle is not None

    @property
    def layout(self) -> ReplicaLayout | None:
        """The compared tensors' names and the replicas (None before the first check)."""
        return self._layout

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._steps += 1
        if self._steps % self._every or torch.compiler.is_compiling():
            return
        try:
            self.compare()
        except Exception as exc:  # noqa: BLE001 - monitoring must not break (or hang) the step
            self.remove()
            self._warn(f"the replica check at optimizer step {self._steps} failed ({type(exc).__name__}: "
                       f"{str(exc)[:200]}): a replica that never joined it (it raised, or stopped), or a "
                       "broken process group; the check is off for the rest of the run")

    def compare(self) -> None:
        """One check: fingerprints, the gather, the verdict into the open step's slots (device ops and one
        collective); with repair on, one host read of the verdict and, if some tensor has a majority, the
        broadcasts and the check again."""
        tensors = self._tensors()
        values, src = verdict(self._gather(tensors))
        self._rec.slot(self._keys, values, how="max", many=True)
        self._rec.state.replica = self._layout
        if self._repair:
            self._repair_from(src, tensors)

    def _tensors(self) -> list[torch.Tensor]:
        """This check's tensors, in the layout's order (made at the first check)."""
        if self._layout is None:
            self._make_layout()
        device = self._rec.buf.device
        empty = torch.zeros(0, dtype=torch.int32, device=device)
        return [t if (t := get()) is not None else empty for _, get in self._entries]

    def _make_layout(self) -> None:
        """The tensors every replica compares: the parameters, then the covered optimizers' tensor state,
        each on the check's device (the same list on every rank: one model, one optimizer)."""
        model, device = self._model(), self._rec.buf.device
        names: dict[int, str] = {}
        for name, p in (model.named_parameters() if model is not None else ()):
            if id(p) not in names:
                names[id(p)] = name
                self._entries.append((name, lambda p=p: _local(p)))
        for opt in self._optimizers():
            if "zero" in type(opt).__name__.lower():  # ZeRO shards the state: only the parameters agree
                continue
            for group in opt.param_groups:
                for p in group["params"]:
                    for key, v in sorted(opt.state.get(p, {}).items()):
                        if isinstance(v, torch.Tensor) and _local(v).device == device:
                            self._entries.append((f"{names.get(id(p), '?')}:{key}", self._state_getter(opt, p, key)))
        self._layout = ReplicaLayout(names=tuple(n for n, _ in self._entries), ranks=self._ranks,
                                     hosts=self._hosts, repair=self._repair)

    @staticmethod
    def _state_getter(opt: torch.optim.Optimizer, p: torch.Tensor, key: str) -> Callable[[], torch.Tensor | None]:
        def get() -> torch.Tensor | None:
            v = opt.state.get(p, {}).get(key)
            return _local(v) if isinstance(v, torch.Tensor) else None
        return get

    def _gather(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """Every replica's fingerprint table, ``[R, P, 2]``: one collective."""
        local = fingerprint_rows(tensors, self._rec.buf.device)
        out = local.new_empty((len(self._ranks) * local.shape[0], 2))
        d = torch.distributed
        gather = getattr(d, "all_gather_single", None) or d.all_gather_into_tensor
        work = gather(out, local.contiguous(), group=self._group, async_op=True)
        if out.device.type == "cpu":
            work.wait(timeout=self._timeout)
        else:
            work.wait()  # CUDA: the current stream waits for the collective; the host does not
        return out.view(len(self._ranks), local.shape[0], 2)

    def _repair_from(self, src: torch.Tensor, tensors: list[torch.Tensor]) -> None:
        """Every rank holds the same verdict: each differing tensor with a majority is broadcast from its first
        majority replica; then the check again, its outcome into the ``REPAIRED`` slot."""
        sources = src.tolist()  # sync-ok: replica_repair=True only (documented): every rank decides alike
        todo = [(i, s) for i, s in enumerate(sources) if s >= 0]
        if not todo:
            return  # agreement, or no majority anywhere (the verdict says which; repaired stays unset -> False)
        d = torch.distributed
        for i, s in todo:
            t = tensors[i]
            buf = t if t.is_contiguous() else t.contiguous()
            d.broadcast(buf, src=self._ranks[s], group=self._group)
            if buf is not t:
                t.copy_(buf)
        values, _ = verdict(self._gather(self._tensors()))
        self._rec.slot(REPAIRED, (values[1] == 0).to(torch.float64), how="max")
        log.warning("nanwatch: replica check: %d tensors broadcast from the majority of their replicas", len(todo))

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
