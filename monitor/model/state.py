"""The collector's in-memory state: latest view per (run_id, rank), counter totals, and what a scrape or
``GET /v1/runs`` needs. Only the event-loop thread touches it (one uvicorn worker), so it takes no lock.

Counters are kept whole (not per TTL window): a rank that goes silent loses its series from the scrape
but keeps its total, so if it comes back its counter resumes instead of resetting.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from nanwatch.monitor.model.auth import ANY_NAMESPACE
from nanwatch.monitor.model.counters import (
    ENDED_FAMILY,
    FAMILIES,
    NOT_REPRODUCIBLE,
    RUN_NONFINITE,
    SDPA,
    RequestCounters,
)
from nanwatch.monitor.model.store import EventRow, Loaded
from nanwatch.policy import next_apply_step
from nanwatch.wire import MAX_INT, RlhfStat

__all__ = ["CRASH_KEY", "LATEST_SPIKES", "MAX_AGREE_EVERY", "MAX_HEARTBEAT_S", "MAX_WORLD_SIZE", "RANK_SERIES", "RUN_LEVEL_SCOPES",
           "STEP_SLACK", "Applied", "CollectorState", "Crash", "HostCaps", "NamespaceEvents", "RankState", "RunState", "Silent",
           "crash_key", "world_size"]

#: steps a rank's report may run ahead of the run's other live ranks (or of its own previous report) and still
#: be believed: ranks of one job report their own steps asynchronously, a few steps apart (#19)
STEP_SLACK = 8
#: the longest agreement cadence (``agree_every``) the collector believes; a larger one is a lie that would
#: push ``apply_at_step`` out of reach (the trainer's default is 4)
MAX_AGREE_EVERY = 10_000
#: the longest heartbeat interval the collector believes (an hour): a rank announcing more is held live for
#: three of these at most, never days (one heartbeat with 86,400 s kept a dead rank "live" for three days)
MAX_HEARTBEAT_S = 3600.0
#: the largest world size the collector believes (2^20 ranks, sixteen times the incarnation cap's default);
#: a report announcing more counts as this many
MAX_WORLD_SIZE = 1 << 20
#: series one rank adds: nonfinite {forward,backward}x{nan,inf}, mode, last report, dropped, skipped
RANK_SERIES = 8
#: report scopes whose measurements are the run's: a job report, or one rank's own in per-rank mode
RUN_LEVEL_SCOPES = frozenset({"rank", "job"})


@dataclass(slots=True)
class RankState:
    """A live rank's latest report, summarised. Fields keep the wire's names (``StepReport``), which are
    also the API's (``RankView``, built from this by attribute)."""

    rank: int
    incarnation: str
    seq: int
    scope: str
    """``rank`` or ``detail``: the rank's own measurements (it has per-rank series); ``heartbeat``: known only
    through heartbeats (and, for the rank that posts them, job reports): liveness alone; ``job``: the
    run's job view (``RunState.job``), never in ``RunState.ranks``. The wire's scopes (``StepReport.scope``)."""
    step: int
    time: float
    received: float
    seen: float
    world_size: int = 1
    agree_every: int | None = None
    attention_mode: str = "none"
    directive_version: int = 0
    dropped_reports: int = 0
    nonfinite: int = 0
    first_offender: str | None = None
    first_offender_phase: str | None = None
    headroom: dict[str, float] = field(default_factory=dict)
    logits: dict[str, float] = field(default_factory=dict)
    """The latest step's logit bound per layer (the wire's ``logits``, admitted under the series cap)."""
    rlhf: RlhfStat | None = None
    heartbeat_seq: int = -1
    """The seq of the rank's last heartbeat: heartbeats carry no counts, so they are not kept in the
    store's high-water marks; a resent one (seq not above this) is acknowledged and ignored."""
    crashed: str | None = None
    """The exception type the rank's step raised (wire 1.5 ``raised``): the rank crashed, and it is no longer
    counted live. None while it runs."""
    loss_scale: float | None = None
    """The rank's GradScaler scale after its latest step (wire 1.6), None without dynamic loss scaling; a
    heartbeat never changes it (liveness only)."""
    heartbeat_s: float = 0.0
    """The heartbeat interval this rank announced (wire 1.4 ``heartbeat_s``, at most ``MAX_HEARTBEAT_S``); 0:
    none."""

    @property
    def logit_max(self) -> float | None:
        """The largest logit bound over the rank's layers in its latest step (None: none reported)."""
        return max(self.logits.values(), default=None)


