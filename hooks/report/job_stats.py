"""The arithmetic of one job-step: many ranks' reports of a step become the job's report. Pure (no collective).

Each rank describes its step by a ``Table`` (which sites, SDPA signatures, logit layers and forwards it saw, in
execution order) and, once the ranks agree on one table, by two fixed-size float64 vectors laid out by it: one
reduced by SUM (counts: calls, NaN/Inf, tokens, coverage), one by MAX (amax, headroom, logit figures, flags;
a minimum or the first offender travels negated). The report figures (``nanwatch.hooks.measure.figures``) ride
at the end, each reduced as its declaration says, read off the ranks' reports by path: a new one needs nothing
here. ``nanwatch.hooks.report.job`` runs the collectives and hands
the reduced vectors back here. Kept apart so that the layout has one owner and the arithmetic is tested
against per-rank reports in one process.

Example usage (what the collectives do, written out for two ranks)::

    a, b = contribution(report0, rlhf0), contribution(report1, rlhf1)
    table = merge_tables([a.table, b.table])
    (s0, m0), (s1, m1) = a.vectors(table, world=2), b.vectors(table, world=2)
    job = reduce_job(report0, table, [x + y for x, y in zip(s0, s1)], [max(x, y) for x, y in zip(m0, m1)], world=2)
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import get_args

from nanwatch.hooks.measure.figures import FIGURES, fill, value_at
from nanwatch.hooks.measure.rlhf import RLHF_SLOTS, decode_rlhf
from nanwatch.hooks.measure.scaler_overflow import handled_by_scaler
from nanwatch.hooks.moe.report import moe_layout, moe_vectors, read_moe
from nanwatch.wire import (
    MODES,
    Coverage,
    Fingerprint,
    LogitStat,
    RlhfStat,
    SdpaCall,
    SiteStat,
    StepReport,
    Unmeasured,
)

__all__ = ["Contribution", "JobStep", "Table", "contribution", "merge_tables", "reduce_job"]

_UNMEASURED: tuple[str, ...] = get_args(Unmeasured)
_COUNTS = ("forwards", "attention_calls", "attention_probed", "compiled_calls", "recomputed_calls", "params_checked")
_KL = ("k1", "k3", "k3_ratio")
_NONE = -math.inf  # "this rank has no value" in a MAX vector


@dataclass(frozen=True, slots=True)
class Table:
    """What one step held, in execution order; the vectors' layout. Ranks of one job agree on it first."""

    sites: tuple[tuple[str, str, str, str, str], ...]  # (site, phase, stage, kind, dtype)
    sdpa: tuple[tuple, ...]  # (site, backend, predicted, confirmed, dtype, shape, reason, stage)
    logits: tuple[tuple[str, str, int], ...]  # (layer, source, heads)
    forwards: tuple[tuple[int, str, str], ...]  # (index, position_ids, mask)
    moe: tuple[tuple[str, int, int], ...] = ()  # (router, experts, top_k): ``nanwatch.hooks.moe.report``
    figures: tuple[str, ...] = ()  # the report figures' paths (``nanwatch.hooks.measure.figures``), sorted

    def digest(self) -> int:
        """62 bits of a hash of the whole table: equal on every rank iff the tables are (an int64 all-reduce)."""
        return int.from_bytes(hashlib.blake2b(repr(self).encode(), digest_size=8).digest(), "big") >> 2

    def groups(self) -> list[tuple[str, str, str]]:
        """(site, stage, backend) of the SDPA signatures: what "another backend" is decided on."""
        return list(dict.fromkeys((k[0], k[7], k[1]) for k in self.sdpa))


def _site_key(e: tuple) -> Hashable:
    return e[:3]


def _whole(e: tuple) -> Hashable:
    return e


def _first(e: tuple) -> Hashable:
    return e[0]


def _merge(lists: list[tuple], key: Callable[[tuple], Hashable]) -> tuple:
    """Ordered union: each entry another rank alone holds goes right after its predecessor on that rank, so
    that the union stays in execution order (an MoE expert fired on one rank lands inside its layer)."""
    out = list(lists[0])
    for lst in lists[1:]:
        keys = [key(e) for e in out]
        prev = None
        for e in lst:
            k = key(e)
            if k not in keys:
                at = keys.index(prev) + 1 if prev is not None else 0
                out.insert(at, e)
                keys.insert(at, k)
            prev = k
    return tuple(out)


