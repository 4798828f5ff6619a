"""The Prometheus exporter. A scrape takes a snapshot of the state on the event loop (shallow copies:
the per-rank views are replaced, never mutated, by each report) and renders it in a worker thread, one
render at a time and at most one per interval (``MetricsRenderer``), so that scrapers, however many and
however fast, neither stall ingest nor multiply the work.

Per-layer and per-site series are aggregated over ranks here (max or sum): never a rank x layer series.

No accepted input can take a render down for anyone (#37): figures are combined with arithmetic that cannot
raise (plain float sums and means, never ``math.fsum``/``statistics.fmean``), and a run whose series still
cannot be built is left out of that render (its partial series removed), counted in
``nanwatch_collector_render_errors_total{reason="run_left_out"}`` and recorded as an event of the run
(``MetricsRenderer``'s ``on_left_out``), while every other run and the collector's own health are rendered.

Job mode (wire 1.4): the run-level gauges come from the job report (and per-rank reports, never detail
ones); a rank known only through heartbeats has no per-rank series, so that a 65,536-rank job exports what
a few ranks do, except what a person must see by rank: its last report time once it is late
(``late_s``), its attention mode when it differs from the job's, its dropped reports when there are any.
The rank that posts the job reports stands for the job's per-rank figures (its skipped steps are the
job's), as do ranks with detail reports.
"""

from __future__ import annotations

import asyncio
import gzip
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, choose_encoder, generate_latest
from prometheus_client.registry import Collector

from nanwatch.monitor.data import metric_table as m
from nanwatch.monitor.data import report_figures
from nanwatch.monitor.data.directive_log import DirectiveLog
from nanwatch.monitor.data.event_log import first_nonfinite
from nanwatch.monitor.data.liveness import held_ranks, is_live, late_after, live_job, ttl, world_size
from nanwatch.monitor.data.metric_table import METRICS, MetricSpec
from nanwatch.monitor.data.rollout_figures import STATS as ROLLOUT_STATS
from nanwatch.monitor.data.rollout_figures import combined as combine_rollout
from nanwatch.monitor.data.rollout_figures import measured_views
from nanwatch.monitor.data.state import CollectorState, RankState, RunState
from nanwatch.monitor.data.store import EventRow
from nanwatch.monitor.read import views
from nanwatch.readable import printable
from nanwatch.wire import Directive, MoeStat

__all__ = ["FORMATS", "RENDER_ERRORS", "Exposure", "SNAPSHOT_CHUNK", "MetricsRenderer", "Snapshot", "negotiate", "render",
           "snapshot", "snapshot_runs"]

log = logging.getLogger("nanwatch.monitor")

class Exposure(Protocol):
    """The writes a render makes, handed in (``nanwatch.monitor.write.exposure``, wired by the app): this
    module reads the state and never writes it. What a render shows for the first time is marked shown
    (born at zero), a replica's counter series start where its tenure does, render errors are counted."""

    def take_run(self, state: CollectorState, run_id: str, run: RunState, shown: list[RankState], *,
                 live: bool) -> tuple[frozenset[tuple[str, tuple]], frozenset[int]]: ...

    def take_counters(self, state: CollectorState, run_id: str, run: RunState, *, live: bool) -> tuple[
        dict[tuple[str, tuple], int], dict[str, int], dict[tuple[str, tuple], int] | None, bool]: ...

    def take_collector(self, state: CollectorState, rejected: dict[str, int], caps: dict[str, int], *,
                       runs_consumed: bool) -> None: ...

    def rendered(self, state: CollectorState, notes: Counter[str]) -> None: ...


_PASSES = (("forward", "nan"), ("forward", "inf"), ("backward", "nan"), ("backward", "inf"))


def _mean(values: list[float]) -> float:
    """The plain mean: an overflow is inf and inf - inf is NaN, never an exception (``statistics.fmean``
    raised on 1e308 + 1e308 and on inf + -inf, and took every render with it: #37)."""
    return sum(values) / len(values)


#: RLHF figures and how they combine over ranks (each rank's latest step); NaN and Inf are the data here
_RLHF = {"ratio_max": max, "kl_k1_max": max, "kl_k3_max": max, "logprob_min": min,
         "clip_fraction": _mean, "kl_k1_mean": _mean, "kl_k3_mean": _mean, "kl_k3_ratio_mean": _mean,
         "advantage_std": _mean}