class Applied(NamedTuple):
    """Rank 0 of ``incarnation`` reported the mode of directive ``version`` applied (``RunState.applied``);
    ``step``: its latest report's step since, what the run has reached in its own words."""

    version: int
    incarnation: str
    step: int


class Crash(NamedTuple):
    """A rank's step raised (``RunState.crashed``)."""

    raised: str
    incarnation: str
    step: int


#: steps remembered per run to count a loss-scale overflow once per step, whichever ranks report it
_OVERFLOW_STEPS = 64
#: keys ``RunState.count_once`` remembers (a resend is refused by its high-water mark; this dedupes ranks)
_COUNTED_ONCE = 1_024
#: the spikes of the latest report kept for ``nanwatch status``
LATEST_SPIKES = 8


class Silent(NamedTuple):
    """A rank that stopped reporting without a final report and without crashing (hung, or killed): its
    last report time stays exported after its TTL (``RunState.silent``)."""

    received: float
    seen: float
    incarnation: str = ""
    """The incarnation that went silent: only a final report of it ends the rank (#37 finding 6)."""


#: event-key prefix of a rank's crash (``rank_crashed:<rank>:<incarnation>:<raised>``): read back at start-up
CRASH_KEY = "rank_crashed"


def crash_key(rank: int, incarnation: str, raised: str) -> str:
    return f"{CRASH_KEY}:{rank}:{incarnation}:{raised}"


