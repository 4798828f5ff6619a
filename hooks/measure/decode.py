"""A step's host copy, decoded: a pure function from the copy of the device buffer (``Recorder.flat()``'s
values) and the step's site table (the ``StepState`` that ``Recorder.swap()`` handed over) to a
:class:`StepStats` with named fields.

Why apart from the recorder: the recorder writes during the step, on the training thread, and never reads
back; decoding runs once per step on the reporter thread (``nanwatch.hooks.report.flow``), or once per run
when the differential rerun needs the open step now (:func:`step_so_far`). A value in, a value out: the report
builder reads fields, it never calls back into the recorder, and a test can decode a hand-written copy.

Example usage::

    state = rec.swap()                      # values: the host copy of rec.flat(), made by the reporter
    stats = decode_step(state, values)
    stats.first_offender                    # Offender(site=..., phase=..., stage=...) or None
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from nanwatch.hooks.measure.dtypes import finfo_max
from nanwatch.hooks.measure.figures import FIGURES
from nanwatch.hooks.measure.optimizer_check import MAX_NAMED, BatchSeen, read_batch
from nanwatch.hooks.measure.recorder import GUARD_SKIPPED, NONFINITE_RANK, Recorder, SiteKey, StepState
from nanwatch.hooks.measure.rlhf import decode_rlhf, rlhf_slots
from nanwatch.hooks.measure.slot_buffer import SlotBuffer
from nanwatch.wire import Fingerprint, LogitStat, RlhfStat, SdpaCall, SiteStat, dtype_name

__all__ = ["QUIET_KINDS", "Offender", "SlotReader", "StepSoFar", "StepStats", "decode_step", "nonfinite_phases",
           "step_facts", "step_so_far"]

#: Site kinds reported only when non-finite (checked every step, named only when they matter).
QUIET_KINDS = frozenset({"param"})


class Offender(NamedTuple):
    """The first non-finite value of a step, in execution order: where it was measured."""

    site: str
    phase: str
    stage: str


@dataclass(frozen=True, slots=True)
class SlotReader:
    """A slot's value in one host copy: ``reader(kind, key, default)``, or ``default`` when the slot is not in
    the copy (never written, or allocated after the copy was taken). A value, not a view of the recorder: the
    slot buffer's table only grows and never renumbers a slot, so a lookup reads the same cell whenever it
    runs."""

    values: Sequence[float]
    #: where the slots start in ``values``: after the observation rows and the parameter batches
    base: int
    #: the table that names the slots (None: a step with no slots, e.g. one that never wrote any)
    table: SlotBuffer | None

    def __call__(self, kind: str, key: Hashable, default: float | None = 0.0) -> float | None:
        i = self.table.index(kind, key) if self.table is not None else None
        return default if i is None or self.base + i >= len(self.values) else self.values[self.base + i]


@dataclass(frozen=True, slots=True)
class StepStats:
    """One step's measurements, decoded: what the report is built from (``nanwatch.hooks.report.build``)."""

    sites: tuple[SiteStat, ...]
    """Every measured site in first-call order (quiet kinds only when non-finite), then the optimizer
    batches' non-finite parameters."""
    sdpa: tuple[SdpaCall, ...]
    logits: tuple[LogitStat, ...]
    """A figure per attention layer (bound or exact) and per MoE router (its largest logit)."""
    fingerprints: tuple[Fingerprint, ...]
    """One per model forward: what it was fed (position ids, mask, packing)."""
    first_offender: Offender | None
    """The step's first non-finite value in execution order; never an eval-stage site of a training step."""
    batches: tuple[BatchSeen, ...]
    """The parameter batches read after an optimizer step or at the step's start, decoded."""
    step_skipped: bool | None
    """A weight guard skipped the step's update; None when no guard decided in it."""
    nonfinite_rank: int | None
    """The lowest rank whose step held a non-finite value (the guard's reduction); None: none, or not reduced."""
    rlhf: RlhfStat | None
    """The RLHF stats, when the step recorded any."""
    slot: SlotReader
    """Any other slot of this copy: the slots a module above ``measure`` owns (the scaler's found flag)."""
    figures: dict[str, float]
    """The report figures the step wrote (``nanwatch.hooks.measure.figures``), by path: the builder puts each at
    its place in the report."""

    @property
    def rlhf_slots(self) -> dict[tuple[str, str], float] | None:
        """The raw RLHF slots the step wrote (a job report reduces these across ranks before decoding once):
        read when asked, not at every decode (a hundred slot reads a report that only job reports need)."""
        return rlhf_slots(self.slot) if self.rlhf is not None else None


@dataclass(slots=True)
class _Observed:
    """A site's calls, read off their (min, max) rows."""

    nan: int = 0
    inf: int = 0
    amax: float = -1.0  # largest |x| over finite calls (-1: none)
    top: float = -math.inf  # largest x over finite calls (a router's logit max)


class StepSoFar(NamedTuple):
    """The open step as the differential rerun needs it (:func:`step_so_far`)."""

    first: Offender | None
    masked_rows: int
    compiled: bool
    kinds: dict[str, str]
    """Each site measured so far, by name: its kind (the birth's kind, when the birth is a site)."""