#: ``nanwatch_collector_render_errors_total`` reasons, a fixed set (each shown from the first render, at 0):
#: ``run_left_out`` a run whose series could not be built was left out of a render; ``rollout_distrusted`` a
#: run's ranks' rollout token counts were more than ``TOKEN_SPREAD`` apart (its token means are the worst
#: rank's); ``count_clamped`` a run's summed rollout counts were cut to the wire's integer bound
RENDER_ERRORS = ("run_left_out", "rollout_distrusted", "count_clamped")


def _max(values: Iterable[float]) -> float:
    """Max that lets NaN win: a NaN bound is news, not something to hide behind a finite one."""
    best = -math.inf
    for v in values:
        if v != v:
            return math.nan
        if v > best:
            best = v
    return best


@dataclass(frozen=True, slots=True)
class RunSnapshot:
    run_id: str
    series_dropped: int
    event_counts: dict[str, int]
    live: list[RankState] | None  # the ranks with per-rank series; None: no live rank, only the run's totals
    live_count: int
    world_size: int
    job: RankState | None  # the live job view (job mode), else None
    counters: dict[tuple[str, tuple], int]
    first_offender_event: EventRow | None
    directive: Directive | None
    late_before: float = -math.inf
    """Monotonic time: a heartbeat-only rank last seen before it is late (its last report time is shown)."""
    crashed: tuple[int, ...] = ()
    """Ranks whose step raised (``RunState.crashed``), live or not: the run ends crashed."""
    born: frozenset[tuple[str, tuple]] = frozenset()
    """Counter keys born since the last render: shown at 0 this once (born at zero)."""
    fresh_ranks: frozenset[int] = frozenset()
    """Ranks whose per-rank series this render shows for the first time: their dropped reports at 0."""
    silent: tuple[tuple[int, float], ...] = ()
    """(rank, last report wall time) of ranks gone silent without ending: hung, still alerting."""
    ended: bool = False
    latest_offenders: tuple[tuple[str, tuple[str, str, str]], ...] = ()
    math_fallback: tuple[str, str, str] | None = None
    latest_incidents: tuple[tuple[str, tuple[str, str, str]], ...] = ()
    namespace: str = "*"
    """The run-id namespace the run belongs to (``HostCaps.namespace_of``): the host series' label."""
    weight_lag: tuple[tuple[str, int], ...] = ()
    """Each rollout worker's weight-sync lag in versions (``RunState.weight_lag``)."""
    totals: dict[tuple[str, tuple], int] | None = None
    """Replicas: the totals this render's counters of the run stand for (``data.tenures``), recorded after
    the render (``MetricsRenderer``'s ``on_rendered``); None: not exported here, or one collector."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    runs: list[RunSnapshot]
    tau: float
    accepted: int
    duplicates: int
    rejected: dict[str, int]
    caps_hit: dict[str, int]
    until: float = math.inf
    """Monotonic time at which the next heartbeat-only rank turns late: the render is stale then."""
    render_errors: dict[str, int] | None = None
    """``nanwatch_collector_render_errors_total`` by reason before this render (``CollectorState.render_errors``)."""


class _Runs(NamedTuple):
    """The runs' part of a snapshot: each run copied whole, when the next rank turns late, and whether a
    born-at-zero series was shown (consumed)."""

    runs: list[RunSnapshot]
    until: float
    consumed: bool


def _run_snapshot(state: CollectorState, directive_log: DirectiveLog, exposure: Exposure, run_id: str,
                  run: RunState, now: float, late_s: float) -> tuple[RunSnapshot, float, bool]:
    """One run as a scrape shows it (its own figures copied at once: a run is never half old, half new); what
    it shows for the first time is marked shown by ``exposure`` (the writes a render makes)."""
    # replicas on one database: one shows a run (``CollectorState.exported_runs``)
    live = is_live(state, run, now) and (state.exported_runs is None or run_id in state.exported_runs)
    count, shown = views.ranks_view(state, run, now, late_s) if live else (0, [])
    job = live_job(state, run, now) if live else None
    world = world_size(state, run, now)
    if live and run_id in state.foreign_views:  # ranks that report to other replicas (shared_metrics)
        count, shown, job = _with_foreign(state, run, now, count, shown, job)
        world = job.world_size if job is not None else world  # the live job report's, as liveness.world_size
    until = views.next_late(run, now, late_s) if live else math.inf
    born, fresh = exposure.take_run(state, run_id, run, shown, live=live)  # born at zero: shown at 0 now
    counters, events, totals, news = exposure.take_counters(state, run_id, run, live=live)
    snap = RunSnapshot(
        run_id, run.series_dropped, events, shown if live else None, count,
        world, job, counters,
        run.first_offender_event if live else None, directive_log.current(run_id) if live else None,
        now - late_after(run, late_s), tuple(sorted(run.crashed)), born, fresh,
        tuple(views.hung(state, run, now)), run.ended,
        tuple(run.latest_offenders.items()), run.math_fallback, tuple(run.latest_incidents.items()),
        state.hosts.namespace_of(run_id), tuple(sorted(run.weight_lag.items())), totals)
    return snap, until, bool(born) or bool(fresh) or news


def _with_foreign(state: CollectorState, run: RunState, now: float, count: int, shown: list[RankState],
                  job: RankState | None) -> tuple[int, list[RankState], RankState | None]:
    """This replica's views of a run it exports, with the newer views of its ranks that other replicas
    received (``CollectorState.foreign_views``): each rank once, by its latest report; the live ranks count
    those this replica does not hold itself. A foreign heartbeat-only view gets the per-rank series such a
    rank gets here (``_per_rank``: its report time once late, its mode when it differs, its drops)."""
    horizon = now - ttl(state, run)
    by_rank = {st.rank: st for st in shown}
    held = {st.rank for st in held_ranks(state, run, now)}
    for rank, st in state.foreign_views[run.run_id].items():
        if st.seen < horizon or st.crashed is not None:
            continue
        if rank < 0:
            if job is None or st.received > job.received:
                job = st
            continue
        own = by_rank.get(rank)
        if own is None or st.received > own.received:
            by_rank[rank] = st
        if rank not in held:
            held.add(rank)
            count += 1
    return count, sorted(by_rank.values(), key=lambda st: st.rank), job


#: runs copied between two yields to the event loop (about 14 ms of copying on the 2-core benchmark machine)
SNAPSHOT_CHUNK = 256


async def snapshot_runs(state: CollectorState, directive_log: DirectiveLog, exposure: Exposure, *,
                        late_s: float) -> _Runs:
    """Every run copied on the event loop, ``SNAPSHOT_CHUNK`` at a time with the loop given back between
    chunks: 9,000 live runs took 0.4-0.5 s in one go, a stall of every trainer's ingest once per scrape. A run
    forgotten meanwhile is left out; one written meanwhile is copied as it is then (newer than the scrape,
    never older: what was acknowledged before the scrape began is in it)."""
    now = time.monotonic()
    out, until, consumed = [], math.inf, False
    for i, (run_id, run) in enumerate(list(state.runs.items())):
        if i and i % SNAPSHOT_CHUNK == 0:
            await asyncio.sleep(0)
        if state.runs.get(run_id) is not run:
            continue
        snap, run_until, run_consumed = _run_snapshot(state, directive_log, exposure, run_id, run, now, late_s)
        out.append(snap)
        until, consumed = min(until, run_until), consumed or run_consumed
    return _Runs(out, until, consumed)


def snapshot(state: CollectorState, directive_log: DirectiveLog, exposure: Exposure, *, logit_tau: float,
             late_s: float = math.inf, runs: _Runs | None = None) -> Snapshot:
    """What a scrape shows, copied on the event loop (cheap: no metric objects are built here, and a job's
    ranks known only by heartbeats are counted, not copied). ``runs``: the runs already copied
    (``snapshot_runs``, which the renderer awaits first), else they are copied here in one go."""
    if runs is None:
        now = time.monotonic()
        parts = [_run_snapshot(state, directive_log, exposure, run_id, run, now, late_s)
                 for run_id, run in state.runs.items()]
        runs = _Runs([p[0] for p in parts], min((p[1] for p in parts), default=math.inf), any(p[2] for p in parts))
    req = state.requests
    rejected, caps = dict(req.rejected), dict(state.caps_hit)
    exposure.take_collector(state, rejected, caps, runs_consumed=runs.consumed)  # born at zero too
    return Snapshot(runs.runs, logit_tau, req.accepted, req.duplicates, rejected, caps, runs.until,
                    dict(state.render_errors))


def family(name: str) -> CounterMetricFamily | GaugeMetricFamily:
    """A fresh, empty family for ``name``, typed and labelled from the table."""
    spec = METRICS[name]
    cls = CounterMetricFamily if spec.type == "counter" else GaugeMetricFamily
    return cls(spec.name, spec.help, labels=spec.labels)


class _Families(dict):
    """One render's metric families, by name, each fresh and empty from the table (``data.metric_table``)."""

    def __init__(self) -> None:
        super().__init__((name, family(name)) for name in METRICS)

    def add(self, spec: MetricSpec, labels: list[str], value: float) -> None:
        self[spec.name].add_metric(labels, value)


