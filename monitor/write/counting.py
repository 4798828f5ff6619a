"""Counting one report: the counter totals it adds to, each new series admitted under its run's series cap
(the one place a series is admitted: ``admit``), and what only counting finds -- the headroom by site kind,
the first offenders by stage, the run's latest incidents and spikes. One stage of the fold
(``nanwatch.monitor.write.fold``), entered once per report by ``count_report``, which returns the changed
rows for the store and what the rank's view needs (``Counted``).

Each scope counts what it alone knows (the fold's docstring says which): a job report the run-level
figures, a detail report its rank's own, a heartbeat nothing. A loss scaler's handled overflow counts apart,
once per step, and adds nothing to the non-finite counters; a spike or a replica divergence counts once per
step whichever ranks report it (``count_once``).

Example usage::

    counted = count_report(state, run, report)   # counted.changed: (family, labels, new total) rows
"""

from __future__ import annotations

import string
from typing import NamedTuple

from nanwatch.monitor.data import metric_table as m
from nanwatch.monitor.data import report_figures
from nanwatch.monitor.data.metric_table import MetricSpec
from nanwatch.monitor.data.state import LATEST_SPIKES, RANK_SERIES, RUN_LEVEL_SCOPES, CollectorState, RunState
from nanwatch.wire import MoeStat, StepReport, dtype_name, is_half

__all__ = ["OWN_SCOPES", "Changed", "Counted", "Sites", "admit", "count_once", "count_report", "host_label", "spike_kind"]

#: counter rows a report changed: (family, labels, new total), totals exact ints (they never saturate)
Changed = list[tuple[str, tuple, int]]
#: scopes whose measurements are one rank's own (per-rank views and counters)
OWN_SCOPES = frozenset({"rank", "detail"})
#: steps remembered per run to count a loss-scale overflow once per step, whichever ranks report it
_OVERFLOW_STEPS = 64
#: keys ``count_once`` remembers (a resend is refused by its high-water mark; this dedupes ranks)
_COUNTED_ONCE = 1_024


class Counted(NamedTuple):
    """What counting one report found: its sites' figures, whether its rank may have series of its own
    (admitted under the cap), and the counter rows it changed."""

    sites: Sites
    rank_ok: bool
    changed: Changed
    logits: dict[str, float]
    """The latest step's logit bound per layer, the layers admitted under the cap (a training view's)."""
    moe: MoeStat | None = None
    """The latest step's MoE routers whose per-layer series fit under the cap (a training view's)."""


def count_report(state: CollectorState, run: RunState, r: StepReport) -> Counted:
    """Count one new report into ``run`` (its high-water mark already noted by the fold)."""
    counts = _Counts(run, state.series_cap, state)
    rank_ok = r.scope in OWN_SCOPES and admit(run, ("rank", r.rank), RANK_SERIES, counts.cap)
    sites = _count_sites(counts, r, rank_ok=rank_ok)
    # dynamic loss scaling handled this step's non-finite gradients: normal operation, counted apart
    if r.scope in RUN_LEVEL_SCOPES and not r.scaler_overflow and (sites.offenders or r.first_offender):
        _note_latest_offender(run, r, sites.offenders)
    if r.stage == "train" and r.scaler_overflow and counts.admit(m.LOSS_SCALE_OVERFLOWS, ()) \
            and _count_overflow(run, r.step):
        counts.add(m.LOSS_SCALE_OVERFLOWS, (), 1)
    _count_sdpa(counts, r)
    if r.scope in RUN_LEVEL_SCOPES:
        _count_run_level(counts, r)
    _count_skipped(counts, r, rank_ok=rank_ok)
    logits: dict[str, float] = {}
    if r.stage == "train" and not r.final and (r.scope not in OWN_SCOPES or rank_ok):  # a training view follows
        for kind in sites.headroom:  # its gauges' series, admitted under the cap as the counters' are
            admit(run, ("headroom", kind), 1, counts.cap)
        logits = {lg.layer: lg.bound for lg in r.logits if admit(run, ("layer", lg.layer), 1, counts.cap)}
        return Counted(sites, rank_ok, counts.changed, logits, _moe_admitted(run, r, counts.cap))
    return Counted(sites, rank_ok, counts.changed, logits)


def _moe_admitted(run: RunState, r: StepReport, cap: int) -> MoeStat | None:
    """The report's MoE routers whose per-layer series fit under the run's series cap (the rest dropped, counted
    as every series is)."""
    if r.moe is None:
        return None
    routers = [x for x in r.moe.routers if admit(run, ("moe_layer", x.router), 4, cap)]
    return r.moe if len(routers) == len(r.moe.routers) else r.moe.model_copy(update={"routers": routers})


