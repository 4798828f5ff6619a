"""Folding step reports into the collector's memory, one at a time (the ledger calls this inside its
transaction): a report the trainer resent is recognised and left out; a new one updates the per-rank views
and counters, and its fold returns what the store must hold because of it (``Folded``: the counter totals
it changed, its high-water mark, the run's end), gathered over the batch in ``Changes``. The ledger writes
those, and the rule engine's intents, in the same transaction, so that a resend is never counted twice.

A report folds in by whom it speaks for (wire 1.4 ``StepReport.scope``). A job of 65,536 ranks cannot
post 65,536 measured reports a step to one collector (per-rank reports at 1,024 ranks already took its
p99 to 73 ms), so the trainer reduces a step's figures across ranks and one
rank posts them (``job``); ranks that differ post their own beside it (``detail``), and every rank posts a
small ``heartbeat`` now and then. Each scope feeds only what it alone knows, so that the same step gives
the same run-level figures whichever way it arrived:

* ``rank`` (every pre-1.4 sender): everything, as before 1.4.
* ``job``: the run-level figures -- site, SDPA, unmeasured and incident counters, the run's non-finite
  count, the rollout's non-finite log-probabilities and mismatch events, the logit/headroom/RLHF gauges
  (the rollout mismatch rides in the RLHF view) (``RunState.job``), the first offender (with
  ``first_offender_rank``) -- and the job's skipped steps, which count for every rank it covered (all of
  them took the collective decision); the posting rank is kept live, as by a heartbeat.
* ``detail``: the rank's own view and per-rank counters (non-finite values by rank), and its events; never
  a run-level counter, which the job report of that step already holds.
* ``heartbeat``: liveness only (last report time, mode, directive version, dropped reports); it is not
  kept in the store's high-water marks (it carries no count: a resend cannot double anything).

An evaluation's report (wire 1.5 ``stage="eval"``) counts its non-finite values and SDPA calls (their sites
and calls keep the ``eval`` stage label), keeps the rank live and is kept in the high-water marks like any
report; but it is no training step: it moves neither the run's step nor the rank's training view (mode,
logit bounds, headroom, RLHF: the gauges), and counts no unmeasured step. A report that ``raised`` marks its
rank crashed (``RunState.crashed``): no longer live, the run ends crashed.
"""

from __future__ import annotations

import string
from dataclasses import dataclass, field
from typing import NamedTuple

from nanwatch.monitor.data import counters
from nanwatch.monitor.data.counters import ENDED_FAMILY, CounterFamily
from nanwatch.monitor.data.state import (
    LATEST_SPIKES,
    MAX_HEARTBEAT_S,
    MAX_WORLD_SIZE,
    RANK_SERIES,
    RUN_LEVEL_SCOPES,
    CollectorState,
    RankState,
    RunState,
)
from nanwatch.monitor.data.store import EventRow
from nanwatch.readable import printable
from nanwatch.wire import StepReport, dtype_name, is_half

__all__ = ["Changes", "Folded", "Ingested", "apply_report", "fold", "host_label", "is_new"]

#: a high-water mark row for the store: (run_id, rank, incarnation, seq, step)
Mark = tuple[str, int, str, int, int]
#: counter rows a report changed: (family, labels, new total), totals exact ints (they never saturate)
Changed = list[tuple[str, tuple, int]]


class Ingested(NamedTuple):
    """What the collector did with a batch. Resent reports are acknowledged too: they are ``duplicates``."""

    accepted: int
    duplicates: int


@dataclass(slots=True)
class Folded:
    """What one new report changed, for the ledger to write and the rules to read (memory already holds it)."""

    rank: RankState | None
    """The view the rules read: the rank's, or the job's; None if the rank is capped or the report kept it
    live only."""
    previous_mode: str | None
    """The rank's attention mode before this report (None if unknown)."""
    counters: Changed
    mark: Mark | None
    """The report's high-water mark (None for a heartbeat: it counts nothing, so its resend is harmless)."""
    events: list[EventRow] = field(default_factory=list)
    """Events the fold itself calls for (the run ended), recorded before the rules' intents."""


