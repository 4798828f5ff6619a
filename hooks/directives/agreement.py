"""The one collective nanwatch issues: ranks agree on the directive candidate by an all-reduce (MAX) of four
int64 on the host, over gloo, at agreement steps only (``nanwatch.policy.is_agreement_step``).

On a CPU (gloo) group, never on the GPU, so agreeing costs no device sync. Every rank calls it at the same
step, so the first call may create the CPU group (itself a collective on all ranks) when the default group
is not gloo. See ``nanwatch.hooks.directives.decision`` for why MAX is the agreement.
"""

from __future__ import annotations

import os

import torch

from nanwatch.hooks.directives.decision import Candidate

__all__ = ["RankAgreement", "rank_and_world", "world_size"]


def world_size() -> int:
    """Ranks that must agree: torch.distributed's world size when it is initialised, else 1."""
    d = torch.distributed
    return d.get_world_size() if d.is_available() and d.is_initialized() else 1


def rank_and_world(*, rank: int | None, world_size: int | None) -> tuple[int, int]:
    """This process's rank and the number of ranks: as given, else torch.distributed's when it is
    initialised, else ``$RANK``/``$WORLD_SIZE``, else 0 and 1."""
    d = torch.distributed
    if d.is_available() and d.is_initialized():
        found = d.get_rank(), d.get_world_size()
    else:
        found = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    return (rank if rank is not None else found[0], world_size if world_size is not None else found[1])


class RankAgreement:
    """The CPU group the agreement runs on (created on first use); training thread only."""

    def __init__(self) -> None:
        self._cpu_group = None

    def agree(self, mine: Candidate) -> Candidate:
        """MAX of every rank's candidate (a collective: every rank calls it at the same step)."""
        d = torch.distributed
        if d.get_backend() != "gloo" and self._cpu_group is None:
            self._cpu_group = d.new_group(backend="gloo")
        t = torch.tensor(mine, dtype=torch.int64)
        d.all_reduce(t, op=d.ReduceOp.MAX, group=self._cpu_group)
        return Candidate(*(int(x) for x in t.tolist()))  # sync-ok: a CPU tensor (gloo), no device sync
