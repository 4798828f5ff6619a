"""Weight syncs, compared: each run's recent weight versions, the trainer's weight fingerprints of each, and
each rollout worker's verdict (docs/weight_sync.md). Memory only: a collector restart forgets the versions
waiting for their other side (the counters it added are stored); the ledger counts and logs what a
comparison finds.

Whichever side of a version arrives second triggers the comparison: a rollout worker's set is compared at
once if the trainer's is there, else kept until it comes. Bounded: ``max_versions`` versions per run (the
oldest dropped, with whatever waited in it), ``max_waiting`` rollout sets waiting per version (beyond it a
set is refused, 429); after its comparison a worker's set is forgotten, only its digest and verdict kept.
The trainer's set of a version is written once: the same set again is a resend, another one a 409.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TypedDict

from nanwatch.monitor.model.refusal import CapReached, Refused

__all__ = ["SHOWN", "Verdict", "WeightSyncMismatch", "WeightSyncs", "compare"]

#: the differing (missing, extra) tensor names a verdict and its event show, sorted: the first few
SHOWN = 5


class WeightSyncMismatch(TypedDict):
    """``weight_sync_mismatch``: a rollout worker's weight fingerprints of a version differ from the
    trainer's. ``differing``/``missing``/``extra``: the first tensor names, sorted (``missing``: the trainer
    has them, the worker not; ``extra``: the reverse); the ``*_count`` fields count them all."""

    version: int
    worker: str
    tensors: int
    differing: list[str]
    differing_count: int
    missing: list[str]
    missing_count: int
    extra: list[str]
    extra_count: int


@dataclass(frozen=True, slots=True)
class Verdict:
    """One rollout worker's set of one version, against the trainer's."""

    worker: str
    differing: tuple[str, ...]
    differing_count: int
    missing: tuple[str, ...]
    missing_count: int
    extra: tuple[str, ...]
    extra_count: int
    tensors: int

    @property
    def verified(self) -> bool:
        return not (self.differing_count or self.missing_count or self.extra_count)

    def answer(self) -> dict[str, object]:
        return {"worker": self.worker, "verified": self.verified, "differing": list(self.differing),
                "differing_count": self.differing_count, "missing": list(self.missing),
                "missing_count": self.missing_count, "extra": list(self.extra), "extra_count": self.extra_count}

    def detail(self, version: int) -> WeightSyncMismatch:
        return WeightSyncMismatch(version=version, worker=self.worker, tensors=self.tensors,
                                  differing=list(self.differing), differing_count=self.differing_count,
                                  missing=list(self.missing), missing_count=self.missing_count,
                                  extra=list(self.extra), extra_count=self.extra_count)


def compare(worker: str, trainer: dict[str, str], rollout: dict[str, str]) -> Verdict:
    """The worker's set against the trainer's: which tensors differ, which are missing or extra (pure)."""
    differing = sorted(n for n, fp in rollout.items() if n in trainer and trainer[n] != fp)
    missing = sorted(trainer.keys() - rollout.keys())
    extra = sorted(rollout.keys() - trainer.keys())
    return Verdict(worker, tuple(differing[:SHOWN]), len(differing), tuple(missing[:SHOWN]), len(missing),
                   tuple(extra[:SHOWN]), len(extra), len(trainer))


def digest(fingerprints: dict[str, str]) -> bytes:
    """One set's identity (order-independent), to tell a resend from a new set."""
    h = hashlib.blake2b(digest_size=16)
    for name in sorted(fingerprints):
        h.update(name.encode("utf-8", "surrogatepass") + b"\0" + fingerprints[name].encode() + b"\0")
    return h.digest()


@dataclass(slots=True)
class _Version:
    trainer: dict[str, str] | None = None
    trainer_digest: bytes = b""
    #: rollout sets waiting for the trainer's, by worker
    waiting: dict[str, dict[str, str]] = field(default_factory=dict)
    #: by worker: the digest of its last compared set and the verdict
    verdicts: dict[str, tuple[bytes, Verdict]] = field(default_factory=dict)


