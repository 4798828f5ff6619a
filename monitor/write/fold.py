"""Folding step reports into the collector's memory, one at a time (the ledger calls this inside its
transaction): a report the trainer resent is recognised and left out; a new one updates the per-rank views
and counters, and its fold returns what the store must hold because of it (``Folded``: the counter totals
it changed, its high-water mark, the run's end), gathered over the batch in ``Changes``. The ledger writes
those, and the directive-rule engine's intents, in the same transaction, so that a resend is never counted twice.

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

from dataclasses import dataclass, field

from nanwatch.monitor.data.state import CollectorState, Crash, RankState, RunState
from nanwatch.monitor.data.store import EventRow
from nanwatch.monitor.write.counting import Changed, count_report
from nanwatch.monitor.write.rank_views import settle
from nanwatch.wire import StepReport

__all__ = ["Folded", "Mark", "fold", "is_new"]

#: a high-water mark row for the store: (run_id, rank, incarnation, seq, step)
Mark = tuple[str, int, str, int, int]


@dataclass(slots=True)
class Folded:
    """What one new report changed, for the ledger to write and the directive rules to read (memory already holds it)."""

    rank: RankState | None
    """The view the directive rules read: the rank's, or the job's; None if the rank is capped or the report kept it
    live only."""
    previous_mode: str | None
    """The rank's attention mode before this report (None if unknown)."""
    counters: Changed
    mark: Mark | None
    """The report's high-water mark (None for a heartbeat: it counts nothing, so its resend is harmless)."""
    events: list[EventRow] = field(default_factory=list)
    """Events the fold itself calls for (the run ended), recorded before the directive rules' intents."""


def fold(state: CollectorState, r: StepReport, *, received: float, seen: float) -> Folded | None:
    """Fold one report into memory (its run exists: the ledger made it); returns what the store must hold
    because of it, or None for a resend (``is_new``).

    The report passes three stages, each entered once: here, its high-water mark and what it says of its
    rank's lifecycle; then its counts (``nanwatch.monitor.write.counting``); then its rank's view and the
    rank's and run's end (``nanwatch.monitor.write.rank_views.settle``). Lifecycle (wire 1.6 ``final``): a
    final report ends its rank (its view and per-rank series go at once); a report from an incarnation that
    already ended is counted but holds nothing; once every rank the run held has ended (none held, hung or
    crashed) the run has ended, until a new incarnation reports."""
    if not is_new(state, r):
        return None
    run = state.runs[r.run_id]
    was_ended = run.ended
    if r.final and _foreign(run, r):
        _note_mark(state, run, r)  # its resend is recognised; it ends and holds nothing
        rank, previous_mode, changed = None, None, []
    else:
        run.last_seen = run.touched = seen
        counted = None
        if r.scope != "heartbeat":
            _mark(state, run, r)
            if r.scope == "job" and (run.job_poster is None or r.rank == 0):  # the ledger refused other posters
                run.job_poster = r.rank
            counted = count_report(state, run, r)
        rank, previous_mode, changed = settle(run, r, counted, received=received, seen=seen)
    mark = None
    if r.scope != "heartbeat":
        # an evaluation's step is the training step it follows: the store's step stays the run's
        mark = (r.run_id, r.rank, r.incarnation, r.seq, r.step if r.stage == "train" else run.latest_step)
    folded = Folded(rank, previous_mode, changed, mark)
    if run.ended and not was_ended:  # the last rank the run held ended normally: once per ending
        folded.events.append(EventRow(r.run_id, received, "run_ended", f"run_ended:{r.rank}:{r.incarnation}:{r.seq}",
                                      r.rank, r.step, None, "", {"ranks": len(run.ended_ranks)}))
    return folded


def is_new(state: CollectorState, r: StepReport) -> bool:
    """False for a resend: the sender delivers in order, so seq <= high-water mark was applied (for a
    heartbeat: seq <= the rank's last heartbeat, kept in memory)."""
    if r.scope == "heartbeat":
        run = state.runs.get(r.run_id)
        held = run.ranks.get(r.rank) if run is not None else None
        return held is None or held.incarnation != r.incarnation or r.seq > held.heartbeat_seq
    return r.seq > state.hwm.get((r.run_id, r.rank, r.incarnation), -1)


def _foreign(run: RunState, r: StepReport) -> bool:
    """Whether the rank is held live under another incarnation than the report's: a final report then ends
    nothing (it ends only the rank and incarnation that sent it; a restarted rank's new incarnation reports
    before it ends)."""
    held = run.ranks.get(r.rank)
    return held is not None and held.incarnation != r.incarnation and held.crashed is None


def _mark(state: CollectorState, run: RunState, r: StepReport) -> None:
    """The report's high-water mark and step, and what it says of its rank's lifecycle."""
    _note_mark(state, run, r)
    if r.stage == "train":
        run.latest_step = max(run.latest_step, r.step)
    if r.scope != "job":  # a job report speaks for many ranks, and a crash is posted by the rank itself
        _note_crash(run, r)


def _note_mark(state: CollectorState, run: RunState, r: StepReport) -> None:
    key = (r.run_id, r.rank, r.incarnation)
    if key not in state.hwm:
        run.incarnations += 1
    state.hwm[key] = r.seq


def _note_crash(run: RunState, r: StepReport) -> None:
    """What a report says of its rank's lifecycle: ``raised`` marks it crashed; any report of another
    incarnation (a restart) clears a crash."""
    if r.raised is not None:
        run.crashed[r.rank] = Crash(r.raised, r.incarnation, r.step)
    elif r.rank in run.crashed and run.crashed[r.rank].incarnation != r.incarnation:
        del run.crashed[r.rank]
