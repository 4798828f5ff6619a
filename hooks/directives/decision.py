"""What to apply at a step boundary, decided without torch, threads or a collective: pure functions of the
directive in force and the candidate directive, unit-tested on their own.

A *candidate* is four integers, because under torch.distributed ranks agree on one by a MAX all-reduce of
exactly these four (``nanwatch.hooks.directives.agreement``): the newest version wins, with its mode and
apply step, and any rank asking for a revert makes it a revert. Version first is what makes MAX the
agreement: a newer directive beats an older one whatever its mode.

Example usage::

    cand = local_candidate(InForce("none", 0, None), newest(offered, polled), clean_streak=0, decides_revert=True)
    decision = decide(InForce("none", 0, None), cand, step=7)   # Decision(action="apply", mode="fp32", ...)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

from nanwatch.wire import MODES, Directive

__all__ = ["Candidate", "Decision", "InForce", "decide", "local_candidate", "newest", "still_pending"]


class Candidate(NamedTuple):
    """(version, mode index in ``MODES``, apply_at_step, revert flag): the all-reduced form of a directive."""

    version: int
    mode: int
    apply_at: int
    revert: int


@dataclass(frozen=True, slots=True)
class InForce:
    """The directive this rank applies now."""

    mode: str
    version: int
    #: clean steps after which the mode reverts to ``none`` (None: it stays)
    revert_after: int | None


@dataclass(frozen=True, slots=True)
class Decision:
    """What the step boundary does: ``apply`` a newer directive, ``revert`` to ``none``, or ``stay``."""

    action: Literal["apply", "revert", "stay"]
    mode: str
    version: int


def newest(offered: Directive | None, polled: Directive | None) -> Directive | None:
    """The newer of the directive offered in-process and the one polled from the collector (offered wins
    a tie: it is the trainer's own)."""
    if polled is not None and (offered is None or polled.version > offered.version):
        return polled
    return offered


def local_candidate(now: InForce, latest: Directive | None, *, clean_streak: int,
                    decides_revert: bool) -> Candidate:
    """This rank's candidate: ``latest`` if it is newer than what is in force, else what is in force, with
    the revert flag set once ``clean_streak`` reached ``revert_after`` (only where ``decides_revert``:
    rank 0's streak decides for all ranks, the others say 0)."""
    if latest is not None and latest.version > now.version:
        return Candidate(latest.version, MODES.index(latest.mode), latest.apply_at_step, 0)
    revert = int(decides_revert and now.mode != "none" and now.revert_after is not None
                 and clean_streak >= now.revert_after)
    return Candidate(now.version, MODES.index(now.mode), 0, revert)


def decide(now: InForce, cand: Candidate, *, step: int) -> Decision:
    """Apply ``cand`` once ``step`` reached its apply step and it is newer; else revert if it asks to and a
    mode is active; else stay."""
    if cand.version > now.version and step >= cand.apply_at:
        return Decision("apply", MODES[cand.mode], cand.version)
    if cand.revert and now.mode != "none":
        return Decision("revert", "none", now.version)
    return Decision("stay", now.mode, now.version)


def still_pending(cand: Candidate, *, version_after: int) -> bool:
    """Whether an agreed candidate must be held until the next agreement step: it names a version not yet
    applied (its apply step is still ahead), or it carries a revert."""
    return (cand.version, cand.revert) != (version_after, 0)