#: counter families exported as they are stored, labels after run_id (by stored key: their metric's spec), the
#: table's counter figures among them
_AS_STORED = {spec.key: spec for spec in (
    m.SITE_NONFINITE_CALLS, m.SDPA_CALLS, m.UNMEASURED_STEPS, m.INCIDENTS, m.LOSS_SCALE_OVERFLOWS,
    m.ROLLOUT_MISMATCH_EVENTS, m.WEIGHT_SYNCS_VERIFIED, m.WEIGHT_SYNC_MISMATCHES, m.SPIKES,
    m.WEIGHT_SYNCS_UNVERIFIABLE, *report_figures.COUNTER_FIGURES)}


def _value(run: RunSnapshot, fam: MetricSpec, labels: tuple) -> int:
    """A counter's total as this render shows it: 0 if it was born since the last render (exact;
    prometheus_client writes float64)."""
    key = (fam.key, labels)
    return 0 if key in run.born else run.counters.get(key, 0)


def _lifecycle(f: _Families, run: RunSnapshot) -> None:
    """What a run shows whether or not it is live: dropped series, events, crashed and hung ranks, its end."""
    run_id = run.run_id
    if run.series_dropped:
        f.add(m.SERIES_DROPPED, [run_id], 0 if ("series_dropped", ()) in run.born else run.series_dropped)
    for kind, n in run.event_counts.items():
        f.add(m.EVENTS, [run_id, kind], 0 if ("events", (kind,)) in run.born else n)
    for rank in run.crashed:
        f.add(m.RANK_CRASHED, [run_id, str(rank)], 1)
    for rank, received in run.silent:  # hung: the stale-rank alert keeps firing while it is
        f.add(m.LAST_REPORT_TIMESTAMP, [run_id, str(rank)], received)
    if run.ended:
        f.add(m.RUN_ENDED, [run_id], 1)