@dataclass(slots=True)
class Changes:
    """What a batch's fold asks the store to hold: the high-water marks, the counter totals and the runs
    written to (retention counts from there), and how many reports were new."""

    accepted: int = 0
    duplicates: int = 0
    marks: list[Mark] = field(default_factory=list)
    counters: dict[tuple[str, str, tuple], int] = field(default_factory=dict)
    touched: set[str] = field(default_factory=set)

    def add(self, r: StepReport, folded: Folded | None) -> None:
        """Take one report's fold (None: a resend). Heartbeats alone keep a run live in memory
        (``RunState.touched``) without a row write each; the job's reports, every step, write it."""
        if r.scope != "heartbeat":
            self.touched.add(r.run_id)
        if folded is None:
            self.duplicates += 1
            return
        self.accepted += 1
        for fam, labels, value in folded.counters:
            self.counters[(r.run_id, fam, labels)] = value
        if folded.mark is not None:
            self.marks.append(folded.mark)

    def counter_rows(self) -> list[tuple[str, str, tuple, int]]:
        return [(*k, v) for k, v in self.counters.items()]

    def ingested(self) -> Ingested:
        return Ingested(self.accepted, self.duplicates)


def fold(state: CollectorState, r: StepReport, *, received: float, seen: float) -> Folded | None:
    """Fold one report into memory; returns what the store must hold because of it, or None for a resend
    (``is_new``)."""
    if not is_new(state, r):
        return None
    run = state.ensure_run(r.run_id)
    was_ended = run.ended
    rank, previous_mode, changed = apply_report(state, r, received=received, seen=seen)
    mark = None
    if r.scope != "heartbeat":
        # an evaluation's step is the training step it follows: the store's step stays the run's
        mark = (r.run_id, r.rank, r.incarnation, r.seq, r.step if r.stage == "train" else run.latest_step)
    folded = Folded(rank, previous_mode, changed, mark)
    if run.ended and not was_ended:  # the last rank the run held ended normally: once per ending
        folded.events.append(EventRow(r.run_id, received, "run_ended", f"run_ended:{r.rank}:{r.incarnation}:{r.seq}",
                                      r.rank, r.step, None, "", {"ranks": len(run.ended_ranks)}))
    return folded


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


#: scopes whose measurements are one rank's own (per-rank views and counters)
_OWN_SCOPES = frozenset({"rank", "detail"})


def is_new(state: CollectorState, r: StepReport) -> bool:
    """False for a resend: the sender delivers in order, so seq <= high-water mark was applied (for a
    heartbeat: seq <= the rank's last heartbeat, kept in memory)."""
    if r.scope == "heartbeat":
        run = state.runs.get(r.run_id)
        held = run.ranks.get(r.rank) if run is not None else None
        return held is None or held.incarnation != r.incarnation or r.seq > held.heartbeat_seq
    return r.seq > state.hwm.get((r.run_id, r.rank, r.incarnation), -1)


def apply_report(state: CollectorState, r: StepReport, *, received: float,
                 seen: float) -> tuple[RankState | None, str | None, Changed]:
    """Fold one new report into the state. Returns the state the rules read (the rank's, or the job view;
    None if the rank is capped), the rank's previous attention mode (None if unknown) and the counter
    rows that changed (for the store).

    Lifecycle (wire 1.6 ``final``): a final report ends its rank (its view and per-rank series go at once);
    a report from an incarnation that already ended is counted but holds nothing; once every rank the run
    held has ended (none held, hung or crashed) the run has ended, until a new incarnation reports."""
    run = state.ensure_run(r.run_id)
    if r.final and _foreign(run, r):
        _note_mark(state, run, r)  # its resend is recognised; it ends and holds nothing
        return None, None, []
    ended_inc = run.ended_ranks.get(r.rank)
    straggler = ended_inc is not None and ended_inc == r.incarnation
    rank, previous_mode, changed = _apply(state, run, r, received=received, seen=seen)
    if r.final or straggler:
        run.end_rank(r.rank, r.incarnation if r.final else ended_inc)
    elif ended_inc is not None:  # the rank restarted: a new incarnation, no longer ended
        del run.ended_ranks[r.rank]
        run.ended_views.pop(r.rank, None)
    if run.ended and not r.final and not straggler:  # a new incarnation (or rank) revives the run
        run.ended = False
        changed.append((ENDED_FAMILY, (), 0))
    if not run.ended and run.all_ended():
        run.ended = True
        changed.append((ENDED_FAMILY, (), 1))
    return rank, previous_mode, changed