def decode_step(state: StepState, values: Sequence[float], *, slots: SlotBuffer | None = None) -> StepStats:
    """The stats of the step ``state`` records, from ``values``, the host copy of its ``Recorder.flat()``.
    ``slots``: the slot buffer the step wrote into (default ``state.slots``, set by ``Recorder.swap``; the
    open step's is the recorder's own)."""
    if state.flat_order:  # the copy holds its parts grouped by dtype: read them back in order
        values = [v for start, n in state.flat_order for v in values[start : start + n]]
    rows = sum(2 * n for _, _, n in state.layout)
    maxed = _MaxReader(state, values, rows)
    off = rows + sum(n for _, n in state.max_layout)
    batches = _read_batches(state, values, off)
    get = SlotReader(values, off + sum(len(b.batch.names) for b in batches),
                     slots if slots is not None else state.slots)
    per_site, first = _read_rows(state, values, batches)
    routers = {key[0]: seen.top for key, seen in per_site.items()  # an MoE router's largest logit
               if key[1] == "forward" and state.sites[key].kind == "router" and seen.top > -math.inf}
    skipped = get("max", GUARD_SKIPPED, -math.inf)
    lowest = get("max", NONFINITE_RANK, -math.inf)
    kl = state.rlhf if isinstance(state.rlhf, str) else None
    return StepStats(
        sites=(*_site_stats(state, per_site), *_batch_sites(state, batches)),
        sdpa=tuple(SdpaCall(site=k[0], backend=k[1], predicted=k[2], confirmed=k[3], dtype=k[4], shape=k[5],
                            reason=k[6], stage=k[7], calls=n) for k, n in state.sdpa.items()),
        logits=_logits(state, maxed, routers), fingerprints=_fingerprints(state, get, maxed),
        first_offender=Offender(*first) if first is not None else None, batches=batches,
        step_skipped=None if skipped == -math.inf else skipped > 0,
        nonfinite_rank=int(-lowest) if math.isfinite(lowest) else None,
        rlhf=decode_rlhf(get, kl) if state.rlhf else None, slot=get,
        figures={path: get(FIGURES[path].kind, FIGURES[path].key) for path in sorted(state.figures)})


def step_so_far(rec: Recorder) -> StepSoFar:
    """The open step decoded on the host now: one sync (the rerun's, once per run)."""
    stats = decode_step(rec.state, rec.flat().tolist(), slots=rec.buf)  # sync-ok: once per run
    return step_facts(rec.state, stats)


def step_facts(state: StepState, stats: StepStats) -> StepSoFar:
    """What the differential rerun needs of a step, from its record and its decoded stats: the open step's
    (:func:`step_so_far`) or a step already handed over (the rerun decided a step later, on an accelerator)."""
    c = state.coverage
    return StepSoFar(stats.first_offender, sum(f.fully_masked_rows for f in stats.fingerprints),
                     bool(c.compiled_forwards or c.compiled_calls),
                     {key[0]: meta.kind for key, meta in state.sites.items()})


def nonfinite_phases(rec: Recorder) -> set[str]:
    """The phases of the open step's non-finite training sites, decoded on the host now: one sync (rerun
    mode only, to tell a loss-scale overflow from an incident)."""
    values = rec.flat().tolist()  # sync-ok: rerun mode, a step whose non-finite flag is already set
    sites = decode_step(rec.state, values, slots=rec.buf).sites
    return {s.phase for s in sites if s.stage == "train" and (s.nan or s.inf)}


# ---- the parts of a step ------------------------------------------------------------------------------
def _read_batches(state: StepState, values: Sequence[float], off: int) -> tuple[BatchSeen, ...]:
    """The parameter batches in the copy (they follow the observation rows, which end at ``off``)."""
    out = []
    for b in state.batches[: state.flat_batches]:
        out.append(read_batch(b, values[off : off + len(b.names)]))
        off += len(b.names)
    return tuple(out)


def _read_rows(state: StepState, values: Sequence[float], batches: tuple[BatchSeen, ...]
               ) -> tuple[dict[SiteKey, _Observed], SiteKey | None]:
    """Each site's calls read off their (min, max) rows, and the step's first offender. A training step's
    first offender is never an eval-stage site (a forward run in eval mode inside the step): the step's
    remedies and its rerun are about training."""
    offsets, off = {}, 0
    for log, bufkey, n in state.layout:
        offsets[(log, bufkey)] = off
        off += 2 * n
    # a batch's first non-finite parameter, at the batch's place in execution order
    batch_first = sorted((s.batch.pos, (s.batch.names[s.bad[0][0]], s.batch.phase, "train"))
                         for s in batches if s.bad)
    per_site: dict[SiteKey, _Observed] = {}
    first = None
    for i, (key, log, bufkey, row) in enumerate(state.rows):
        if first is None and batch_first and batch_first[0][0] <= i:
            first = batch_first[0][1]
        base = offsets.get((log, bufkey))
        if base is None:  # a row taken after the copy was made (cannot happen within a step)
            continue
        lo, hi = values[base + 2 * row], values[base + 2 * row + 1]
        seen = per_site.setdefault(key, _Observed())
        if lo != lo or hi != hi:
            seen.nan += 1
        elif math.isinf(lo) or math.isinf(hi):
            seen.inf += 1
        else:
            seen.amax = max(seen.amax, -lo, hi)
            seen.top = max(seen.top, hi)
            continue
        if first is None and (key[2] != "eval" or state.stage == "eval"):
            first = key
    if first is None and batch_first:
        first = batch_first[0][1]
    return per_site, first