def _where(f: _Families, run: RunSnapshot) -> None:
    """The info series that say where: the latest offenders and incidents, the math fallback, the first
    offender (from the event log)."""
    run_id = run.run_id
    for stage, (site, pass_, rank) in run.latest_offenders:
        f.add(m.LATEST_OFFENDER_INFO, [run_id, stage, site, pass_, rank], 1)
    for cls, (host, rank, capsule) in run.latest_incidents:
        f.add(m.LATEST_INCIDENT_INFO, [run_id, cls, host, rank, printable(capsule)], 1)  # a trainer's path
    if run.math_fallback is not None:
        f.add(m.MATH_FALLBACK_INFO, [run_id, *run.math_fallback], 1)
    fo = run.first_offender_event
    if fo is not None:
        where = first_nonfinite(fo)
        f.add(m.FIRST_OFFENDER_INFO, [run_id, fo.site or "", str(where.get("phase") or ""),
                                      str(where.get("stage") or "train"), "" if fo.rank is None else str(fo.rank)], 1)


def _run_gauges(f: _Families, run: RunSnapshot) -> None:
    """The live run's own gauges: live ranks and world size (none once it ended: it holds no ranks, so nothing
    is missing), its directive."""
    run_id = run.run_id
    if not run.ended:
        f.add(m.LIVE_RANKS, [run_id], run.live_count)
    d = run.directive
    f.add(m.DIRECTIVE_INFO, [run_id, d.mode, str(d.version)], 1)
    for worker, lag in run.weight_lag:
        f.add(m.WEIGHT_SYNC_LAG, [run_id, worker], lag)
    if not run.ended:
        f.add(m.RUN_WORLD_SIZE, [run_id], run.world_size)  # ``data.liveness.world_size``