def admit(run: RunState, key: tuple, cost: int, cap: int) -> bool:
    """Whether the series behind ``key`` may exist; new keys beyond the cap are dropped and counted."""
    if key in run.admitted:
        return True
    if run.series + cost > cap:
        run.series_dropped += cost
        return False
    run.admitted.add(key)
    run.series += cost
    return True


def count_once(run: RunState, key: tuple) -> bool:
    """Whether ``key`` (a spike's or a replica divergence's step, and what it is of) is seen for the first
    time lately: the ranks of one job may each report the same step, which counts once."""
    return _first_seen(run.counted_once, key, _COUNTED_ONCE)


def _count_overflow(run: RunState, step: int) -> bool:
    """Whether a loss-scale overflow at ``step`` is the step's first (ranks of one job report the same
    step: it counts once)."""
    return _first_seen(run.overflow_steps, step, _OVERFLOW_STEPS)


def _first_seen(seen: dict, key: object, keep: int) -> bool:
    """Whether ``key`` is new to ``seen`` (an insertion-ordered set of the latest ``keep``); notes it."""
    if key in seen:
        return False
    seen[key] = None
    if len(seen) > keep:
        del seen[next(iter(seen))]
    return True


def _hosts(run: RunState) -> set[str]:
    return {labels[0] for fam, labels in run.counters if fam == m.NOT_REPRODUCIBLE_INCIDENTS.key}


def _hosts_by_namespace(state: CollectorState) -> dict[str, set[str]]:
    caps = state.hosts
    by_ns: dict[str, set[str]] = {}
    for run_id, run in state.runs.items():
        by_ns.setdefault(caps.namespace_of(run_id), set()).update(_hosts(run))
    caps.by_namespace = by_ns
    return by_ns


def _admit_host(state: CollectorState, run: RunState, host: str) -> bool:
    """Whether ``run`` may count a not-reproducible incident on ``host`` (a host it already counts: yes), under
    the host-label caps per run and per namespace (``HostCaps``); a refusal is counted as a cap hit."""
    caps = state.hosts
    if (m.NOT_REPRODUCIBLE_INCIDENTS.key, (host,)) in run.counters:
        return True
    if len(_hosts(run)) >= caps.per_run:
        state.caps_hit["hosts_per_run"] += 1
        return False
    ns = caps.namespace_of(run.run_id)
    by_ns = caps.by_namespace if caps.by_namespace is not None else _hosts_by_namespace(state)
    hosts = by_ns.setdefault(ns, set())
    if host not in hosts and len(hosts) >= caps.per_namespace:
        hosts = _hosts_by_namespace(state).setdefault(ns, set())  # forgotten runs' hosts free their places
        if len(hosts) >= caps.per_namespace:
            state.caps_hit["hosts_per_namespace"] += 1
            return False
    hosts.add(host)
    return True


class _Counts:
    """The counter totals one report adds to, each series admitted under the run's cap, and the rows that
    changed."""

    __slots__ = ("cap", "changed", "run", "state")

    def __init__(self, run: RunState, cap: int, state: CollectorState) -> None:
        self.run, self.cap, self.state = run, cap, state
        self.changed: Changed = []

    def admit_host(self, host: str) -> bool:
        """Whether the run may name ``host`` (the host-label caps, per run and per namespace: ``HostCaps``)."""
        return _admit_host(self.state, self.run, host)

    def admit(self, fam: MetricSpec, labels: tuple) -> bool:
        """Whether the series may exist (a new one beyond the run's series cap is dropped and counted)."""
        return admit(self.run, (fam.key, *labels), 1, self.cap)

    def add(self, fam: MetricSpec, labels: tuple, n: int) -> None:
        run, key = self.run, (fam.key, labels)
        old = run.counters.get(key)
        if old is None and not _exposed(run, fam, labels):
            run.newborn.add(key)  # born at zero: the next render shows 0, then the value
        value = (old or 0) + n  # exact ints: a float total stops counting at 2^53
        run.counters[key] = value
        self.changed.append((fam.key, labels, value))


def _exposed(run: RunState, fam: MetricSpec, labels: tuple) -> bool:
    """Whether a counter series not yet kept was already rendered at 0 by default (so it needs no birth
    render): the run's train-stage non-finite counters, and the per-rank ones of ranks already rendered."""
    if fam.per_rank:
        return int(labels[0]) in run.exposed_ranks
    if fam is m.RUN_NONFINITE_CALLS:
        return labels[2] == "train" and run.exposed
    return fam is m.JOB_SKIPPED and bool(run.exposed_ranks)


class Sites(NamedTuple):
    """What a report's sites add up to: headroom by site kind, non-finite calls, the first offender by stage."""

    headroom: dict[str, float]
    nonfinite: int
    offenders: dict[str, tuple[str, str]]