@dataclass(slots=True)
class RunState:
    run_id: str
    ranks: dict[int, RankState] = field(default_factory=dict)
    """Live ranks' views, in the order they last reported (``hold``): the silent ones come first, so a scrape
    finds the late ones and the sweep the expired ones without walking a 65,536-rank job."""
    shown: set[int] = field(default_factory=set)
    """Ranks with per-rank series of their own: their own reports (rank, detail), the job's poster, or a
    heartbeat that differs from the job (another mode, dropped reports)."""
    worlds: Counter[int] = field(default_factory=Counter)
    """World sizes the held ranks' latest reports give, counted (``CollectorState.world_size`` picks)."""
    #: the latest job report's view (wire 1.4 ``scope="job"``): the run-level gauges of job mode
    job: RankState | None = None
    job_poster: int | None = None
    """The rank that posts the run's job reports: the first job report's, or rank 0 once it posts one. No
    other rank may post ``scope="job"`` (in memory: after a restart of the collector, the next job report's)."""
    latest_step: int = 0
    intervals: Counter[float] = field(default_factory=Counter)
    """The heartbeat intervals the held ranks announce, counted (each rank's own, at most ``MAX_HEARTBEAT_S``)."""
    heartbeat_s: float = 0.0
    """The run's heartbeat interval: the lower median of what its held ranks announce (``intervals``), so one rank
    cannot raise it (a 65,536-rank job beats every 655 s by default, so as not to cost a collector 2,000
    requests a second): a rank known by its heartbeats is late only after two of them and gone after three."""
    counters: dict[tuple[str, tuple], int] = field(default_factory=dict)
    """Counter totals, exact Python ints (they never saturate; the scrape shows them as float64)."""
    admitted: set[tuple] = field(default_factory=set)
    series: int = 0
    series_dropped: int = 0
    last_seen: float = -math.inf
    #: the run's ``first_nonfinite`` event (the wire's ``first_offender`` is a site name; this is the event)
    first_offender_event: EventRow | None = None
    event_keys: set[str] = field(default_factory=set)
    event_counts: Counter[str] = field(default_factory=Counter)
    #: (rank, incarnation) high-water marks the run holds
    incarnations: int = 0
    #: monotonic time of the run's last write (report, directive, event): retention counts from it
    touched: float = field(default_factory=time.monotonic)
    crashed: dict[int, Crash] = field(default_factory=dict)
    """Ranks whose step raised, by rank: kept after their views expire (the run ends crashed) until the rank
    reports again from a new incarnation (it was restarted)."""

    newborn: set[tuple[str, tuple]] = field(default_factory=set)
    """Counter keys born in this process since the last render (never stored before, nor exposed at 0 by
    default): the next render shows them at 0, the one after at their value, so increase() sees the birth."""
    exposed: bool = False
    """The run's default series (the train stage's run non-finite counters, rendered at 0 when absent) have
    been rendered: a key born there later was already seen at 0. Runs read back at start count as exposed."""
    exposed_ranks: set[int] = field(default_factory=set)
    """Ranks whose per-rank counter series have been rendered (at 0 where absent) in this process."""
    latest_offenders: dict[str, tuple[str, str, str]] = field(default_factory=dict)
    """By stage: (site, pass, rank) of the first offender of the run's most recent non-finite report in
    that stage (loss-scale overflows excepted): this incident's offender, not the run's first."""
    latest_incidents: dict[str, tuple[str, str, str]] = field(default_factory=dict)
    """By incident class: (host, rank, capsule) of the run's latest incident of that class (in memory, as the
    latest offenders; ``nanwatch_latest_incident_info``): where its capsule lies, for the dashboard."""
    math_fallback: tuple[str, str, str] | None = None
    """(site, dtype, rank) of the latest training SDPA call that ran on the math backend in half precision."""
    counted_once: dict[tuple, None] = field(default_factory=dict)
    """Recent (what, step, ...) keys counted once per step (insertion order, bounded): ``count_once``."""
    latest_spikes: tuple[int, int, tuple[Any, ...]] | None = None
    """(step, rank, spikes) of the run's latest run-level report with spikes (wire 1.9 ``Spike``, the first
    ``LATEST_SPIKES``, largest factor first), in memory: what ``nanwatch status`` shows."""
    overflow_steps: dict[int, None] = field(default_factory=dict)
    """Recent steps whose loss-scale overflow was counted (insertion order, bounded): one count per step."""
    ended_ranks: dict[int, str] = field(default_factory=dict)
    """Ranks that sent a final report, with the incarnation that ended: no longer live nor late."""
    ended_views: dict[int, RankState] = field(default_factory=dict)
    """The last training view of each ended rank, for the API (``GET /v1/runs/{id}``) only: what the rank
    looked like when it ended; no metric is made from it. In memory (one per rank)."""
    ended: bool = False
    """Every rank the run held ended normally (none held, hung or crashed): ``nanwatch_run_ended``."""
    applied: Applied | None = None
    """Which incarnation of rank 0 applied the current revertible directive, and how far it has reached
    since: only that incarnation can end the directive by its auto-revert (``RuleEngine``). In memory."""
    silent: dict[int, Silent] = field(default_factory=dict)
    """Ranks gone past their TTL without a final report or a crash: their last report time stays exported
    for ``NANWATCH_SILENT_KEEP_S`` or until they report again, so a hung rank keeps alerting."""
    weight_lag: dict[str, int] = field(default_factory=dict)
    """Each rollout worker's weight-sync lag in versions (0: none), written with the weight syncs
    (``nanwatch.monitor.write.weight_compare``): ``nanwatch_weight_sync_lag_versions``. In memory."""

    def count_once(self, key: tuple) -> bool:
        """Whether ``key`` (a spike's or a replica divergence's step, and what it is of) is seen for the first
        time lately: the ranks of one job may each report the same step, which counts once."""
        if key in self.counted_once:
            return False
        self.counted_once[key] = None
        if len(self.counted_once) > _COUNTED_ONCE:
            del self.counted_once[next(iter(self.counted_once))]
        return True

    def count_overflow(self, step: int) -> bool:
        """Whether a loss-scale overflow at ``step`` is the step's first (ranks of one job report the same
        step: it counts once)."""
        if step in self.overflow_steps:
            return False
        self.overflow_steps[step] = None
        if len(self.overflow_steps) > _OVERFLOW_STEPS:
            del self.overflow_steps[next(iter(self.overflow_steps))]
        return True

    def end_rank(self, rank: int, incarnation: str) -> None:
        """The rank's incarnation sent its final report: its view and series go now."""
        self.ended_ranks[rank] = incarnation
        if rank in self.ranks:
            self.ended_views[rank] = self.ranks[rank]
            self.drop(rank)
        self.silent.pop(rank, None)
        if self.job is not None and self.job.rank == rank:
            self.job = None

    def incarnation_of(self, rank: int) -> str | None:
        """The rank's current incarnation as the run knows it (held live or crashed, crashed after its view went,
        hung), None for a rank it holds nothing of or that ended: only a final report carrying it may end the
        rank (#37 finding 6: a blind final cleared a crash and muted NanwatchRunCrashed)."""
        held = self.ranks.get(rank)
        if held is not None:
            return held.incarnation
        crash = self.crashed.get(rank)
        if crash is not None:
            return crash.incarnation
        silent = self.silent.get(rank)
        return silent.incarnation or None if silent is not None else None

    def all_ended(self) -> bool:
        """Every rank the run holds ended normally: none held (live or not yet swept), hung or crashed."""
        return bool(self.ended_ranks) and not self.ranks and not self.silent and not self.crashed

    def note_crash(self, rank: int, incarnation: str, raised: str | None, step: int) -> None:
        """What a report says of its rank's lifecycle: ``raised`` marks it crashed; any report of another
        incarnation (a restart) clears a crash."""
        if raised is not None:
            self.crashed[rank] = Crash(raised, incarnation, step)
        elif rank in self.crashed and self.crashed[rank].incarnation != incarnation:
            del self.crashed[rank]

    def hold(self, st: RankState, *, shown: bool) -> None:
        """``st`` is the rank's latest view: moved to the end of ``ranks`` (the most recent)."""
        prev = self.ranks.pop(st.rank, None)
        if prev is not None:
            self._unworld(prev)
        self.ranks[st.rank] = st
        self.silent.pop(st.rank, None)
        self.worlds[st.world_size] += 1
        if st.heartbeat_s:
            self.intervals[st.heartbeat_s] += 1
        if st.heartbeat_s != (prev.heartbeat_s if prev is not None else 0.0):
            self._recount_interval()
        (self.shown.add if shown else self.shown.discard)(st.rank)

    def drop(self, rank: int) -> None:
        st = self.ranks.pop(rank)
        self._unworld(st)
        if st.heartbeat_s:
            self._recount_interval()
        self.shown.discard(rank)

    def _unworld(self, st: RankState) -> None:
        for counted, value in ((self.worlds, st.world_size), (self.intervals, st.heartbeat_s)):
            if counted is self.intervals and not value:
                continue
            counted[value] -= 1
            if not counted[value]:
                del counted[value]

    def _recount_interval(self) -> None:
        """The run's heartbeat interval: the lower median of the held ranks' announced ones (0: none)."""
        n = sum(self.intervals.values())
        if not n:
            self.heartbeat_s = 0.0
            return
        at = (n - 1) // 2
        for value in sorted(self.intervals):
            at -= self.intervals[value]
            if at < 0:
                self.heartbeat_s = value
                return

    def admit(self, key: tuple, cost: int, cap: int) -> bool:
        """Whether the series behind ``key`` may exist; new keys beyond the cap are dropped and counted."""
        if key in self.admitted:
            return True
        if self.series + cost > cap:
            self.series_dropped += cost
            return False
        self.admitted.add(key)
        self.series += cost
        return True


