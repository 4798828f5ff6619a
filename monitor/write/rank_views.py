"""The ranks' views, the last stage of the fold (``nanwatch.monitor.write.fold``), entered once per report
(``settle``): a report's training view, a heartbeat's or an evaluation's liveness, a final report's end and
the run's. Views are replaced, never mutated (a scrape's
snapshot may hold the old one); a run keeps its ranks in the order they last reported (``hold``), with the
world sizes and heartbeat intervals they announce counted, so that the run's world size and heartbeat
interval are medians one rank cannot move.

Example usage::

    view, previous_mode, changed = settle(run, report, count_report(state, run, report),
                                          received=time.time(), seen=time.monotonic())
"""

from __future__ import annotations

from nanwatch.monitor.data import report_figures
from nanwatch.monitor.data.metric_table import ENDED_FAMILY
from nanwatch.monitor.data.state import MAX_HEARTBEAT_S, MAX_WORLD_SIZE, RankState, RunState
from nanwatch.monitor.write.counting import OWN_SCOPES, Changed, Counted
from nanwatch.wire import StepReport

__all__ = ["drop", "hold", "settle"]


def settle(run: RunState, r: StepReport, counted: Counted | None, *, received: float,
           seen: float) -> tuple[RankState | None, str | None, Changed]:
    """The rank's view after a new report (``counted``: what counting found; None for a heartbeat), and its
    rank's and run's end. Returns the view the directive rules read (the rank's, or the job's; None if the rank is
    capped or only kept live), the rank's previous attention mode (None if unknown) and the counter rows
    that changed (counting's, and the run's end)."""
    ended_inc = run.ended_ranks.get(r.rank)
    straggler = ended_inc is not None and ended_inc == r.incarnation
    rank, previous_mode, changed = None, None, counted.changed if counted is not None else []
    if counted is None:
        rank, previous_mode = _keep_live(run, r, received=received, seen=seen, heartbeat=True)
    elif r.scope in OWN_SCOPES and not counted.rank_ok:
        pass
    elif r.stage != "train" or r.final:  # the rank is live, and its training view stays what its last step said
        _keep_live(run, r, received=received, seen=seen, heartbeat=False)
    else:
        rank, previous_mode = _training_view(run, r, counted, received=received, seen=seen)
    if r.final or straggler:
        _end_rank(run, r.rank, r.incarnation if r.final else ended_inc)
    elif ended_inc is not None:  # the rank restarted: a new incarnation, no longer ended
        del run.ended_ranks[r.rank]
        run.ended_views.pop(r.rank, None)
    if run.ended and not r.final and not straggler:  # a new incarnation (or rank) revives the run
        run.ended = False
        changed.append((ENDED_FAMILY, (), 0))
    if not run.ended and _all_ended(run):
        run.ended = True
        changed.append((ENDED_FAMILY, (), 1))
    return rank, previous_mode, changed


def _all_ended(run: RunState) -> bool:
    """Every rank the run holds ended normally: none held (live or not yet swept), hung or crashed."""
    return bool(run.ended_ranks) and not run.ranks and not run.silent and not run.crashed


def _training_view(run: RunState, r: StepReport, counted: Counted, *, received: float,
                   seen: float) -> tuple[RankState, str | None]:
    """The rank's (or the job's) view of its latest training step; views are replaced, never mutated."""
    sites = counted.sites
    view = dict(seq=r.seq, step=r.step, time=r.time, received=received, seen=seen,
                world_size=min(r.world_size, MAX_WORLD_SIZE), agree_every=r.agree_every, attention_mode=r.attention_mode, directive_version=r.directive_version,
                dropped_reports=r.dropped_reports, nonfinite=sites.nonfinite, first_offender=r.first_offender,
                first_offender_phase=r.first_offender_phase, headroom=sites.headroom, logits=counted.logits, rlhf=r.rlhf,
                moe=counted.moe, crashed=r.raised, figures=report_figures.read(r))
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
    hold(run, st, shown=True)
    return st, previous_mode


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
                   rlhf=held.rlhf, moe=held.moe, heartbeat_seq=r.seq if heartbeat else held.heartbeat_seq,
                   crashed=r.raised if r.scope != "job" else held.crashed,
                   heartbeat_s=interval_s,
                   # a heartbeat carries liveness only: the loss scale is its step reports' (finding 9 of #27); a
                   # job report's figures are its poster's too, an evaluation's or a final report's are none
                   figures={**held.figures, **report_figures.read(r)} if r.stage == "train" and not heartbeat
                   else held.figures)
    # per-rank series only for what must be seen by rank: its own view, the job's poster, another mode
    job = run.job
    shown = (held.scope != "heartbeat" or not heartbeat or r.dropped_reports > 0
             or r.attention_mode != (job.attention_mode if job is not None else "none")
             or (job is not None and job.rank == r.rank))
    hold(run, st, shown=shown)
    return st, prev.attention_mode if same else None


#: what a rank known only by its liveness holds (its measurements: none)
_BLANK = RankState(rank=0, incarnation="", seq=-1, scope="heartbeat", step=0, time=0.0, received=0.0, seen=0.0)


def _end_rank(run: RunState, rank: int, incarnation: str) -> None:
    """The rank's incarnation sent its final report: its view and series go now."""
    run.ended_ranks[rank] = incarnation
    if rank in run.ranks:
        run.ended_views[rank] = run.ranks[rank]
        drop(run, rank)
    run.silent.pop(rank, None)
    if run.job is not None and run.job.rank == rank:
        run.job = None


def hold(run: RunState, st: RankState, *, shown: bool) -> None:
    """``st`` is the rank's latest view: moved to the end of ``ranks`` (the most recent)."""
    prev = run.ranks.pop(st.rank, None)
    if prev is not None:
        _unworld(run, prev)
    run.ranks[st.rank] = st
    run.silent.pop(st.rank, None)
    run.worlds[st.world_size] += 1
    if st.heartbeat_s:
        run.intervals[st.heartbeat_s] += 1
    if st.heartbeat_s != (prev.heartbeat_s if prev is not None else 0.0):
        _recount_interval(run)
    (run.shown.add if shown else run.shown.discard)(st.rank)

def drop(run: RunState, rank: int) -> None:
    st = run.ranks.pop(rank)
    _unworld(run, st)
    if st.heartbeat_s:
        _recount_interval(run)
    run.shown.discard(rank)

def _unworld(run: RunState, st: RankState) -> None:
    for counted, value in ((run.worlds, st.world_size), (run.intervals, st.heartbeat_s)):
        if counted is run.intervals and not value:
            continue
        counted[value] -= 1
        if not counted[value]:
            del counted[value]

def _recount_interval(run: RunState) -> None:
    """The run's heartbeat interval: the lower median of the held ranks' announced ones (0: none)."""
    n = sum(run.intervals.values())
    if not n:
        run.heartbeat_s = 0.0
        return
    at = (n - 1) // 2
    for value in sorted(run.intervals):
        at -= run.intervals[value]
        if at < 0:
            run.heartbeat_s = value
            return
