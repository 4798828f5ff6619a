"""The collector's in-memory state: latest view per (run_id, rank), counter totals, and what a scrape or
``GET /v1/runs`` needs. Only the event-loop thread touches it (one uvicorn worker), so it takes no lock.

Plain data, so that one look says who changes it: ``nanwatch.monitor.write`` alone (the fold, the ledger,
admission under the caps, retention); the views of it are functions (``nanwatch.monitor.data.liveness`` for
what both sides ask -- which ranks are live --, ``nanwatch.monitor.read.views`` for what a scrape asks).

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

from nanwatch.monitor.data.auth import ANY_NAMESPACE
from nanwatch.monitor.data.store import EventRow
from nanwatch.monitor.data.tenures import Tenures
from nanwatch.wire import MoeStat, RlhfStat

__all__ = ["CRASH_KEY", "LATEST_SPIKES", "MAX_AGREE_EVERY", "MAX_HEARTBEAT_S", "MAX_WORLD_SIZE", "RANK_SERIES",
           "RUN_LEVEL_SCOPES", "STEP_SLACK", "Applied", "CollectorState", "Crash", "HostCaps", "NamespaceEvents",
           "RankState", "RequestCounters", "RunState", "Silent", "crash_key"]

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
class RequestCounters:
    """Totals since the process started (they feed ``nanwatch_collector_*_total``; ``write.requests`` counts)."""

    accepted: int = 0
    """Step reports applied to the state."""
    duplicates: int = 0
    """Step reports already applied (resent by the trainer), acknowledged and ignored."""
    rejected: Counter[str] = field(default_factory=Counter)
    """Requests refused with a 4xx or 503, by reason."""


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
    moe: MoeStat | None = None
    """The latest step's MoE routers (wire 1.16): counts and maxima, merged over views exactly at render."""
    heartbeat_seq: int = -1
    """The seq of the rank's last heartbeat: heartbeats carry no counts, so they are not kept in the
    store's high-water marks; a resent one (seq not above this) is acknowledged and ignored."""
    crashed: str | None = None
    """The exception type the rank's step raised (wire 1.5 ``raised``): the rank crashed, and it is no longer
    counted live. None while it runs."""
    figures: dict[str, float] = field(default_factory=dict)
    """The latest training step's report figures, by wire path (``nanwatch.monitor.data.report_figures``: the
    table's gauges read off the report and their denominators); a heartbeat never changes them (liveness only)."""
    heartbeat_s: float = 0.0
    """The heartbeat interval this rank announced (wire 1.4 ``heartbeat_s``, at most ``MAX_HEARTBEAT_S``); 0:
    none."""

    @property
    def loss_scale(self) -> float | None:
        """The rank's GradScaler scale after its latest step (wire 1.6), None without dynamic loss scaling."""
        return self.figures.get("loss_scale")

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
    """Live ranks' views, in the order they last reported (``write.rank_views.hold``): the silent ones come first, so a scrape
    finds the late ones and the sweep the expired ones without walking a 65,536-rank job."""
    shown: set[int] = field(default_factory=set)
    """Ranks with per-rank series of their own: their own reports (rank, detail), the job's poster, or a
    heartbeat that differs from the job (another mode, dropped reports)."""
    worlds: Counter[int] = field(default_factory=Counter)
    """World sizes the held ranks' latest reports give, counted (``data.liveness.world_size`` picks)."""
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
    latest offenders; ``nanwatch_latest_incident_info``): where its capsule lies, for the dashboard. The
    capsule path as the trainer sent it: the exporter shows it through ``readable.printable``."""
    math_fallback: tuple[str, str, str] | None = None
    """(site, dtype, rank) of the latest training SDPA call that ran on the math backend in half precision."""
    counted_once: dict[tuple, None] = field(default_factory=dict)
    """Recent (what, step, ...) keys counted once per step (insertion order, bounded): ``write.counting.count_once``."""
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
    since: only that incarnation can end the directive by its auto-revert (``DirectiveRuleEngine``). In memory."""
    silent: dict[int, Silent] = field(default_factory=dict)
    """Ranks gone past their TTL without a final report or a crash: their last report time stays exported
    for ``NANWATCH_SILENT_KEEP_S`` or until they report again, so a hung rank keeps alerting."""
    weight_lag: dict[str, int] = field(default_factory=dict)
    """Each rollout worker's weight-sync lag in versions (0: none), written with the weight syncs
    (``nanwatch.monitor.write.weight_compare``): ``nanwatch_weight_sync_lag_versions``. In memory."""