class HostCaps:
    """The host labels a run and a run-id namespace may name (#27 finding 16: 60,000 made-up hosts in one
    run were 49,987 series). A host is a label of ``nanwatch_not_reproducible_incidents_total`` alone; a new
    one beyond ``per_run`` hosts in its run, or ``per_namespace`` in its namespace, is not counted (caps hit
    ``hosts_per_run`` / ``hosts_per_namespace``). ``namespace_of``: the run-id namespace of a run
    (``TokenTable.namespace_of``); the exporter labels each host series with it, so that one team's reports
    never count on another team's host."""

    def __init__(self, *, per_run: int = 1_024, per_namespace: int = 8_192,
                 namespace_of: Callable[[str], str] = lambda _run_id: ANY_NAMESPACE) -> None:
        self.per_run, self.per_namespace, self.namespace_of = per_run, per_namespace, namespace_of
        #: hosts by namespace (may hold hosts of forgotten runs: rebuilt before one is refused)
        self._by_namespace: dict[str, set[str]] | None = None

    @staticmethod
    def _hosts(run: RunState) -> set[str]:
        return {labels[0] for fam, labels in run.counters if fam == NOT_REPRODUCIBLE.key}

    def _rebuild(self, runs: dict[str, RunState]) -> dict[str, set[str]]:
        by_ns: dict[str, set[str]] = {}
        for run_id, run in runs.items():
            by_ns.setdefault(self.namespace_of(run_id), set()).update(self._hosts(run))
        self._by_namespace = by_ns
        return by_ns

    def admit(self, runs: dict[str, RunState], run: RunState, host: str, caps_hit: Counter[str]) -> bool:
        """Whether ``run`` may count a not-reproducible incident on ``host`` (a host it already counts: yes)."""
        if (NOT_REPRODUCIBLE.key, (host,)) in run.counters:
            return True
        if len(self._hosts(run)) >= self.per_run:
            caps_hit["hosts_per_run"] += 1
            return False
        ns = self.namespace_of(run.run_id)
        by_ns = self._by_namespace if self._by_namespace is not None else self._rebuild(runs)
        hosts = by_ns.setdefault(ns, set())
        if host not in hosts and len(hosts) >= self.per_namespace:
            hosts = self._rebuild(runs).setdefault(ns, set())  # forgotten runs' hosts free their places
            if len(hosts) >= self.per_namespace:
                caps_hit["hosts_per_namespace"] += 1
                return False
        hosts.add(host)
        return True