def merge_tables(tables: list[Table]) -> Table:
    """The job's table from every rank's (in rank order; a site's kind and dtype are the lowest rank's)."""
    if all(t == tables[0] for t in tables):
        return tables[0]
    return Table(sites=_merge([t.sites for t in tables], _site_key), sdpa=_merge([t.sdpa for t in tables], _whole),
                 logits=_merge([t.logits for t in tables], _first),
                 forwards=tuple(sorted(_merge([t.forwards for t in tables], _first))),
                 moe=_merge([t.moe for t in tables], _first),
                 figures=tuple(sorted({p for t in tables for p in t.figures})))


def _nan_to(x: float) -> float:
    return _NONE if x != x else x


def _directive_key(mode: str, version: int) -> int:
    return version * len(MODES) + MODES.index(mode)


@dataclass(slots=True)
class Contribution:
    """One rank's step, ready to be laid out by the job's table."""

    rank: int
    report: StepReport
    rlhf: dict[tuple[str, str], float] | None
    table: Table

    def vectors(self, table: Table, *, world: int) -> tuple[list[float], list[float]]:
        """(SUM vector, MAX vector) of this rank, laid out by ``table``."""
        r = self.report
        sites = {(s.site, s.phase, s.stage): s for s in r.sites}
        sdpa = {(c.site, c.backend, c.predicted, c.confirmed, c.dtype, c.shape, c.reason, c.stage): c.calls
                for c in r.sdpa}
        mine = {(k[0], k[7], k[1]) for k in sdpa}
        logits = {lg.layer: lg for lg in r.logits}
        prints = {f.forward: f for f in r.fingerprints}
        cov = r.coverage or Coverage()
        sums: list[float] = [1.0]
        maxes: list[float] = []
        for e in table.sites:
            s = sites.get(e[:3])
            sums += [s.calls, s.numel, s.nan, s.inf] if s else [0.0] * 4
            maxes += [_nan_to(s.amax), _nan_to(s.headroom)] if s else [_NONE, _NONE]
        sums += [sdpa.get(k, 0) for k in table.sdpa]
        groups = table.groups()
        sums += [1.0 if g in mine else 0.0 for g in groups]
        maxes += [-float(self.rank) if g in mine else _NONE for g in groups]
        for layer, _, heads in table.logits:
            lg = logits.get(layer)
            per_head = lg.per_head if lg is not None and lg.per_head and len(lg.per_head) == heads else None
            exact = lg.exact if lg is not None and lg.exact is not None else _NONE
            maxes += [_nan_to(lg.bound) if lg else _NONE, _nan_to(exact), float(lg is not None and lg.bound != lg.bound),
                      float(exact != exact)]  # a NaN figure is the signal: it travels as a flag, MAX keeps it
            maxes += [_nan_to(h) for h in per_head] if per_head else [_NONE] * heads
        for index, _, _ in table.forwards:
            f = prints.get(index)
            sums.append(f.fully_masked_rows if f else 0.0)
            maxes += [float(f.packed), float(f.plain_causal), float(f.cross_doc_leak)] if f else [0.0] * 3
        sums += [getattr(cov, name) for name in _COUNTS]
        maxes += [float(cov.logits), *(float(u in cov.unmeasured) for u in _UNMEASURED)]
        raw = self.rlhf or {}
        sums.append(1.0 if self.rlhf is not None else 0.0)
        for slot in RLHF_SLOTS:
            if slot[0] == "sum":
                sums += [raw.get(slot, 0.0), 1.0 if slot in raw else 0.0]
            else:
                maxes.append(raw.get(slot, _NONE))
        kl = r.rlhf.kl_optimised if r.rlhf is not None else None
        maxes.append(float(_KL.index(kl)) if kl else -1.0)
        maxes.append(-1.0 if r.step_skipped is None else float(r.step_skipped))
        first = (r.first_offender, r.first_offender_phase, r.first_offender_stage)
        keys = [e[:3] for e in table.sites]
        maxes.append(-float(keys.index(first) * world + self.rank) if first in keys else _NONE)
        maxes.append(float(_directive_key(r.attention_mode, r.directive_version)))
        moe_sums, moe_maxes = moe_vectors(r.moe, table.moe)
        fig_sums, fig_maxes = _figure_vectors(r, table.figures)
        return sums + moe_sums + fig_sums, maxes + moe_maxes + fig_maxes

    def differs(self, job: JobStep) -> str | None:
        """Why this rank's own report must go beside the job's (a ``detail``), or None."""
        r = self.report
        if r.raised is not None:  # the rank crashed: the collector must hear it from the rank itself
            return "raised"
        if r.first_offender is not None or (r.rlhf is not None and any(r.rlhf.nonfinite.values())):
            return "nonfinite"
        if any(job.backends.get((c.site, c.stage), c.backend) != c.backend for c in r.sdpa):
            return "backend"
        if _directive_key(r.attention_mode, r.directive_version) != job.directive_key:
            return "directive"
        return None