@dataclass(slots=True, kw_only=True)
class HostCaps:
    """The host labels a run and a run-id namespace may name (#27 finding 16: 60,000 made-up hosts in one
    run were 49,987 series). A host is a label of ``nanwatch_not_reproducible_incidents_total`` alone; a new
    one beyond ``per_run`` hosts in its run, or ``per_namespace`` in its namespace, is not counted (caps hit
    ``hosts_per_run`` / ``hosts_per_namespace``; decided by ``nanwatch.monitor.write.admission``).
    ``namespace_of``: the run-id namespace of a run (``TokenTable.namespace_of``); the exporter labels each
    host series with it, so that one team's reports never count on another team's host."""

    per_run: int = 1_024
    per_namespace: int = 8_192
    namespace_of: Callable[[str], str] = lambda _run_id: ANY_NAMESPACE
    by_namespace: dict[str, set[str]] | None = None
    """Hosts by namespace (may hold hosts of forgotten runs: rebuilt before one is refused); None: not built."""


@dataclass(slots=True, kw_only=True)
class NamespaceEvents:
    """The events each run-id namespace's runs hold, against ``cap`` (#37: one team's events never use up the
    collector's total for the others). Counted from the runs' own counts when first asked and after runs went,
    then kept as events are stored (``nanwatch.monitor.write.admission``)."""

    cap: int
    namespace_of: Callable[[str], str]
    counted: Counter[str] | None = None
    """Events by namespace; None: to be counted again from the runs."""


class CollectorState:
    """Runs by id plus the collector's own counters; ``seen`` times are monotonic, ``received`` wall. Plain
    data: ``nanwatch.monitor.write`` alone changes it, and the views of it are functions
    (``nanwatch.monitor.data.liveness``, ``nanwatch.monitor.read.views``)."""

    __slots__ = ("caps_hit", "exported_runs", "exposed", "foreign_views", "hosts", "hwm", "max_events", "max_incarnations",
                 "max_incarnations_per_namespace", "max_runs", "namespace_events", "render_errors", "requests",
                 "runs", "series_cap", "silent_keep_s", "tenures", "ttl_s", "writes")

    def __init__(self, *, ttl_s: float, series_cap: int, max_runs: int = 10_000, max_incarnations: int = 65_536,
                 max_events: int = 10_000, silent_keep_s: float = 86_400.0, hosts: HostCaps | None = None,
                 max_incarnations_per_namespace: int = 262_144, max_events_per_namespace: int = 250_000) -> None:
        self.ttl_s = ttl_s
        self.silent_keep_s = silent_keep_s
        self.series_cap = series_cap
        #: the caps a request is checked against (``nanwatch.monitor.write.caps``)
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
        #: committed writes that a scrape may show (a render is reused only while unchanged: ``read.views``)
        self.writes = 0
        #: the runs whose series this collector shows: None, every live run (one collector); a set, only
        #: these (replicas on a shared PostgreSQL database: the runs whose lease this one holds,
        #: ``nanwatch.monitor.pg.leases``); any other run shows as if not live
        self.exported_runs: set[str] | None = None
        #: replicas: where this one's counter series of a run start (``data.tenures``); None, one collector
        self.tenures: Tenures | None = None
        #: replicas: the latest views of the exported runs' ranks that reached other replicas, by run and
        #: rank (-1: the job view), shown beside this one's own (``nanwatch.monitor.pg.shared_metrics``)
        self.foreign_views: dict[str, dict[int, RankState]] = {}