class NamespaceEvents:
    """The events each run-id namespace's runs hold, against a cap (#37: one team's events never use up the
    collector's total for the others). Counted from the runs' own counts when first asked and after runs went
    (``recount``), then kept by ``stored``."""

    def __init__(self, *, cap: int, namespace_of: Callable[[str], str]) -> None:
        self.cap, self.namespace_of = cap, namespace_of
        self._counted: Counter[str] | None = None

    def full(self, runs: dict[str, RunState], run_id: str) -> bool:
        """Whether the namespace of ``run_id`` holds ``cap`` events."""
        if self._counted is None:
            counted: Counter[str] = Counter()
            for other, run in runs.items():
                counted[self.namespace_of(other)] += sum(run.event_counts.values())
            self._counted = counted
        return self._counted[self.namespace_of(run_id)] >= self.cap

    def stored(self, run_id: str) -> None:
        """One more event is kept for ``run_id``."""
        if self._counted is not None:
            self._counted[self.namespace_of(run_id)] += 1

    def recount(self) -> None:
        self._counted = None


class CollectorState:
    """Runs by id plus the collector's own counters; ``seen`` times are monotonic, ``received`` wall."""

    def __init__(self, *, ttl_s: float, series_cap: int, loaded: Loaded | None = None, max_runs: int = 10_000,
                 max_incarnations: int = 65_536, max_events: int = 10_000, silent_keep_s: float = 86_400.0,
                 hosts: HostCaps | None = None, max_incarnations_per_namespace: int = 262_144,
                 max_events_per_namespace: int = 250_000) -> None:
        self.ttl_s = ttl_s
        self.silent_keep_s = silent_keep_s
        self.series_cap = series_cap
        #: the caps a request is checked against (``nanwatch.monitor.model.caps``)
        self.max_runs = max_runs
        self.max_incarnations = max_incarnations
        self.max_events = max_events
        self.max_incarnations_per_namespace = max_incarnations_per_namespace
        self.runs: dict[str, RunState] = {}
        self.hwm: dict[tuple[str, int, str], int] = {}
        #: reports applied and requests refused (written by the ledger and the refusal handler alone)
        self.requests = RequestCounters()
        #: caps that were hit, by cap (runs, incarnations, events): what was refused or not recorded
        self.caps_hit: Counter[str] = Counter()
        #: what /metrics renders left out or distrusted, by reason (``exporter.RENDER_ERRORS``; the renderer's)
        self.render_errors: Counter[str] = Counter()
        #: collector-level counter series already rendered (("rejected", reason), ("caps", cap),
        #: ("series_dropped", run_id)): one not in here is shown at 0 in its first render (born at zero)
        self.exposed: set[tuple[str, str]] = set()
        #: the host-label caps and each run's namespace (``HostCaps``)
        self.hosts = hosts if hosts is not None else HostCaps()
        #: events each namespace's runs hold, against ``max_events_per_namespace``
        self.namespace_events = NamespaceEvents(cap=max_events_per_namespace, namespace_of=self.hosts.namespace_of)
        #: the runs whose series this collector shows: None, every live run (one collector); a set, only
        #: these (replicas on a shared PostgreSQL database: the runs whose lease this one holds,
        #: ``nanwatch.monitor.pg.leases``); any other run shows as if not live
        self.exported_runs: set[str] | None = None
        self._writes = 0
        if loaded is not None:
            _restore(self, loaded)

    def reload(self, loaded: Loaded, *, touched: set[str], marks: set[tuple[str, int, str]] | None = None,
               keep_views: bool = False) -> None:
        """Take the store's view of the runs a failed write ``touched`` (``loaded`` holds those runs alone),
        when memory may hold changes the database does not: they lose their per-rank latest views (they come
        back with the next reports); every other run is left as it is, since the write did not change it.
        ``marks``: the only high-water marks the write may have added (else every mark of the touched runs
        is looked for, a walk over all of memory's marks). ``keep_views``: the runs were re-read because
        another collector replica wrote them (a shared database), not after a failed write of this one: their
        per-rank views, this replica's own and all committed, stay (``_VIEWS``)."""
        kept = {r: self.runs[r] for r in touched if r in self.runs} if keep_views else {}
        for run_id in touched:
            self.runs.pop(run_id, None)
        self.namespace_events.recount()
        if marks is None:
            self.hwm = {k: v for k, v in self.hwm.items() if k[0] not in touched}
        else:  # the touched runs' other marks are the store's, and ``loaded`` puts them back as stored
            for key in marks:
                self.hwm.pop(key, None)
        _restore(self, loaded)
        for run_id, old in kept.items():
            run = self.runs.get(run_id)
            if run is not None:  # (a run another replica deleted stays deleted)
                for name in _VIEWS:
                    setattr(run, name, getattr(old, name))

    def wrote(self) -> None:
        """Something a scrape shows changed (a committed write, ranks or runs gone)."""
        self._writes += 1

    def version(self) -> tuple:
        """Changes whenever anything a scrape shows may have: a cached render is reused only while equal."""
        return (self._writes, *self.requests.version(), sum(self.caps_hit.values()))

    def ensure_run(self, run_id: str) -> RunState:
        """The run's state, created empty if the run is new (write paths only: ingest, events)."""
        run = self.runs.get(run_id)
        if run is None:
            run = self.runs[run_id] = RunState(run_id)
        return run

    def forget_incarnations(self, keys: list[tuple[str, int, str]]) -> None:
        """Drop these high-water marks from memory (after the store's were deleted): ``Caps.stale``."""
        for key in keys:
            if self.hwm.pop(key, None) is not None:
                self.runs[key[0]].incarnations -= 1

    def next_apply_step(self, run_id: str, now: float) -> int:
        """The earliest step every rank can apply a directive at, from the live ranks the run can vouch for
        (steps count per incarnation: a restarted job counts from 0 again, and a rank that went silent
        does not hold the step up): the next step for one rank; under torch.distributed the next agreement
        step (ranks agree every ``agree_every`` steps and switch together there).

        One report must not push it out of reach (#19): the step and cadence are those of ``vouched_view``,
        and a cadence beyond ``MAX_AGREE_EVERY`` is not believed (the next step is asked for instead). Too
        early is harmless -- a trainer applies a directive at the first step >= ``apply_at_step`` once its
        ranks have agreed on it -- too late is not."""
        run = self.runs.get(run_id)
        view = self.vouched_view(run, now) if run is not None else None
        if view is None:
            return next_apply_step(0, world_size=1, agree_every=None)
        every = view.agree_every if view.agree_every is not None and view.agree_every <= MAX_AGREE_EVERY else None
        return min(next_apply_step(view.step, world_size=view.world_size, agree_every=every), MAX_INT)

    def vouched_view(self, run: RunState, now: float) -> RankState | None:
        """The live rank whose step the run can vouch for: rank 0 (whose agreement every rank follows) unless
        its step runs more than ``STEP_SLACK`` ahead of every other live rank's; else the live rank of the
        lower median step, which one lying rank among honest ones cannot move up. None with no live rank."""
        live = self.live_ranks(run, now)
        if not live:
            return None
        zero = next((st for st in live if st.rank == 0), None)
        others = [st.step for st in live if st.rank != 0]
        if zero is not None and (not others or zero.step <= max(others) + STEP_SLACK):
            return zero
        live.sort(key=lambda st: st.step)
        return live[(len(live) - 1) // 2]

    def ttl(self, run: RunState) -> float:
        """How long a rank of ``run`` stays live after its last report: the TTL, or three heartbeats."""
        return max(self.ttl_s, 3 * run.heartbeat_s)

    @staticmethod
    def late_after(run: RunState, late_s: float) -> float:
        """How long a heartbeat-only rank of ``run`` may be silent before it is late: ``late_s``, or two
        heartbeats."""
        return max(late_s, 2 * run.heartbeat_s)

    def held_ranks(self, run: RunState, now: float) -> list[RankState]:
        """Ranks whose latest view is within the TTL, crashed ones included (the run view lists them)."""
        horizon = now - self.ttl(run)
        return [st for st in run.ranks.values() if st.seen >= horizon]

    def live_ranks(self, run: RunState, now: float) -> list[RankState]:
        """Ranks that reported within the TTL, crashed ones excepted (a rank whose step raised is not live,
        whatever it sent as it went down)."""
        horizon = now - self.ttl(run)
        return [st for st in run.ranks.values() if st.seen >= horizon and st.crashed is None]

    def ranks_view(self, run: RunState, now: float, late_s: float) -> tuple[int, list[RankState]]:
        """(live ranks, the ranks with per-rank series now: ``shown`` ones and late ones), walking only the
        silent front of ``ranks`` besides the shown ones."""
        horizon, late_before = now - self.ttl(run), now - self.late_after(run, late_s)
        expired, late = 0, []
        for st in run.ranks.values():
            if st.seen >= max(late_before, horizon):  # neither expired nor late, nor any after it
                break
            if st.seen < horizon:  # past its TTL, not swept yet: not live (whether or not it was late first)
                expired += 1
            elif st.seen < late_before and st.rank not in run.shown:
                late.append(st)
        shown = [st for k in run.shown if (st := run.ranks[k]).seen >= horizon]
        crashed = sum(1 for k in run.crashed if (st := run.ranks.get(k)) is not None and st.seen >= horizon
                      and st.crashed is not None)
        return len(run.ranks) - expired - crashed, shown + late

    def hung(self, run: RunState, now: float) -> list[tuple[int, float]]:
        """(rank, last report wall time) of the run's ranks silent past their TTL without a final report or a
        crash: the swept ones (``silent``) and those the sweeper has not reached yet (the silent front)."""
        out = [(k, s.received) for k, s in run.silent.items()]
        horizon = now - self.ttl(run)
        for st in run.ranks.values():
            if st.seen >= horizon:
                break
            if st.crashed is None and st.rank not in run.crashed:
                out.append((st.rank, st.received))
        return out

    def next_late(self, run: RunState, now: float, late_s: float) -> float:
        """Monotonic time at which the run's next heartbeat-only rank turns late (/metrics changes then)."""
        late_s = self.late_after(run, late_s)
        late_before = now - late_s
        for st in run.ranks.values():
            if st.seen >= late_before:
                return st.seen + late_s
        return math.inf

    def live_job(self, run: RunState, now: float) -> RankState | None:
        """The run's latest job report's view, while within the TTL (job mode's run-level gauges)."""
        job = run.job
        return job if job is not None and job.seen >= now - self.ttl_s else None

    def is_live(self, run: RunState, now: float) -> bool:
        return run.last_seen >= now - self.ttl_s

    def sweep(self, now: float) -> int:
        """Forget the latest view of ranks silent past the TTL (totals stay): a rank that neither ended nor
        crashed stays ``silent`` (its last report time exported) for ``silent_keep_s``. Returns how many
        views went."""
        gone = 0
        for run in self.runs.values():
            expired = []
            horizon = now - self.ttl(run)
            for k, st in run.ranks.items():  # in the order they last reported: the silent ones first
                if st.seen >= horizon:
                    break
                expired.append(k)
            for rank in expired:
                st = run.ranks[rank]
                if st.crashed is None and rank not in run.crashed:
                    run.silent[rank] = Silent(st.received, st.seen, st.incarnation)
                run.drop(rank)
            gone += len(expired)
            if run.silent:
                hung = [k for k, s in run.silent.items() if s.seen < now - self.silent_keep_s]
                for rank in hung:
                    del run.silent[rank]
                gone += len(hung)
            if run.job is not None and run.job.seen < now - self.ttl_s:
                run.job = None
                gone += 1
        if gone:
            self.wrote()
        return gone

    def expired(self, now: float, retention_s: float, *, limit: int) -> list[str]:
        """Runs not written to for ``retention_s`` (at most ``limit``, oldest first)."""
        old = [run for run in self.runs.values() if run.touched < now - retention_s]
        old.sort(key=lambda run: run.touched)
        return [run.run_id for run in old[:limit]]

    def forget(self, run_ids: list[str]) -> None:
        """Drop the runs from memory (after their history was deleted from the store)."""
        gone = set(run_ids)
        for run_id in run_ids:
            self.runs.pop(run_id, None)
        self.namespace_events.recount()
        self.hwm = {k: v for k, v in self.hwm.items() if k[0] not in gone}
        self.exposed -= {("series_dropped", run_id) for run_id in run_ids}
        self.wrote()


#: what a run holds that the store does not: the per-rank latest views and what this collector decided from
#: them (``CollectorState.reload(keep_views=True)``)
_VIEWS = ("ranks", "shown", "worlds", "job", "job_poster", "intervals", "heartbeat_s", "last_seen", "newborn",
          "exposed_ranks", "latest_offenders", "latest_incidents", "math_fallback", "counted_once", "latest_spikes",
          "overflow_steps", "ended_ranks", "ended_views", "applied", "silent")


def _restore(state: CollectorState, loaded: Loaded) -> None:
    """Add the runs ``loaded`` holds (absent from memory) as the store has them."""
    if state.hwm:
        state.hwm.update(loaded.hwm)
    else:  # start-up: take the marks as read, not a second copy of them (the peak of a restart)
        state.hwm = loaded.hwm
    for run_id, _rank, _inc in loaded.hwm:
        state.ensure_run(run_id).incarnations += 1
    for run_id, step in loaded.latest_step.items():
        state.ensure_run(run_id).latest_step = step
    for run_id, touched in loaded.touched.items():  # monotonic, from the stored wall time
        state.ensure_run(run_id).touched = touched
    for run_id, fam, labels, value in loaded.counters:
        if fam in (SDPA.key, RUN_NONFINITE.key) and len(labels) == 2:  # stored before their stage label
            labels = (*labels, "train")
        run = state.ensure_run(run_id)
        if fam == ENDED_FAMILY:  # the run's normal end outlives a restart of the collector
            run.ended = value == 1
            continue
        key = (fam, labels)  # a pre-label row and its labelled successor: counters only grow
        run.counters[key] = max(value, run.counters.get(key, value))
        per_rank = fam in FAMILIES and FAMILIES[fam].per_rank
        if per_rank:  # its series were exposed before the restart: shown at once
            run.exposed_ranks.add(int(labels[0]))
        run.admit(("rank", int(labels[0])) if per_rank else (fam, *labels), RANK_SERIES if per_rank else 1,
                  state.series_cap)
    for run_id, keys in loaded.event_keys.items():
        run = state.ensure_run(run_id)
        run.event_keys.update(keys)
        for key in keys:  # a crash outlives a restart of the collector (a restarted rank clears it)
            parts = key.split(":")
            if parts[0] == CRASH_KEY and len(parts) == 4 and parts[1].isdigit():
                run.crashed[int(parts[1])] = Crash(parts[3], parts[2], -1)
    for (run_id, kind), n in loaded.event_counts.items():
        state.ensure_run(run_id).event_counts[kind] = n
    for run_id, ev in loaded.first_offenders.items():
        state.ensure_run(run_id).first_offender_event = ev
    for run_id in loaded.directives:  # every run the store holds is a run in memory
        state.ensure_run(run_id)
    for run_id in loaded.run_ids():  # series read back were exposed before: never born again
        state.ensure_run(run_id).exposed = True


def world_size(state: CollectorState, run: RunState, now: float) -> int:
    """The run's world size: the live job report's (its poster speaks for the job), else rank 0's latest
    view, else the most common one among the held ranks (ties: the smaller). One made-up rank cannot raise
    it beyond what real ranks then correct (a max over ranks could: one heartbeat said 2^53-1)."""
    job = state.live_job(run, now)
    if job is not None:
        return job.world_size
    zero = run.ranks.get(0)
    if zero is not None:
        return zero.world_size
    return min(run.worlds.items(), key=lambda kv: (-kv[1], kv[0]), default=(1, 0))[0]
