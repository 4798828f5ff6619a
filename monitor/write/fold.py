"""Folding a batch of step reports into the state and the store (the ledger calls this inside its
transaction): drop replays, update the per-rank views and counters, let the rule engine record what the
reports show, and write the high-water marks and counter totals, so that a replay is never counted twice.

A report folds in by whom it speaks for (wire 1.4 ``StepReport.scope``). A job of 65,536 ranks cannot
post 65,536 measured reports a step to one collector (per-rank reports at 1,024 ranks already took its
p99 to 73 ms), so the trainer reduces a step's figures across ranks and one
rank posts them (``job``); ranks that differ post their own beside it (``detail``), and every rank posts a
small ``heartbeat`` now and then. Each scope feeds only what it alone knows, so that the same step gives
the same run-level figures whichever way it arrived:

* ``rank`` (every pre-1.4 sender): everything, as before 1.4.
* ``job``: the run-level figures -- site, SDPA, unmeasured and incident counters, the run's non-finite
  count, the logit/headroom/RLHF gauges (``RunState.job``), the first offender (with
  ``first_offender_rank``) -- and the job's skipped steps, which count for every rank it covered (all of
  them took the collective decision); the posting rank is kept live, as by a heartbeat.
* ``detail``: the rank's own view and per-rank counters (non-finite values by rank), and its events; never
  a run-level counter, which the job report of that step already holds.
* ``heartbeat``: liveness only (last report time, mode, directive version, dropped reports); it is not
  kept in the store's high-water marks (it carries no count: a replay cannot double anything).

An evaluation's report (wire 1.5 ``stage="eval"``) counts its non-finite values and SDPA calls (their sites
and calls keep the ``eval`` stage label), keeps the rank live and is kept in the high-water marks like any
report; but it is no training step: it moves neither the run's step nor the rank's training view (mode,
logit bounds, headroom, RLHF: the gauges), and counts no unmeasured step. A report that ``raised`` marks its
rank crashed (``RunState.crashed``): no longer live, the run ends crashed.
"""

from __future__ import annotations

import string
import time
from typing import NamedTuple

from nanwatch.monitor.model.state import (
    ENDED_FAMILY,
    RANK_SERIES,
    RUN_LEVEL_SCOPES,
    CollectorState,
    RankState,
    RunState,
)
from nanwatch.monitor.model.store import EventRow, Store
from nanwatch.monitor.write.rules import RuleEngine, RuleWrites
from nanwatch.readable import printable
from nanwatch.wire import ReportBatch, StepReport, dtype_name, is_half

__all__ = ["Ingested", "apply_report", "fold", "host_label", "is_new"]


class Ingested(NamedTuple):
    """What the collector did with a batch. Replays are acknowledged too: they are ``duplicates``."""

    accepted: int
    duplicates: int


def fold(batch: ReportBatch, *, state: CollectorState, store: Store, rule_engine: RuleEngine,
         into: RuleWrites) -> Ingested:
    """Fold the new reports into memory and write them (inside the caller's transaction)."""
    now, mono = time.time(), time.monotonic()
    accepted = dupes = 0
    hwm_rows: list[tuple[str, int, str, int, int]] = []
    counter_rows: dict[tuple[str, str, tuple], int] = {}
    for r in batch.reports:
        if not is_new(state, r):
            dupes += 1
            continue
        run = state.ensure_run(r.run_id)
        was_ended = run.ended
        rank, previous_mode, changed = apply_report(state, r, received=now, seen=mono)
        if run.ended and not was_ended:  # the last rank the run held ended normally: once per ending
            into.record_event(EventRow(r.run_id, now, "run_ended", f"run_ended:{r.rank}:{r.incarnation}:{r.seq}",
                                       r.rank, r.step, None, "", {"ranks": len(run.ended_ranks)}))
        for fam, labels, value in changed:
            counter_rows[(r.run_id, fam, labels)] = value
        if r.scope != "heartbeat":  # a heartbeat counts nothing: its replay is harmless, so no mark is kept
            # an evaluation's step is the training step it follows: the store's step stays the run's
            step = r.step if r.stage == "train" else state.runs[r.run_id].latest_step
            hwm_rows.append((r.run_id, r.rank, r.incarnation, r.seq, step))
        rule_engine.observe(r, rank, previous_mode, now, into=into)
        accepted += 1
    store.put_hwm(hwm_rows)
    store.put_counters([(*k, v) for k, v in counter_rows.items()])
    # retention counts from the last write; heartbeats alone keep a run live in memory (RunState.touched)
    # without a row write each, and the job's reports, every step, write it
    store.touch({r.run_id for r in batch.reports if r.scope != "heartbeat"}, now)
    return Ingested(accepted, dupes)


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

#: counter rows a report changed: (family, labels, new total), totals exact ints (they never saturate)
Changed = list[tuple[str, tuple, int]]