def _foreign(run: RunState, r: StepReport) -> bool:
    """Whether the rank is held live under another incarnation than the report's: a final report then ends
    nothing (it ends only the rank and incarnation that sent it; a restarted rank's new incarnation reports
    before it ends)."""
    held = run.ranks.get(r.rank)
    return held is not None and held.incarnation != r.incarnation and held.crashed is None


class _Counts:
    """The counter totals one report adds to, each series admitted under the run's cap, and the rows that
    changed."""

    __slots__ = ("cap", "changed", "run", "state")

    def __init__(self, run: RunState, cap: int, state: CollectorState) -> None:
        self.run, self.cap, self.state = run, cap, state
        self.changed: Changed = []

    def admit_host(self, host: str) -> bool:
        """Whether the run may name ``host`` (the host-label caps, per run and per namespace: ``HostCaps``)."""
        state = self.state
        return state.hosts.admit(state.runs, self.run, host, state.caps_hit)

    def admit(self, fam: CounterFamily, labels: tuple) -> bool:
        """Whether the series may exist (a new one beyond the run's series cap is dropped and counted)."""
        return self.run.admit((fam.key, *labels), 1, self.cap)

    def add(self, fam: CounterFamily, labels: tuple, n: int) -> None:
        run, key = self.run, (fam.key, labels)
        old = run.counters.get(key)
        if old is None and not _exposed(run, fam, labels):
            run.newborn.add(key)  # born at zero: the next render shows 0, then the value
        value = (old or 0) + n  # exact ints: a float total stops counting at 2^53
        run.counters[key] = value
        self.changed.append((fam.key, labels, value))


def _exposed(run: RunState, fam: CounterFamily, labels: tuple) -> bool:
    """Whether a counter series not yet kept was already rendered at 0 by default (so it needs no birth
    render): the run's train-stage non-finite counters, and the per-rank ones of ranks already rendered."""
    if fam.per_rank:
        return int(labels[0]) in run.exposed_ranks
    if fam is counters.RUN_NONFINITE:
        return labels[2] == "train" and run.exposed
    return fam is counters.JOB_SKIPPED and bool(run.exposed_ranks)


class _Sites(NamedTuple):
    """What a report's sites add up to: headroom by site kind, non-finite calls, the first offender by stage."""

    headroom: dict[str, float]
    nonfinite: int
    offenders: dict[str, tuple[str, str]]


def _apply(state: CollectorState, run: RunState, r: StepReport, *, received: float,
           seen: float) -> tuple[RankState | None, str | None, Changed]:
    run.last_seen = run.touched = seen
    if r.scope == "heartbeat":
        return (*_keep_live(run, r, received=received, seen=seen, heartbeat=True), [])
    _mark(state, run, r)
    if r.scope == "job" and (run.job_poster is None or r.rank == 0):  # the ledger refused any other poster
        run.job_poster = r.rank
    counts = _Counts(run, state.series_cap, state)
    rank_ok = r.scope in _OWN_SCOPES and run.admit(("rank", r.rank), RANK_SERIES, counts.cap)
    sites = _count_sites(counts, r, rank_ok=rank_ok)
    # dynamic loss scaling handled this step's non-finite gradients: normal operation, counted apart
    if r.scope in RUN_LEVEL_SCOPES and not r.scaler_overflow and (sites.offenders or r.first_offender):
        _note_latest_offender(run, r, sites.offenders)
    _count_steps(counts, r)
    if r.scope in RUN_LEVEL_SCOPES:
        _count_run_level(counts, r)
    _count_skipped(counts, r, rank_ok=rank_ok)
    if r.scope in _OWN_SCOPES and not rank_ok:
        return None, None, counts.changed
    if r.stage != "train" or r.final:  # the rank is live, and its training view stays what its last step said
        _keep_live(run, r, received=received, seen=seen, heartbeat=False)
        return None, None, counts.changed
    return (*_training_view(state, run, r, sites, received=received, seen=seen), counts.changed)