#: what a host label may hold: a DNS name's characters (and an IPv6 address's colons); anything else is ``_``
_HOST_CHARS = frozenset(string.ascii_lowercase + string.digits + ".-_:")


def host_label(host: str) -> str:
    """The ``host`` label of an Incident's ``host`` (``"<hostname> rank <r>"``): the hostname, lower-cased,
    each character outside a DNS name's (control and bidi characters included) written as ``_``, at most 253
    characters (a DNS name's longest); ``unknown`` if nothing is left. Bounded and safe to show."""
    head, sep, tail = host.rpartition(" rank ")
    name = head if sep and tail.strip().isdigit() else host
    name = "".join(c if c in _HOST_CHARS else "_" for c in name.strip().lower())[:253]
    return name or "unknown"


def _count_sites(counts: _Counts, r: StepReport, *, rank_ok: bool) -> Sites:
    """Headroom per site kind (a NaN wins and stays: it must show) and the non-finite calls, counted by site,
    by run (pass, kind, stage) and by rank; none while a loss scaler handled the step's overflow."""
    run_level, overflow, rank_label = r.scope in RUN_LEVEL_SCOPES, bool(r.scaler_overflow), str(r.rank)
    sites = Sites({}, 0, {})
    headroom, offenders = sites.headroom, sites.offenders
    nonfinite = 0
    for s in r.sites:
        kind = "grad" if s.phase == "backward" else s.kind
        h, cur = s.headroom, headroom.get(kind)
        if cur is None or h > cur or h != h:
            headroom[kind] = h
        if not (s.nan or s.inf) or overflow:
            continue
        nonfinite += s.nan + s.inf
        stage = "eval" if r.stage == "eval" else s.stage
        offenders.setdefault(stage, (s.site, s.phase))
        if run_level and counts.admit(m.SITE_NONFINITE_CALLS, (s.site, s.phase)):
            counts.add(m.SITE_NONFINITE_CALLS, (s.site, s.phase), s.nan + s.inf)
        for kind_, n in (("nan", s.nan), ("inf", s.inf)):
            if n and run_level and counts.admit(m.RUN_NONFINITE_CALLS, (s.phase, kind_, stage)):
                counts.add(m.RUN_NONFINITE_CALLS, (s.phase, kind_, stage), n)
            if n and rank_ok:
                counts.add(m.NONFINITE_CALLS, (rank_label, s.phase, kind_), n)
    return sites._replace(nonfinite=nonfinite)


def _count_sdpa(counts: _Counts, r: StepReport) -> None:
    """The report's SDPA calls: counted by a run-level report (backend, dtype, stage), and who ran the latest
    half-precision training attention call on the math backend."""
    run_level, train = r.scope in RUN_LEVEL_SCOPES, r.stage == "train"
    for c in r.sdpa:
        dtype = dtype_name(c.dtype)
        if train and c.backend == "math" and c.stage == "train" and is_half(c.dtype):
            counts.run.math_fallback = (c.site, dtype, str(r.rank))
        if run_level and counts.admit(m.SDPA_CALLS, labels := (c.backend, dtype, c.stage)):
            counts.add(m.SDPA_CALLS, labels, c.calls)


def _count_run_level(counts: _Counts, r: StepReport) -> None:
    """What only a run-level report counts: unmeasured training steps, incidents, the table's counter figures
    (the rollout's own non-finite log-probabilities), its classified mismatches (wire 1.8), spikes (wire 1.9)."""
    for reason in r.coverage.unmeasured if r.coverage is not None and r.stage == "train" else ():
        if counts.admit(m.UNMEASURED_STEPS, (reason,)):
            counts.add(m.UNMEASURED_STEPS, (reason,), 1)
    _count_incident(counts, r)
    _count_figures(counts, r)
    _count_rollout(counts, r)
    _count_spikes(counts, r)


def _count_incident(counts: _Counts, r: StepReport) -> None:
    """The report's incident, by class; a replica divergence is the job's, found by a collective every rank
    took part in: once per step."""
    inc = r.incident
    if inc is not None and (inc.cls != "replica_divergence" or count_once(counts.run, ("replica", inc.step))):
        if counts.admit(m.INCIDENTS, (inc.cls,)):
            counts.add(m.INCIDENTS, (inc.cls,), 1)
        _note_incident(counts, r)


def spike_kind(phase: str, kind: str) -> str:
    """A spike's ``site_kind`` label: a backward site's is ``grad`` (as the headroom's), else its kind."""
    return "grad" if phase == "backward" else kind