def is_new(state: CollectorState, r: StepReport) -> bool:
    """False for a replay: the sender delivers in order, so seq <= high-water mark was applied (for a
    heartbeat: seq <= the rank's last heartbeat, kept in memory)."""
    if r.scope == "heartbeat":
        run = state.runs.get(r.run_id)
        held = run.ranks.get(r.rank) if run is not None else None
        return held is None or held.incarnation != r.incarnation or r.seq > held.beat_seq
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


def _exposed(run: RunState, fam: str, labels: tuple) -> bool:
    """Whether a counter series not yet kept was already rendered at 0 by default (so it needs no birth
    render): the run's train-stage non-finite counters, and the per-rank ones of ranks already rendered."""
    if fam in ("nonfinite", "skipped"):
        return int(labels[0]) in run.exposed_ranks
    if fam == "run_nonfinite":
        return labels[2] == "train" and run.exposed
    return fam == "job_skipped" and bool(run.exposed_ranks)


def _apply(state: CollectorState, run: RunState, r: StepReport, *, received: float,
           seen: float) -> tuple[RankState | None, str | None, Changed]:
    run.last_seen = run.touched = seen
    if r.scope == "heartbeat":
        return (*_keep_live(run, r, received=received, seen=seen, beat=True), [])
    key = (r.run_id, r.rank, r.incarnation)
    if key not in state.hwm:
        run.incarnations += 1
    state.hwm[key] = r.seq
    training = r.stage == "train"
    if training:
        run.latest_step = max(run.latest_step, r.step)
    if r.scope != "job":  # a job report speaks for many ranks, and a crash is posted by the rank itself
        run.note_crash(r.rank, r.incarnation, r.raised, r.step)
    changed: Changed = []
    counters, cap = run.counters, state.series_cap

    def bump(fam: str, labels: tuple, n: int) -> None:
        old = counters.get((fam, labels))
        if old is None and not _exposed(run, fam, labels):
            run.newborn.add((fam, labels))  # born at zero: the next render shows 0, then the value
        value = (old or 0) + n  # exact ints: a float total stops counting at 2^53
        counters[(fam, labels)] = value
        changed.append((fam, labels, value))

    run_level = r.scope in RUN_LEVEL_SCOPES
    rank_ok = r.scope in _OWN_SCOPES and run.admit(("rank", r.rank), RANK_SERIES, cap)
    rank_label = str(r.rank)
    headroom: dict[str, float] = {}
    nonfinite = 0
    # dynamic loss scaling handled this step's non-finite gradients: normal operation, counted apart
    overflow = bool(r.scaler_overflow)
    offenders: dict[str, tuple[str, str]] = {}  # by stage: the report's first non-finite site
    for s in r.sites:
        kind = "grad" if s.phase == "backward" else s.kind
        h, cur = s.headroom, headroom.get(kind)
        if cur is None or h > cur or h != h:  # a NaN wins and stays: it must show
            headroom[kind] = h
        if (s.nan or s.inf) and not overflow:
            nonfinite += s.nan + s.inf
            stage = "eval" if r.stage == "eval" else s.stage
            offenders.setdefault(stage, (s.site, s.phase))
            if run_level and run.admit(("site", s.site, s.phase), 1, cap):
                bump("site", (s.site, s.phase), s.nan + s.inf)
            for kind_, n in (("nan", s.nan), ("inf", s.inf)):
                if n and run_level and run.admit(("run_nonfinite", s.phase, kind_, stage), 1, cap):
                    bump("run_nonfinite", (s.phase, kind_, stage), n)
                if n and rank_ok:
                    bump("nonfinite", (rank_label, s.phase, kind_), n)
    if run_level and not overflow and (offenders or r.first_offender):
        _note_latest_offender(run, r, offenders)
    if overflow and r.scope != "heartbeat" and training and run.admit(("loss_scale_overflow",), 1, cap) \
            and run.count_overflow(r.step):
        bump("loss_scale_overflow", (), 1)
    if r.scope != "heartbeat" and training:
        for c in r.sdpa:  # the latest half-precision training call on the math backend, and who ran it
            if c.backend == "math" and c.stage == "train" and is_half(c.dtype):
                run.math_fallback = (c.site, dtype_name(c.dtype), str(r.rank))
    if run_level:
        for c in r.sdpa:
            labels = (c.backend, dtype_name(c.dtype), c.stage)
            if run.admit(("sdpa", *labels), 1, cap):
                bump("sdpa", labels, c.calls)
        for reason in r.coverage.unmeasured if r.coverage is not None and training else ():
            if run.admit(("unmeasured", reason), 1, cap):
                bump("unmeasured", (reason,), 1)
        if r.incident is not None and run.admit(("incident", r.incident.cls), 1, cap):
            bump("incident", (r.incident.cls,), 1)
        if r.incident is not None:
            _note_incident(run, r, cap, bump)
    if r.step_skipped:
        if r.scope == "rank" and rank_ok:
            bump("skipped", (rank_label,), 1)
        elif r.scope == "job" and run.admit(("job_skipped",), 1, cap):
            bump("job_skipped", (), 1)  # every rank it covered skipped it: the exporter adds it to each
    if r.scope == "detail" and not rank_ok or r.scope == "rank" and not rank_ok:
        return None, None, changed
    if not training or r.final:  # the rank is live, and its training view stays what its last step said
        _keep_live(run, r, received=received, seen=seen, beat=False)
        return None, None, changed
    for kind in headroom:
        run.admit(("headroom", kind), 1, cap)
    logits = {lg.layer: lg.bound for lg in r.logits if run.admit(("layer", lg.layer), 1, cap)}
    view = dict(seq=r.seq, step=r.step, time=r.time, received=received, seen=seen, world_size=r.world_size,
                agree_every=r.agree_every, attention_mode=r.attention_mode, directive_version=r.directive_version,
                dropped_reports=r.dropped_reports, nonfinite=nonfinite, first_offender=r.first_offender,
                first_offender_phase=r.first_offender_phase, headroom=headroom, logits=logits, rlhf=r.rlhf,
                crashed=r.raised, loss_scale=r.loss_scale)
    if r.scope == "job":
        view["crashed"] = None
        run.job = RankState(rank=r.rank, incarnation=r.incarnation, scope="job", **view)
        _, previous_mode = _keep_live(run, r, received=received, seen=seen, beat=False)
        return run.job, previous_mode, changed
    prev = run.ranks.get(r.rank)
    same = prev is not None and prev.incarnation == r.incarnation
    # a mode change is one incarnation's: a restarted rank starting on the model's own path reverted nothing
    previous_mode = prev.attention_mode if same else None
    st = RankState(rank=r.rank, incarnation=r.incarnation, scope=r.scope, beat_seq=prev.beat_seq if same else -1,
                   **view)
    run.hold(st, shown=True)
    return st, previous_mode, changed