def _mark(state: CollectorState, run: RunState, r: StepReport) -> None:
    """The report's high-water mark and step, and what it says of its rank's lifecycle."""
    _note_mark(state, run, r)
    if r.stage == "train":
        run.latest_step = max(run.latest_step, r.step)
    if r.scope != "job":  # a job report speaks for many ranks, and a crash is posted by the rank itself
        run.note_crash(r.rank, r.incarnation, r.raised, r.step)


def _note_mark(state: CollectorState, run: RunState, r: StepReport) -> None:
    key = (r.run_id, r.rank, r.incarnation)
    if key not in state.hwm:
        run.incarnations += 1
    state.hwm[key] = r.seq


def _count_sites(counts: _Counts, r: StepReport, *, rank_ok: bool) -> _Sites:
    """Headroom per site kind (a NaN wins and stays: it must show) and the non-finite calls, counted by site,
    by run (pass, kind, stage) and by rank; none while a loss scaler handled the step's overflow."""
    run_level, overflow, rank_label = r.scope in RUN_LEVEL_SCOPES, bool(r.scaler_overflow), str(r.rank)
    sites = _Sites({}, 0, {})
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
        if run_level and counts.admit(counters.SITE, (s.site, s.phase)):
            counts.add(counters.SITE, (s.site, s.phase), s.nan + s.inf)
        for kind_, n in (("nan", s.nan), ("inf", s.inf)):
            if n and run_level and counts.admit(counters.RUN_NONFINITE, (s.phase, kind_, stage)):
                counts.add(counters.RUN_NONFINITE, (s.phase, kind_, stage), n)
            if n and rank_ok:
                counts.add(counters.NONFINITE, (rank_label, s.phase, kind_), n)
    return sites._replace(nonfinite=nonfinite)


def _count_steps(counts: _Counts, r: StepReport) -> None:
    """A training step's loss-scale overflow (once per step, whichever ranks report it) and who ran the
    latest half-precision training attention call on the math backend."""
    if r.stage != "train":
        return
    run = counts.run
    if r.scaler_overflow and counts.admit(counters.LOSS_SCALE_OVERFLOW, ()) and run.count_overflow(r.step):
        counts.add(counters.LOSS_SCALE_OVERFLOW, (), 1)
    for c in r.sdpa:
        if c.backend == "math" and c.stage == "train" and is_half(c.dtype):
            run.math_fallback = (c.site, dtype_name(c.dtype), str(r.rank))


def _count_run_level(counts: _Counts, r: StepReport) -> None:
    """What only a run-level report counts: SDPA calls, unmeasured training steps, incidents, the rollout's
    own non-finite log-probabilities and its classified mismatches (wire 1.8)."""
    for c in r.sdpa:
        labels = (c.backend, dtype_name(c.dtype), c.stage)
        if counts.admit(counters.SDPA, labels):
            counts.add(counters.SDPA, labels, c.calls)
    for reason in r.coverage.unmeasured if r.coverage is not None and r.stage == "train" else ():
        if counts.admit(counters.UNMEASURED, (reason,)):
            counts.add(counters.UNMEASURED, (reason,), 1)
    inc = r.incident
    # a replica divergence is the job's, found by a collective every rank took part in: once per step
    if inc is not None and (inc.cls != "replica_divergence" or counts.run.count_once(("replica", inc.step))):
        if counts.admit(counters.INCIDENT, (inc.cls,)):
            counts.add(counters.INCIDENT, (inc.cls,), 1)
        _note_incident(counts, r)
    _count_rollout(counts, r)
    _count_spikes(counts, r)