class WeightSyncs:
    """Each run's recent versions (event-loop thread only; the ledger calls it inside its transaction)."""

    def __init__(self, *, max_versions: int = 8, max_waiting: int = 256) -> None:
        self.max_versions, self.max_waiting = max_versions, max_waiting
        self.runs: dict[str, OrderedDict[int, _Version]] = {}

    def _slot(self, run_id: str, version: int) -> _Version:
        versions = self.runs.setdefault(run_id, OrderedDict())
        v = versions.get(version)
        if v is None:
            v = versions[version] = _Version()
            while len(versions) > self.max_versions:  # the oldest version received goes first
                versions.popitem(last=False)
        return v

    def check(self, run_id: str, version: int, side: str, worker: str, fingerprints: dict[str, str]) -> None:
        """Refuse, before anything changes, a second trainer set of a version that differs from its first
        (409) and a rollout set beyond ``max_waiting`` waiting for the trainer's (429)."""
        v = self.runs.get(run_id, {}).get(version)
        if v is None:
            return
        if side == "trainer" and v.trainer is not None and digest(fingerprints) != v.trainer_digest:
            raise Refused(f"weight version {version} of run {run_id!r} already has the trainer's weight "
                          "fingerprints, and these differ: a version is published once (use a new version)",
                          status=409, reason="conflict")
        if (side == "rollout" and v.trainer is None and worker not in v.waiting
                and len(v.waiting) >= self.max_waiting):
            raise CapReached(f"weight version {version} of run {run_id!r} already has {self.max_waiting} "
                             "rollout workers' sets waiting for the trainer's", reason="weight_sync")

    def trainer(self, run_id: str, version: int, fingerprints: dict[str, str]) -> list[Verdict]:
        """The trainer's set of ``version``: the verdicts of the workers that were waiting for it (new
        ones only; a resend gives none)."""
        v, d = self._slot(run_id, version), digest(fingerprints)
        if v.trainer is not None:
            return []  # a resend (``check`` refused another set)
        v.trainer, v.trainer_digest = fingerprints, d
        found = []
        for worker, rollout in v.waiting.items():
            verdict = compare(worker, fingerprints, rollout)
            v.verdicts[worker] = (digest(rollout), verdict)
            found.append(verdict)
        v.waiting.clear()
        return found

    def rollout(self, run_id: str, version: int, worker: str,
                fingerprints: dict[str, str]) -> tuple[Verdict | None, bool]:
        """A worker's set of ``version``: (its verdict or None while the trainer's is not there, whether
        the verdict is new, i.e. to be counted: a resend of the same set is not)."""
        v, d = self._slot(run_id, version), digest(fingerprints)
        if v.trainer is None:
            v.waiting[worker] = fingerprints  # ``check`` bounded them
            return None, False
        old = v.verdicts.get(worker)
        if old is not None and old[0] == d:
            return old[1], False
        if old is None and len(v.verdicts) >= self.max_waiting:
            v.verdicts.pop(next(iter(v.verdicts)))  # only a resend's answer is lost
        verdict = compare(worker, v.trainer, fingerprints)
        v.verdicts[worker] = (d, verdict)
        return verdict, True

    def save(self, run_id: str) -> OrderedDict[int, _Version] | None:
        """A copy of the run's versions, to ``restore`` if the write they belong to fails."""
        versions = self.runs.get(run_id)
        if versions is None:
            return None
        return OrderedDict((k, _Version(v.trainer, v.trainer_digest, dict(v.waiting), dict(v.verdicts)))
                           for k, v in versions.items())

    def restore(self, run_id: str, saved: OrderedDict[int, _Version] | None) -> None:
        if saved is None:
            self.runs.pop(run_id, None)
        else:
            self.runs[run_id] = saved

    def forget(self, run_ids: list[str]) -> None:
        for run_id in run_ids:
            self.runs.pop(run_id, None)