def _per_rank(f: _Families, run: RunSnapshot) -> None:
    """The per-rank series: all of them for a rank with its own view (and the job's poster, which stands for
    the job's per-rank figures); for a rank known by heartbeats alone, only what must be seen by rank."""
    run_id, job = run.run_id, run.job
    job_skipped = _value(run, m.JOB_SKIPPED, ())
    poster, job_mode = (job.rank, job.attention_mode) if job is not None else (None, "none")
    for st in run.live:
        rank = str(st.rank)
        dropped = 0 if st.rank in run.fresh_ranks else st.dropped_reports
        if st.scope != "heartbeat" or st.rank == poster:
            for pass_, kind in _PASSES:
                labels = (rank, pass_, kind)
                f.add(m.NONFINITE_CALLS, [run_id, *labels], _value(run, m.NONFINITE_CALLS, labels))
            f.add(m.ATTENTION_MODE, [run_id, rank, st.attention_mode], 1)
            f.add(m.LAST_REPORT_TIMESTAMP, [run_id, rank], st.received)
            f.add(m.REPORTS_DROPPED, [run_id, rank], dropped)
            f.add(m.SKIPPED_STEPS, [run_id, rank], _value(run, m.SKIPPED_STEPS, (rank,)) + job_skipped)
            continue
        if st.seen < run.late_before:
            f.add(m.LAST_REPORT_TIMESTAMP, [run_id, rank], st.received)
        if st.attention_mode != job_mode:
            f.add(m.ATTENTION_MODE, [run_id, rank, st.attention_mode], 1)
        if st.dropped_reports:
            f.add(m.REPORTS_DROPPED, [run_id, rank], dropped)


def _measured(f: _Families, run: RunSnapshot, notes: Counter[str]) -> None:
    """The latest step's figures over the measured views (ranks' own, and the job's): logit bounds and
    headroom (max, a NaN wins), RLHF health (each figure combined its own way)."""
    run_id, job = run.run_id, run.job
    measured = [st for st in run.live if st.scope == "rank"] + ([job] if job is not None else [])
    layers: dict[str, list[float]] = {}
    kinds: dict[str, list[float]] = {}
    for st in measured:
        for layer, bound in st.logits.items():
            layers.setdefault(layer, []).append(bound)
        for kind, h in st.headroom.items():
            kinds.setdefault(kind, []).append(h)
    for layer, bounds in layers.items():
        f.add(m.ATTENTION_LOGIT_MAX, [run_id, layer], _max(bounds))
    for kind, hs in kinds.items():
        f.add(m.TENSOR_HEADROOM_RATIO, [run_id, kind], _max(hs))
    for stat, combine in _RLHF.items():
        values = [v for st in measured if st.rlhf is not None and (v := getattr(st.rlhf, stat)) is not None]
        if values:
            f.add(m.RLHF_STAT, [run_id, stat], combine(values))
    rollout, distrusted, clamped = combine_rollout(measured_views(run.live, run.job))
    notes["rollout_distrusted"] += distrusted
    notes["count_clamped"] += clamped
    for stat in ROLLOUT_STATS if rollout is not None else ():
        value = getattr(rollout, stat)
        if value is not None:
            f.add(m.ROLLOUT_MISMATCH, [run_id, stat], value)
    _moe(f, run_id, [st.moe for st in measured if st.moe is not None] if job is None or job.moe is None
         else [job.moe])


def _figures(f: _Families, run: RunSnapshot) -> None:
    """The table's report gauges (``MetricSpec.path``: the loss scale, the MoE rerouted fraction...), each
    combined over the live views by its entry (``nanwatch.monitor.data.report_figures``)."""
    for spec in report_figures.GAUGE_FIGURES:
        value = report_figures.combined(spec, run.live, run.job)
        if value is not None:
            f.add(spec, [run.run_id], value)


