"""The replica check's verdict (``nanwatch.hooks.remedies.replica_check``): computed from the replicas' fingerprint
tables on the device (:func:`verdict`), written into the step's slots (:func:`verdict_keys`), and decoded on the
reporter thread into an incident (:func:`replica_incident`, pure). The slots' layout and both its ends live here,
below the report, so that the report reads a verdict without importing the check that runs collectives and
repairs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nanwatch.wire import Incident

__all__ = ["MAX_NAMED", "REPAIRED", "ReplicaLayout", "replica_incident", "verdict", "verdict_keys"]

#: the differing tensors an incident names, first in the table's order (the wire's limit)
MAX_NAMED = 16
#: the slot holding 1 when a repair made the replicas agree again, 0 when it did not or could not
REPAIRED = ("replica", "repaired")


def verdict_keys(replicas: int) -> tuple:
    """The verdict's slots, in :func:`verdict`'s order (one block, written at once)."""
    return (("replica", "checked"), ("replica", "differ"), ("replica", "no_majority"),
            *(("replica", "rank", j) for j in range(replicas)),
            *(("replica", "param", k) for k in range(MAX_NAMED)))


@dataclass(frozen=True, slots=True)
class ReplicaLayout:
    """What the reporter thread needs to name a verdict: the table's tensor names, the replicas' global
    ranks and hosts (by index in the group), and whether repair is on. Made once; never changed."""

    names: tuple[str, ...]
    ranks: tuple[int, ...]
    hosts: tuple[str, ...]
    repair: bool


def verdict(table: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The replicas' fingerprint tables (int64 ``[R, P, 2]``) -> (the verdict's slot values in ``verdict_keys``'s
    order, float64: checked, differing tensors, no majority for some, then per replica 1 when it is out,
    then the first ``MAX_NAMED`` differing tensors' index + 1 (0: none); the majority replica to copy
    each tensor from, int64 ``[P]``, -1 where the tensor agrees or has no majority). Device ops only."""
    r, p = table.shape[0], table.shape[1]
    agree = (table[:, None] == table[None, :]).all(-1).sum(0)  # [R, P]: replicas holding replica j's value
    differs = (agree < r).any(0)
    majority = agree * 2 > r
    has_majority = majority.any(0)
    out = (~majority & differs).any(1)
    index = torch.where(differs, torch.arange(p, device=table.device), p)
    first = torch.full((MAX_NAMED,), p, dtype=torch.int64, device=table.device)
    n = min(MAX_NAMED, p)
    first[:n] = index.sort().values[:n]
    first = torch.where(first < p, first + 1, 0)
    head = torch.stack((torch.ones((), dtype=torch.int64, device=table.device), differs.sum(),
                        (differs & ~has_majority).any().long()))
    values = torch.cat((head, out.long(), first)).to(torch.float64)
    src = torch.where(differs & has_majority, majority.long().argmax(0), -1)
    return values, src


def replica_incident(layout: ReplicaLayout | None, get: Callable[..., float | None], step: int) -> Incident | None:
    """The step's replica verdict, decoded (reporter thread): an incident when some tensor differed across
    replicas, else None. ``get``: the step's slot reader (``StepStats.slot``)."""
    if layout is None or (get("max", ("replica", "checked"), -math.inf) or 0) <= 0:
        return None
    differ = int(get("max", ("replica", "differ"), 0) or 0)
    if differ <= 0:
        return None
    out = [j for j in range(len(layout.ranks)) if (get("max", ("replica", "rank", j), 0) or 0) > 0]
    firsts = [int(v) - 1 for k in range(MAX_NAMED) if (v := get("max", ("replica", "param", k), 0) or 0) >= 1]
    params = [layout.names[i][:256] for i in firsts if i < len(layout.names)]
    no_majority = (get("max", ("replica", "no_majority"), 0) or 0) > 0
    repaired_value = get("max", REPAIRED, -math.inf)
    repaired = None if not layout.repair else bool(repaired_value is not None and repaired_value > 0)
    ranks = [layout.ranks[j] for j in out]
    note = (f"{differ} of {len(layout.names)} tensors differ across {len(layout.ranks)} data-parallel replicas; "
            f"rank(s) {', '.join(map(str, ranks[:16]))} disagree with the majority")
    if no_majority:
        note += ("; no majority for some tensor (two replicas, or a tie): every disagreeing replica is named"
                 + (", and repair is impossible" if layout.repair else ""))
    elif repaired is not None:
        note += "; repaired from the majority" if repaired else "; the repair did not make them agree"
    return Incident(cls="replica_divergence", step=step, ranks=ranks[:1024],
                    hosts=[layout.hosts[j] for j in out][:64], params=params, repaired=repaired, note=note[:1024])