def contribution(report: StepReport, rlhf: dict[tuple[str, str], float] | None, *, rank: int) -> Contribution:
    """A rank's step as the reduction needs it: its report, its raw RLHF slots (None: no RLHF this step)."""
    table = Table(
        sites=tuple((s.site, s.phase, s.stage, s.kind, s.dtype) for s in report.sites),
        sdpa=tuple(dict.fromkeys((c.site, c.backend, c.predicted, c.confirmed, c.dtype, c.shape, c.reason, c.stage)
                                 for c in report.sdpa)),
        logits=tuple((lg.layer, lg.source, len(lg.per_head or ())) for lg in report.logits),
        forwards=tuple((f.forward, f.position_ids, f.mask) for f in report.fingerprints), moe=moe_layout(report.moe),
        figures=tuple(p for p in sorted(FIGURES) if value_at(report, p) is not None))
    return Contribution(rank, report, rlhf, table)


@dataclass(slots=True)
class JobStep:
    """The job's report of a step, and what a rank compares itself with to know whether it differs."""

    report: StepReport
    #: (site, stage) -> the backend most ranks ran there (ties: the one the lowest rank ran)
    backends: dict[tuple[str, str], str]
    #: the directive (version, mode) every rank should be on: the highest, as the agreement is a MAX
    directive_key: int


class _Reader:
    def __init__(self, values: list[float]) -> None:
        self._values, self._at = values, 0

    def take(self, n: int = 1) -> list[float]:
        out = self._values[self._at: self._at + n]
        self._at += n
        return out

    def one(self) -> float:
        return self.take()[0]


def reduce_job(poster: StepReport, table: Table, sums: list[float], maxes: list[float], *, world: int) -> JobStep:
    """The job's report from the reduced vectors: ``poster``'s own report (ids, time, warnings, incident and
    any field this module does not reduce) with the reduced figures in place of its own. Reads the vectors in
    the order ``Contribution.vectors`` wrote them."""
    s, m = _Reader(sums), _Reader(maxes)
    ranks = int(s.one())
    sites = _read_sites(table, s, m)
    sdpa = [SdpaCall(site=k[0], backend=k[1], predicted=k[2], confirmed=k[3], dtype=k[4], shape=k[5], reason=k[6],
                     stage=k[7], calls=int(n)) for k, n in zip(table.sdpa, s.take(len(table.sdpa)), strict=True)]
    backends = _read_backends(table, s, m)
    logits, prints = _read_logits(table, m), _read_forwards(table, s, m)
    counts = dict(zip(_COUNTS, (int(x) for x in s.take(len(_COUNTS))), strict=True))
    head_seen, *flags = m.take(1 + len(_UNMEASURED))
    coverage = Coverage(**counts, sites=len(sites), logits=bool(head_seen),
                        unmeasured=[u for u, f in zip(_UNMEASURED, flags, strict=True) if f])
    rlhf = _read_rlhf(s, m)
    skipped = m.one()
    first = m.one()
    first_at, first_rank = divmod(int(-first), world) if first != _NONE else (None, None)
    directive = int(m.one())
    moe = read_moe(table.moe, s.take, m.take, poster=poster.moe)
    figures = _read_figures(table.figures, s, m)
    offender = table.sites[first_at][:3] if first_at is not None else (None, None, None)
    report = StepReport(**{
        **dict(poster), "scope": "job", "sites": sites, "sdpa": sdpa, "logits": logits, "fingerprints": prints,
        "coverage": coverage, "rlhf": rlhf, "moe": moe, "step_skipped": None if skipped < 0 else bool(skipped),
        "first_offender": offender[0], "first_offender_phase": offender[1], "first_offender_stage": offender[2],
        "first_offender_rank": first_rank, "ranks_reporting": ranks, "world_size": world,
        "attention_mode": MODES[directive % len(MODES)], "directive_version": directive // len(MODES),
        # the poster's scaler found inf (gradients are all-reduced: every rank's finds the same); still an
        # overflow only if no rank's forward was non-finite
        "scaler_overflow": None if poster.scaler_overflow is None else handled_by_scaler(poster.scaler_overflow, sites)})
    return JobStep(fill(report, figures), backends, directive)