def spike_kind(phase: str, kind: str) -> str:
    """A spike's ``site_kind`` label: a backward site's is ``grad`` (as the headroom's), else its kind."""
    return "grad" if phase == "backward" else kind


def _count_spikes(counts: _Counts, r: StepReport) -> None:
    """A step's spikes (wire 1.9): one count per step and site kind, whichever ranks report it (a step in which
    forty gradient sites jumped is one spike step of kind grad), and the run's latest spikes for ``nanwatch
    status``. Run-level reports only, as nanwatch_run_nonfinite_values_total: a detail report's are its job's."""
    if not r.spikes:
        return
    run = counts.run
    for kind in dict.fromkeys(spike_kind(s.phase, s.kind) for s in r.spikes):
        if run.count_once(("spike", r.stage, r.step, kind)) and counts.admit(counters.SPIKE, (kind,)):
            counts.add(counters.SPIKE, (kind,), 1)
    if run.latest_spikes is None or r.step >= run.latest_spikes[0]:
        run.latest_spikes = (r.step, r.rank, tuple(r.spikes[:LATEST_SPIKES]))


def _count_rollout(counts: _Counts, r: StepReport) -> None:
    """The sampler's non-finite log-probabilities inside the mask (``RlhfStat.nonfinite["rollout_logprobs"]``,
    counted, never replaced: TRL PR #6693's neutralisation would hide them) and the mismatch events by cause.
    Run-level reports only (a job report once for the job, a rank report for its rank), as
    nanwatch_run_nonfinite_values_total: a detail report's are in its job report."""
    n = r.rlhf.nonfinite.get("rollout_logprobs", 0) if r.rlhf is not None else 0
    if n and counts.admit(counters.ROLLOUT_NONFINITE, ()):
        counts.add(counters.ROLLOUT_NONFINITE, (), n)
    for ev in r.rollout_events:
        if counts.admit(counters.ROLLOUT_EVENT, (ev.cause,)):
            counts.add(counters.ROLLOUT_EVENT, (ev.cause,), 1)


def _count_skipped(counts: _Counts, r: StepReport, *, rank_ok: bool) -> None:
    """A step the weight guard skipped: by its rank, or (a job report) by every rank it covered, all of
    which took the collective decision (the exporter adds the job's to each rank's). A step whose non-finite
    gradients a loss scaler handled is not one (#26): it is a loss-scale overflow, counted apart, whether or
    not the guard also held the update back (it does with a fused optimizer, which steps with found_inf)."""
    if not r.step_skipped or r.scaler_overflow:
        return
    if r.scope == "rank" and rank_ok:
        counts.add(counters.SKIPPED, (str(r.rank),), 1)
    elif r.scope == "job" and counts.admit(counters.JOB_SKIPPED, ()):
        counts.add(counters.JOB_SKIPPED, (), 1)