def _moe(f: _Families, run_id: str, stats: list[MoeStat]) -> None:
    """The MoE routers of the latest step: the job's, or the live ranks' merged exactly (``MoeStat.merged``)."""
    moe = MoeStat.merged(stats)
    if moe is None:
        return
    for r in moe.routers:
        if r.load_max is not None:
            f.add(m.MOE_EXPERT_LOAD_MAX, [run_id, r.router], r.load_max)
        if r.logit_max is not None:
            f.add(m.MOE_ROUTER_LOGIT_MAX, [run_id, r.router], r.logit_max)
        if r.disagreement is not None:
            f.add(m.MOE_ROUTING_DISAGREEMENT, [run_id, r.router], r.disagreement)
    if moe.rerouted_fraction is not None and moe.routing_replay != "off":
        f.add(m.MOE_REPLAY_NOT_APPLIED, [run_id], 1.0 if moe.tokens_rerouted else 0.0)


def _run_counters(f: _Families, run: RunSnapshot) -> None:
    """The run's counters: its train-stage non-finite values always (at 0 before any), the other stages
    once seen, and the families exported as stored."""
    run_id = run.run_id
    for pass_, kind in _PASSES:
        labels = (pass_, kind, "train")
        f.add(m.RUN_NONFINITE_CALLS, [run_id, *labels], _value(run, m.RUN_NONFINITE_CALLS, labels))
    for fam, labels in run.counters:
        spec = _AS_STORED.get(fam)
        if fam == m.NOT_REPRODUCIBLE_INCIDENTS.key:  # a host is its run's namespace's (#27): never another team's
            f.add(m.NOT_REPRODUCIBLE_INCIDENTS, [run_id, run.namespace, *labels],
                  _value(run, m.NOT_REPRODUCIBLE_INCIDENTS, labels))
        elif spec is not None:
            f.add(spec, [run_id, *labels], _value(run, m.FAMILIES[fam], labels))
        elif fam == m.RUN_NONFINITE_CALLS.key and labels[2] != "train":
            f.add(m.RUN_NONFINITE_CALLS, [run_id, *labels], _value(run, m.RUN_NONFINITE_CALLS, labels))


def _collector_own(f: _Families, snap: Snapshot, notes: Counter[str]) -> None:
    """The collector's own figures: its directive rules' tau, the reports it applied and ignored, what it refused, what
    its renders had to leave out or distrust (those before, and this render's)."""
    before = snap.render_errors or {}
    for reason in RENDER_ERRORS:
        f.add(m.RENDER_ERRORS, [reason], before.get(reason, 0) + notes[reason])
    f.add(m.COLLECTOR_LOGIT_TAU, [], snap.tau)
    f.add(m.REPORTS_ACCEPTED, [], snap.accepted)
    f.add(m.REPORTS_DUPLICATE, [], snap.duplicates)
    for reason, n in snap.rejected.items():
        f.add(m.REQUESTS_REJECTED, [reason], n)
    for cap, n in snap.caps_hit.items():
        f.add(m.CAPS_HIT, [cap], n)


class _SnapshotMetrics(Collector):
    """One scrape's metric families, built fresh from a ``Snapshot`` (prometheus_client's ``Collector``
    protocol: ``describe`` and ``collect``, registered in a registry made for this render). A run whose
    series cannot be built is left out, its partial series removed, and named in ``left_out``."""

    def __init__(self, snap: Snapshot) -> None:
        self._snap = snap
        #: this render's notes (``RENDER_ERRORS``), and the runs it left out with the exception's type
        self.notes: Counter[str] = Counter()
        self.left_out: dict[str, str] = {}

    def describe(self) -> Iterator[Metric]:
        # Families are dynamic; describing them empty keeps registration from calling collect().
        for name in METRICS:
            yield family(name)

    def collect(self) -> Iterator[Metric]:
        f = _Families()
        self.notes, self.left_out = Counter(), {}
        for run in self._snap.runs:
            try:
                _run_series(f, run, self.notes)
            except Exception as e:  # noqa: BLE001 - one run's figures never take the page down
                for fam in f.values():  # its samples are the last ones, each labelled with its run_id
                    while fam.samples and fam.samples[-1].labels.get("run_id") == run.run_id:
                        fam.samples.pop()
                self.left_out[run.run_id] = type(e).__name__
                self.notes["run_left_out"] += 1
        _collector_own(f, self._snap, self.notes)
        yield from f.values()


