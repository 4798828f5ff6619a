"""One rollout worker's weight fingerprints of one version, against the trainer's: the verdict (pure).

Dtype-aware: a rollout copy usually holds the weights in another dtype than the trainer (a bf16 vLLM copy of
fp32 weights), and a fingerprint is of the bits, so the trainer's set carries ``casts``: its floating
tensors' fingerprints as cast to each rollout dtype it expects (``.to(dtype)``, what a loader does). A
rollout tensor verifies when its value equals the trainer's native one or one of its casts (the value hashes
the dtype and shape in, so equal values are equal dtypes, shapes and bits). One that equals none is:

* **shape differs** when both sides sent shapes and they differ; **dtype differs** when the rollout's dtype
  is neither the trainer's nor one it published a cast to (the sync cannot be checked: "dtype differs:
  trainer float32, rollout float8_e4m3fn"). Neither is a failed sync: the verdict is ``unverifiable``,
  counted apart, unless a tensor also differs;
* **differing** otherwise: the same dtype and shape (or no dtypes sent, a pre-1.12 client), other bits.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal, TypedDict

from nanwatch.wire import WeightFingerprints

__all__ = ["SHOWN", "Outcome", "SideSet", "Verdict", "WeightSyncMismatch", "compare", "side_set"]

#: the differing (missing, extra, dtype- or shape-differing) tensors a verdict and its event show: the first few
SHOWN = 5

Outcome = Literal["verified", "mismatch", "unverifiable"]


class WeightSyncMismatch(TypedDict):
    """``weight_sync_mismatch`` (a tensor differs, is missing or extra) or ``weight_sync_unverifiable`` (only
    dtypes or shapes that no published cast explains): a rollout worker's weight fingerprints of a version
    against the trainer's. ``differing``/``missing``/``extra``: the first tensor names, sorted (``missing``:
    the trainer has them, the worker not; ``extra``: the reverse); ``dtype_differs``/``shape_differs``: the
    first ones as ``"name: trainer float32, rollout float8_e4m3fn"``; the ``*_count`` fields count them all."""

    version: int
    worker: str
    tensors: int
    differing: list[str]
    differing_count: int
    missing: list[str]
    missing_count: int
    extra: list[str]
    extra_count: int
    dtype_differs: list[str]
    dtype_differs_count: int
    shape_differs: list[str]
    shape_differs_count: int


@dataclass(frozen=True, slots=True)
class SideSet:
    """One side's set of one version as the collector keeps it: fingerprints, dtypes and shapes (empty when
    the sender sent none), the trainer's casts (by dtype), and its digest (a resend's identity)."""

    fingerprints: dict[str, str]
    dtypes: dict[str, str]
    shapes: dict[str, list[int]]
    casts: dict[str, dict[str, str]]
    digest: bytes


def side_set(body: WeightFingerprints) -> SideSet:
    """The kept form of a posted body; its digest covers everything compared (order-independent)."""
    h = hashlib.blake2b(digest_size=16)
    parts = [("", body.fingerprints), ("#dtype", body.dtypes or {}),
             *((f"#cast:{d}", c) for d, c in sorted((body.casts or {}).items()))]
    for tag, values in parts:
        for name in sorted(values):
            h.update(f"{tag}\0{name}\0{values[name]}\0".encode("utf-8", "surrogatepass"))
    for name in sorted(body.shapes or {}):
        h.update(f"#shape\0{name}\0{body.shapes[name]}\0".encode("utf-8", "surrogatepass"))
    return SideSet(dict(body.fingerprints), dict(body.dtypes or {}), dict(body.shapes or {}),
                   {d: dict(c) for d, c in (body.casts or {}).items()}, h.digest())


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
    dtype_differs: tuple[str, ...] = ()
    dtype_differs_count: int = 0
    shape_differs: tuple[str, ...] = ()
    shape_differs_count: int = 0

    @property
    def outcome(self) -> Outcome:
        if self.differing_count or self.missing_count or self.extra_count:
            return "mismatch"
        return "unverifiable" if self.dtype_differs_count or self.shape_differs_count else "verified"

    @property
    def verified(self) -> bool:
        return self.outcome == "verified"

    def answer(self) -> dict[str, object]:
        return {"worker": self.worker, "verified": self.verified, "outcome": self.outcome,
                **{k: v for k, v in self.detail(0).items() if k not in ("version", "worker", "tensors")}}

    def detail(self, version: int) -> WeightSyncMismatch:
        return WeightSyncMismatch(version=version, worker=self.worker, tensors=self.tensors,
                                  differing=list(self.differing), differing_count=self.differing_count,
                                  missing=list(self.missing), missing_count=self.missing_count,
                                  extra=list(self.extra), extra_count=self.extra_count,
                                  dtype_differs=list(self.dtype_differs), dtype_differs_count=self.dtype_differs_count,
                                  shape_differs=list(self.shape_differs), shape_differs_count=self.shape_differs_count)


def compare(worker: str, trainer: SideSet, rollout: SideSet) -> Verdict:
    """The worker's set against the trainer's (module docstring): which tensors differ, which dtypes or shapes
    no cast explains, which are missing or extra."""
    differing, dtypes, shapes = [], [], []
    tfp = trainer.fingerprints
    for name, fp in rollout.fingerprints.items():
        if name not in tfp or fp == tfp[name] or any(c.get(name) == fp for c in trainer.casts.values()):
            continue
        rs, ts = rollout.shapes.get(name), trainer.shapes.get(name)
        rd, td = rollout.dtypes.get(name), trainer.dtypes.get(name)
        if rs is not None and ts is not None and list(rs) != list(ts):
            shapes.append(f"{name}: trainer {list(ts)}, rollout {list(rs)}")
        elif rd is not None and td is not None and rd != td and name not in trainer.casts.get(rd, {}):
            dtypes.append(f"{name}: trainer {td}, rollout {rd}")
        else:
            differing.append(name)
    missing = sorted(tfp.keys() - rollout.fingerprints.keys())
    extra = sorted(rollout.fingerprints.keys() - tfp.keys())
    differing.sort(), dtypes.sort(), shapes.sort()
    return Verdict(worker, tuple(differing[:SHOWN]), len(differing), tuple(missing[:SHOWN]), len(missing),
                   tuple(extra[:SHOWN]), len(extra), len(tfp), tuple(dtypes[:SHOWN]), len(dtypes),
                   tuple(shapes[:SHOWN]), len(shapes))