def _count_spikes(counts: _Counts, r: StepReport) -> None:
    """A step's spikes (wire 1.9): one count per step and site kind, whichever ranks report it (a step in which
    forty gradient sites jumped is one spike step of kind grad), and the run's latest spikes for ``nanwatch
    status``. Run-level reports only, as nanwatch_run_nonfinite_calls_total: a detail report's are its job's."""
    if not r.spikes:
        return
    run = counts.run
    for kind in dict.fromkeys(spike_kind(s.phase, s.kind) for s in r.spikes):
        if count_once(run, ("spike", r.stage, r.step, kind)) and counts.admit(m.SPIKES, (kind,)):
            counts.add(m.SPIKES, (kind,), 1)
    if run.latest_spikes is None or r.step >= run.latest_spikes[0]:
        run.latest_spikes = (r.step, r.rank, tuple(r.spikes[:LATEST_SPIKES]))


def _count_figures(counts: _Counts, r: StepReport) -> None:
    """The table's counter figures (``MetricSpec.path``: the sampler's non-finite log-probabilities inside the
    mask, counted, never replaced: TRL PR #6693's neutralisation would hide them). Run-level reports only (a job
    report once for the job, a rank report for its rank), as nanwatch_run_nonfinite_calls_total: a detail
    report's are in its job report."""
    for spec, n in report_figures.counted(r):
        if counts.admit(spec, ()):
            counts.add(spec, (), n)


def _count_rollout(counts: _Counts, r: StepReport) -> None:
    """The rollout's mismatch events by cause (run-level reports only, as the figures)."""
    for ev in r.rollout_events:
        if counts.admit(m.ROLLOUT_MISMATCH_EVENTS, (ev.cause,)):
            counts.add(m.ROLLOUT_MISMATCH_EVENTS, (ev.cause,), 1)


def _count_skipped(counts: _Counts, r: StepReport, *, rank_ok: bool) -> None:
    """A step the weight guard skipped: by its rank, or (a job report) by every rank it covered, all of
    which took the collective decision (the exporter adds the job's to each rank's). A step whose non-finite
    gradients a loss scaler handled is not one (#26): it is a loss-scale overflow, counted apart, whether or
    not the guard also held the update back (it does with a fused optimizer, which steps with found_inf)."""
    if not r.step_skipped or r.scaler_overflow:
        return
    if r.scope == "rank" and rank_ok:
        counts.add(m.SKIPPED_STEPS, (str(r.rank),), 1)
    elif r.scope == "job" and counts.admit(m.JOB_SKIPPED, ()):
        counts.add(m.JOB_SKIPPED, (), 1)


def _note_incident(counts: _Counts, r: StepReport) -> None:
    """The incident's host and capsule: the run's latest of its class (for the dashboard) and, if the
    trainer's differential re-run could not reproduce it, one more not-reproducible incident on its host (the
    silent-data-corruption signal, counted per run and summed over runs by host in the alert)."""
    inc, run = r.incident, counts.run
    host = host_label(inc.host) if inc.host else "unknown"
    who = str(r.first_offender_rank if r.scope == "job" and r.first_offender_rank is not None else r.rank)
    named = [host] if inc.cls == "not_reproducible" else []
    if inc.cls == "replica_divergence":  # the hosts whose replicas disagree, each counted once
        named = list(dict.fromkeys(host_label(h) for h in inc.hosts))
        host = _listed(named, 4) or "unknown"
        who = _listed([str(k) for k in inc.ranks], 8) or who
    for h in named:
        if counts.admit_host(h) and counts.admit(m.NOT_REPRODUCIBLE_INCIDENTS, (h,)):
            counts.add(m.NOT_REPRODUCIBLE_INCIDENTS, (h,), 1)
    if admit(run, ("latest_incident", inc.cls), 1, counts.cap):
        run.latest_incidents[inc.cls] = (host, who, inc.capsule or "")  # shown through printable() when rendered


def _listed(names: list[str], most: int) -> str:
    """The first ``most`` names, comma-separated, and how many more (an info label stays short)."""
    more = len(names) - most
    return ",".join(names[:most]) + (f",+{more}" if more > 0 else "")


def _note_latest_offender(run: RunState, r: StepReport, offenders: dict[str, tuple[str, str]]) -> None:
    """This incident's offender, by stage: the report's named first offender (a job report names its rank),
    else the stage's first non-finite site."""
    if r.first_offender is not None:
        stage = "eval" if r.stage == "eval" else r.first_offender_stage or next(
            (st for st, (site, _) in offenders.items() if site == r.first_offender), "train")
        phase = r.first_offender_phase or offenders.get(stage, ("", ""))[1]
        offenders[stage] = (r.first_offender, phase)
    who = str(r.first_offender_rank if r.first_offender_rank is not None else r.rank)
    for stage, (site, phase) in offenders.items():
        run.latest_offenders[stage] = (site, phase or "", who)