def _run_series(f: _Families, run: RunSnapshot, notes: Counter[str]) -> None:
    """Every series of one run."""
    _lifecycle(f, run)
    if run.live is None:  # no live rank: only the run's totals
        return
    _where(f, run)
    _run_gauges(f, run)
    _figures(f, run)
    _per_rank(f, run)
    _measured(f, run, notes)
    _run_counters(f, run)


#: prometheus_client's process and platform collectors (``process_resident_memory_bytes``,
#: ``process_open_fds``, ``process_max_fds``, ``process_cpu_seconds_total``, ``python_info``):
#: made once, registered in each render's registry beside the snapshot.
_PROCESS = (ProcessCollector(registry=None), PlatformCollector(registry=None))

#: The formats a scrape can get, by name: prometheus_client's text 0.0.4 and OpenMetrics 1.0.0 encoders.
#: Every ``Accept`` header is negotiated down to one of them (``negotiate``), so that the render cache has at
#: most these keys, each gzipped or not, whatever versions and escapings scrapers ask for (issue #19.5: a
#: cache keyed by the raw ``version=`` let 40 scrapers force 40 renders an interval). Every metric name here
#: is a legacy Prometheus name, so an escaping scheme would change nothing.
FORMATS = {"text": (generate_latest, CONTENT_TYPE_PLAIN_0_0_4),
           "openmetrics": choose_encoder("application/openmetrics-text; version=1.0.0")}


def negotiate(accept: str) -> str:
    """The format (a ``FORMATS`` key) to answer ``accept`` with: OpenMetrics 1.0.0 when prometheus_client would
    answer in any OpenMetrics version, else text 0.0.4."""
    return "openmetrics" if choose_encoder(accept)[1].startswith("application/openmetrics-text") else "text"


def render(snap: Snapshot, fmt: str, *, into: _SnapshotMetrics | None = None) -> tuple[bytes, str]:
    """The exposition of ``snap`` in format ``fmt`` (prometheus_client's encoders), and its content type.
    ``into``: the snapshot's collector, to read what the render left out afterwards."""
    encoder, content_type = FORMATS[fmt]
    registry = CollectorRegistry(auto_describe=True)
    registry.register(into if into is not None else _SnapshotMetrics(snap))
    for own in _PROCESS:  # the collector's own health: memory and fds against its pod's limits, CPU
        registry.register(own)
    return encoder(registry), content_type


class _Output(NamedTuple):
    """One render's bodies by (format, gzipped), its notes (``RENDER_ERRORS``) and the runs it left out."""

    bodies: dict[tuple[str, bool], tuple[bytes, str]]
    notes: Counter[str]
    left_out: dict[str, str]


def _render_all(snap: Snapshot, wanted: frozenset[tuple[str, bool]]) -> _Output:
    """Every (format, gzipped) in ``wanted`` from one snapshot: each format encoded once, gzip on top (the
    notes are one encoding's: each format builds the same families)."""
    plain, notes, left_out = {}, Counter(), {}
    for fmt in {fmt for fmt, _ in wanted}:
        metrics = _SnapshotMetrics(snap)
        plain[fmt] = render(snap, fmt, into=metrics)
        notes, left_out = metrics.notes, metrics.left_out
    bodies = {(fmt, gz): (gzip.compress(plain[fmt][0]) if gz else plain[fmt][0], plain[fmt][1])
              for fmt, gz in wanted}
    return _Output(bodies, notes, left_out)


@dataclass(frozen=True, slots=True)
class _Rendered:
    version: tuple
    body: bytes
    content_type: str
    until: float = math.inf
    """Monotonic time after which the render is stale even without a write (a rank turns late)."""


@dataclass(slots=True)
class _Round:
    """One render: a snapshot and the (format, gzipped) pairs its scrapers asked for before it was taken."""

    wanted: set[tuple[str, bool]]
    done: asyncio.Future