def _note_incident(run: RunState, r: StepReport, cap: int, bump) -> None:
    """The incident's host and capsule: the run's latest of its class (for the dashboard) and, if the replay
    could not reproduce it, one more not-reproducible incident on its host (the silent-data-corruption
    signal, counted per run and summed over runs by host in the alert)."""
    inc = r.incident
    host = host_label(inc.host) if inc.host else "unknown"
    if inc.cls == "not_reproducible" and run.admit(("not_reproducible", host), 1, cap):
        bump("not_reproducible", (host,), 1)
    if run.admit(("latest_incident", inc.cls), 1, cap):
        who = r.first_offender_rank if r.scope == "job" and r.first_offender_rank is not None else r.rank
        run.latest_incidents[inc.cls] = (host, str(who), printable(inc.capsule or ""))


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
               beat: bool) -> tuple[RankState, str | None]:
    """The rank's liveness from a heartbeat or the job report it posted: a rank with its own view keeps
    its measurements (views are replaced, never mutated: a scrape's snapshot may hold the old one). Built
    field by field: ``dataclasses.replace`` cost a third of a heartbeat's fold (measured)."""
    prev = run.ranks.get(r.rank)
    same = prev is not None and prev.incarnation == r.incarnation
    held = prev if same else _BLANK
    if r.heartbeat_s is not None and r.heartbeat_s > run.heartbeat_s:
        run.heartbeat_s = r.heartbeat_s
    step = held.step if same and r.stage != "train" else r.step  # an evaluation moves no step
    st = RankState(rank=r.rank, incarnation=r.incarnation, seq=r.seq, scope=held.scope, step=step, time=r.time,
                   received=received, seen=seen, world_size=r.world_size,
                   agree_every=r.agree_every if r.agree_every is not None else held.agree_every,
                   attention_mode=r.attention_mode, directive_version=r.directive_version,
                   dropped_reports=r.dropped_reports, nonfinite=held.nonfinite, first_offender=held.first_offender,
                   first_offender_phase=held.first_offender_phase, headroom=held.headroom, logits=held.logits,
                   rlhf=held.rlhf, beat_seq=r.seq if beat else held.beat_seq,
                   crashed=r.raised if r.scope != "job" else held.crashed,
                   loss_scale=r.loss_scale if r.loss_scale is not None else held.loss_scale)
    # per-rank series only for what must be seen by rank: its own view, the job's poster, another mode
    job = run.job
    shown = (held.scope != "beat" or not beat or r.dropped_reports > 0
             or r.attention_mode != (job.attention_mode if job is not None else "none")
             or (job is not None and job.rank == r.rank))
    run.hold(st, shown=shown)
    return st, prev.attention_mode if same else None


#: what a rank known only by its liveness holds (its measurements: none)
_BLANK = RankState(rank=0, incarnation="", seq=-1, scope="beat", step=0, time=0.0, received=0.0, seen=0.0)