def _site_stats(state: StepState, per_site: dict[SiteKey, _Observed]) -> list[SiteStat]:
    sites = []
    for key in state.order:
        meta, seen = state.sites[key], per_site.get(key, _Observed())
        if meta.kind in QUIET_KINDS and not (seen.nan or seen.inf):
            continue
        amax = seen.amax if seen.amax >= 0 or not meta.numel else math.nan  # nothing finite: not "safe"
        # An Inf is an overflow that already happened: no headroom left, whatever the finite values say.
        headroom = math.inf if seen.inf else amax / finfo_max(meta.dtype)
        sites.append(SiteStat(
            site=key[0], kind=meta.kind, phase=key[1], stage=key[2], dtype=dtype_name(meta.dtype),
            calls=meta.calls, numel=meta.numel, nan=seen.nan, inf=seen.inf, amax=amax, headroom=headroom))
    return sites


def _batch_sites(state: StepState, batches: tuple[BatchSeen, ...]) -> list[SiteStat]:
    """The non-finite parameters of the step's batches as sites: the first ``MAX_NAMED`` of each, and none
    that the step's own rows already name (the rotating check reads parameters too)."""
    sites, named = [], set(state.sites)
    for s in batches:
        b = s.batch
        for i, nan in s.bad[:MAX_NAMED]:
            key = (b.names[i], b.phase, "train")
            if key in named:
                continue
            named.add(key)
            sites.append(SiteStat(site=b.names[i], kind="param", phase=b.phase, stage="train", dtype=b.dtypes[i],
                                  calls=1, numel=b.numels[i], nan=int(nan), inf=int(not nan), amax=math.nan,
                                  headroom=math.nan if nan else math.inf))
    return sites


class _MaxReader:
    """The max figures of a host copy (``MaxRows.row``): a key's value is the max of its per-call rows,
    cell by cell, NaN winning as it did in ``torch.maximum``; None when no call wrote it."""

    def __init__(self, state: StepState, values: Sequence[float], base: int) -> None:
        self._state, self._values = state, values
        self._offsets: dict = {}
        for key, n in state.max_layout:
            self._offsets[key] = base
            base += n

    def __call__(self, key: Hashable, n: int) -> list[float] | None:
        best = None
        for bufkey, off in self._state.maxes.get(key, ()):
            base = self._offsets.get(bufkey)
            if base is None:  # a row taken after the copy was made (cannot happen within a step)
                continue
            row = self._values[base + off : base + off + n]
            best = list(row) if best is None else [_nanmax(a, b) for a, b in zip(best, row, strict=True)]
        return best


def _nanmax(a: float, b: float) -> float:
    return a if a != a else b if b != b else max(a, b)


def _logits(state: StepState, maxed: _MaxReader, routers: dict[str, float]) -> tuple[LogitStat, ...]:
    out = [LogitStat(layer=layer, bound=top, source="router") for layer, top in routers.items()]
    by_layer: dict[str, dict[str, list[float]]] = {}
    for (layer, source), (_, n) in state.logits.items():
        by_layer.setdefault(layer, {})[source] = maxed((source, layer, n), n) or [-math.inf] * n
    for layer, srcs in by_layer.items():
        exact = srcs.get("exact") or srcs.get("scores")
        heads = srcs.get("lse") or exact
        source = "lse" if "lse" in srcs else ("scores" if "scores" in srcs else "exact")
        out.append(LogitStat(layer=layer, bound=max(heads), source=source,
                             exact=max(exact) if exact else None, per_head=heads))
    return tuple(out)


def _fingerprints(state: StepState, get: SlotReader, maxed: _MaxReader) -> tuple[Fingerprint, ...]:
    prints = []
    for f in state.forwards:
        resets = get("sum", f.key("resets"))
        packed = f.packed_checked and resets > 0
        mask = "packed_block" if packed and f.mask_4d_seen and f.mask in ("none", "4d") else f.mask
        rows = (maxed(f.key("masked_rows"), 1) or [0.0])[0]  # no row: no mask seen this forward
        prints.append(Fingerprint(
            forward=f.index, position_ids=f.position_ids, mask=mask,
            fully_masked_rows=int(rows) if math.isfinite(rows) and rows > 0 else 0,
            packed=packed, plain_causal=f.plain_causal, cross_doc_leak=packed and f.plain_causal))
    return tuple(prints)