def _training_view(state: CollectorState, run: RunState, r: StepReport, sites: _Sites, *, received: float,
                   seen: float) -> tuple[RankState, str | None]:
    """The rank's (or the job's) view of its latest training step; views are replaced, never mutated."""
    cap = state.series_cap
    for kind in sites.headroom:
        run.admit(("headroom", kind), 1, cap)
    logits = {lg.layer: lg.bound for lg in r.logits if run.admit(("layer", lg.layer), 1, cap)}
    view = dict(seq=r.seq, step=r.step, time=r.time, received=received, seen=seen,
                world_size=min(r.world_size, MAX_WORLD_SIZE), agree_every=r.agree_every, attention_mode=r.attention_mode, directive_version=r.directive_version,
                dropped_reports=r.dropped_reports, nonfinite=sites.nonfinite, first_offender=r.first_offender,
                first_offender_phase=r.first_offender_phase, headroom=sites.headroom, logits=logits, rlhf=r.rlhf,
                crashed=r.raised, loss_scale=r.loss_scale)
    if r.scope == "job":
        view["crashed"] = None
        run.job = RankState(rank=r.rank, incarnation=r.incarnation, scope="job", **view)
        _, previous_mode = _keep_live(run, r, received=received, seen=seen, heartbeat=False)
        return run.job, previous_mode
    prev = run.ranks.get(r.rank)
    same = prev is not None and prev.incarnation == r.incarnation
    # a mode change is one incarnation's: a restarted rank starting on the model's own path reverted nothing
    previous_mode = prev.attention_mode if same else None
    st = RankState(rank=r.rank, incarnation=r.incarnation, scope=r.scope, heartbeat_seq=prev.heartbeat_seq if same
                   else -1, heartbeat_s=prev.heartbeat_s if same else 0.0, **view)
    run.hold(st, shown=True)
    return st, previous_mode


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
        if counts.admit_host(h) and counts.admit(counters.NOT_REPRODUCIBLE, (h,)):
            counts.add(counters.NOT_REPRODUCIBLE, (h,), 1)
    if run.admit(("latest_incident", inc.cls), 1, counts.cap):
        run.latest_incidents[inc.cls] = (host, who, printable(inc.capsule or ""))


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


def _keep_live(run: RunState, r: StepReport, *, received: float, seen: float,
               heartbeat: bool) -> tuple[RankState, str | None]:
    """The rank's liveness from a heartbeat or the job report it posted: a rank with its own view keeps
    its measurements (views are replaced, never mutated: a scrape's snapshot may hold the old one). Built
    field by field: ``dataclasses.replace`` cost a third of a heartbeat's fold (measured)."""
    prev = run.ranks.get(r.rank)
    same = prev is not None and prev.incarnation == r.incarnation
    held = prev if same else _BLANK
    # the rank's own interval, bounded: the run's is the median of its ranks' (``RunState.heartbeat_s``)
    interval_s = min(r.heartbeat_s, MAX_HEARTBEAT_S) if r.heartbeat_s is not None else held.heartbeat_s
    step = held.step if same and r.stage != "train" else r.step  # an evaluation moves no step
    st = RankState(rank=r.rank, incarnation=r.incarnation, seq=r.seq, scope=held.scope, step=step, time=r.time,
                   received=received, seen=seen, world_size=min(r.world_size, MAX_WORLD_SIZE),
                   agree_every=r.agree_every if r.agree_every is not None else held.agree_every,
                   attention_mode=r.attention_mode, directive_version=r.directive_version,
                   dropped_reports=r.dropped_reports, nonfinite=held.nonfinite, first_offender=held.first_offender,
                   first_offender_phase=held.first_offender_phase, headroom=held.headroom, logits=held.logits,
                   rlhf=held.rlhf, heartbeat_seq=r.seq if heartbeat else held.heartbeat_seq,
                   crashed=r.raised if r.scope != "job" else held.crashed,
                   heartbeat_s=interval_s,
                   # a heartbeat carries liveness only: the loss scale is its step reports' (finding 9 of #27)
                   loss_scale=r.loss_scale if r.loss_scale is not None and not heartbeat else held.loss_scale)
    # per-rank series only for what must be seen by rank: its own view, the job's poster, another mode
    job = run.job
    shown = (held.scope != "heartbeat" or not heartbeat or r.dropped_reports > 0
             or r.attention_mode != (job.attention_mode if job is not None else "none")
             or (job is not None and job.rank == r.rank))
    run.hold(st, shown=shown)
    return st, prev.attention_mode if same else None


#: what a rank known only by its liveness holds (its measurements: none)
_BLANK = RankState(rank=0, incarnation="", seq=-1, scope="heartbeat", step=0, time=0.0, received=0.0, seen=0.0)