def _read_sites(table: Table, s: _Reader, m: _Reader) -> list[SiteStat]:
    sites = []
    for site, phase, stage, kind, dtype in table.sites:
        calls, numel, nan, inf = (int(x) for x in s.take(4))
        amax, headroom = m.take(2)
        sites.append(SiteStat(site=site, kind=kind, phase=phase, stage=stage, dtype=dtype, calls=calls, numel=numel,
                              nan=nan, inf=inf, amax=amax if amax >= 0 or not numel else math.nan,
                              headroom=math.inf if inf else (math.nan if headroom == _NONE else headroom)))
    return sites


def _read_backends(table: Table, s: _Reader, m: _Reader) -> dict[tuple[str, str], str]:
    """(site, stage) -> the backend most ranks ran there (ties: the one the lowest rank ran)."""
    groups = table.groups()
    best: dict[tuple[str, str], tuple[float, float, str]] = {}
    for (site, stage, backend), n, low in zip(groups, s.take(len(groups)), m.take(len(groups)), strict=True):
        if (site, stage) not in best or (n, low) > best[(site, stage)][:2]:
            best[(site, stage)] = (n, low, backend)
    return {k: v[2] for k, v in best.items()}


def _read_logits(table: Table, m: _Reader) -> list[LogitStat]:
    logits = []
    for layer, source, heads in table.logits:
        bound, exact, bound_nan, exact_nan = m.take(4)
        per_head = m.take(heads)
        logits.append(LogitStat(layer=layer, bound=math.nan if bound_nan else bound, source=source,
                                exact=math.nan if exact_nan else (None if exact == _NONE else exact),
                                per_head=per_head or None))
    return logits


def _read_forwards(table: Table, s: _Reader, m: _Reader) -> list[Fingerprint]:
    prints = []
    for index, position_ids, mask in table.forwards:
        rows = int(s.one())
        packed, plain, leak = (bool(x) for x in m.take(3))
        prints.append(Fingerprint(forward=index, position_ids=position_ids, mask=mask, fully_masked_rows=rows,
                                  packed=packed, plain_causal=plain, cross_doc_leak=leak))
    return prints


def _across(path: str) -> str:
    fig = FIGURES.get(path)
    return fig.across if fig is not None else "max"


def _figure_vectors(r: StepReport, paths: tuple[str, ...]) -> tuple[list[float], list[float]]:
    """This rank's report figures laid out by the job's ``paths``: a sum as (value, present) in the SUM vector, a
    max as its value and a min negated in the MAX vector (``_NONE``: this rank has none)."""
    sums: list[float] = []
    maxes: list[float] = []
    for path in paths:
        v = value_at(r, path)
        across = _across(path)
        if across == "sum":
            sums += [float(v or 0.0), float(v is not None)]
        else:
            maxes.append(_NONE if v is None else _nan_to(float(v) if across == "max" else -float(v)))
    return sums, maxes


def _read_figures(paths: tuple[str, ...], s: _Reader, m: _Reader) -> dict[str, float]:
    """The job's report figures from the reduced vectors (ranks' sums summed, maxima maxed, minima by negation);
    a figure no rank had is left out."""
    out = {}
    for path in paths:
        across = _across(path)
        if across == "sum":
            total, present = s.take(2)
            if present:
                out[path] = total
            continue
        x = m.one()
        if x != _NONE:
            out[path] = x if across == "max" else -x
    return out


def _read_rlhf(s: _Reader, m: _Reader) -> RlhfStat | None:
    """The job's RLHF stats, decoded once from the reduced slots (sums summed, maxima maxed)."""
    rlhf_ranks = s.one()
    slots: dict[tuple[str, tuple[str, str]], float] = {}
    for kind, name in RLHF_SLOTS:
        if kind == "sum":
            total, present = s.take(2)
            if present:
                slots[(kind, ("rlhf", name))] = total
        else:
            slots[(kind, ("rlhf", name))] = m.one()
    kl = int(m.one())
    return decode_rlhf(lambda kind, key, default=0.0: slots.get((kind, key), default),
                       _KL[kl] if kl >= 0 else None) if rlhf_ranks else None