class MetricsRenderer:
    """Renders ``/metrics`` off the event loop, one render at a time and at most one every
    ``min_interval_s``. A scrape gets the last render if nothing changed since it began; otherwise the
    next render, which takes its snapshot after the scrape arrived, so every scrape sees what was
    acknowledged before it. One render serves every format asked for before its snapshot, so scrapers,
    however many, however fast and in whatever formats, cost at most one snapshot per interval and wait
    at most about one interval; they wait for it rather than taking the CPU that ingest needs (a scrape
    answered at once from a cache would let a few scrape loops spin the collector at thousands of requests
    a second)."""

    def __init__(self, state: CollectorState, directive_log: DirectiveLog, exposure: Exposure, *, logit_tau: float,
                 min_interval_s: float = 3.0, late_s: float = 90.0,
                 on_left_out: Callable[[dict[str, str]], object] | None = None,
                 on_rendered: Callable[[Snapshot], object] | None = None) -> None:
        self._state, self._directive_log, self._tau, self._late_s = state, directive_log, logit_tau, late_s
        self._exposure = exposure
        #: called on the event loop with each render's snapshot once its scrapers have it (replicas record
        #: what each export showed: ``data.tenures``); after, not before: should the replica die between
        #: the two, the next exporter counts the last scrape's increments twice rather than lose them
        self._on_rendered = on_rendered
        #: called on the event loop with {run_id: exception type} after a render left runs out (an event each)
        self._on_left_out = on_left_out
        self._min_interval_s = min_interval_s
        self._lock = asyncio.Lock()
        self._next: _Round | None = None
        self._last: dict[tuple[str, bool], _Rendered] = {}
        self._last_start = -math.inf

    async def render(self, accept: str, gzipped: bool) -> tuple[bytes, str]:
        key = (negotiate(accept), gzipped)
        last = self._last.get(key)
        if last is not None and last.version == views.version(self._state) and time.monotonic() < last.until:
            return last.body, last.content_type
        rnd = self._next
        if rnd is None:
            rnd = self._next = _Round(set(), asyncio.get_running_loop().create_future())
            asyncio.ensure_future(self._run(rnd))
        rnd.wanted.add(key)
        return (await asyncio.shield(rnd.done))[key]  # a scraper that goes away does not cancel the others'

    async def _run(self, rnd: _Round) -> None:
        async with self._lock:
            wait = self._last_start + self._min_interval_s - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            if self._next is rnd:
                self._next = None  # from now on, new scrapes wait for the next render
            try:
                started, version = time.monotonic(), views.version(self._state)
                runs = await snapshot_runs(self._state, self._directive_log, self._exposure, late_s=self._late_s)
                snap = snapshot(self._state, self._directive_log, self._exposure, logit_tau=self._tau,
                                late_s=self._late_s, runs=runs)
                self._last_start = started
                out = await asyncio.to_thread(_render_all, snap, frozenset(rnd.wanted))
                for key, (body, content_type) in out.bodies.items():
                    self._last[key] = _Rendered(version, body, content_type, snap.until)
                self._exposure.rendered(self._state, out.notes)
                rnd.done.set_result(out.bodies)
                if out.left_out:
                    self._left_out(out.left_out)
                if self._on_rendered is not None:
                    await asyncio.sleep(0)  # the waiting scrapers' responses go out first
                    self._rendered(snap)
            except Exception as e:  # noqa: BLE001 - handed to every scraper waiting on it
                rnd.done.set_exception(e)

    def on_rendered(self, call: Callable[[Snapshot], object]) -> None:
        """Call ``call`` with each render's snapshot, once its scrapers have the render (replicas record
        what each export showed: ``data.tenures``)."""
        self._on_rendered = call

    def _rendered(self, snap: Snapshot) -> None:
        try:
            self._on_rendered(snap)  # type: ignore[misc]
        except Exception:  # noqa: BLE001 - the render was served; its record is best effort
            log.exception("nanwatch collector: could not record what the render exported")

    def _left_out(self, runs: dict[str, str]) -> None:
        log.warning("nanwatch collector: %d runs left out of /metrics, their figures could not be rendered: %s",
                    len(runs), ", ".join(f"{r} ({e})" for r, e in list(runs.items())[:8]))
        if self._on_left_out is not None:
            try:
                self._on_left_out(runs)
            except Exception:  # noqa: BLE001 - the render was served; its event is best effort
                log.exception("nanwatch collector: could not record the left-out runs' events")
