"""Which ranks a run holds live, and whose word it takes: the one definition that the writers (a
directive's ``apply_at_step``: ``apply_step``) and the readers (a scrape, ``GET
/v1/runs``, the rollout figures) share. Pure functions of the plain state (``nanwatch.monitor.data.state``):
``write`` and ``read`` are siblings that never import each other, so what both ask lives here, below both.

Example usage::

    live = live_ranks(state, run, time.monotonic())     # the ranks within their TTL, crashed ones excepted
    view = vouched_view(state, run, time.monotonic())   # the live rank whose step the run can vouch for
"""

from __future__ import annotations

from nanwatch.monitor.data.state import MAX_AGREE_EVERY, STEP_SLACK, CollectorState, RankState, RunState
from nanwatch.policy import next_apply_step
from nanwatch.wire import MAX_INT

__all__ = ["apply_step", "held_ranks", "is_live", "late_after", "live_job", "live_ranks", "ttl", "vouched_view",
           "world_size"]


def ttl(state: CollectorState, run: RunState) -> float:
    """How long a rank of ``run`` stays live after its last report: the TTL, or three heartbeats."""
    return max(state.ttl_s, 3 * run.heartbeat_s)


def late_after(run: RunState, late_s: float) -> float:
    """How long a heartbeat-only rank of ``run`` may be silent before it is late: ``late_s``, or two heartbeats."""
    return max(late_s, 2 * run.heartbeat_s)


def held_ranks(state: CollectorState, run: RunState, now: float) -> list[RankState]:
    """Ranks whose latest view is within the TTL, crashed ones included (the run view lists them)."""
    horizon = now - ttl(state, run)
    return [st for st in run.ranks.values() if st.seen >= horizon]


def live_ranks(state: CollectorState, run: RunState, now: float) -> list[RankState]:
    """Ranks that reported within the TTL, crashed ones excepted (a rank whose step raised is not live,
    whatever it sent as it went down)."""
    horizon = now - ttl(state, run)
    return [st for st in run.ranks.values() if st.seen >= horizon and st.crashed is None]


def live_job(state: CollectorState, run: RunState, now: float) -> RankState | None:
    """The run's latest job report's view, while within the TTL (job mode's run-level gauges)."""
    job = run.job
    return job if job is not None and job.seen >= now - state.ttl_s else None


def is_live(state: CollectorState, run: RunState, now: float) -> bool:
    return run.last_seen >= now - state.ttl_s


def vouched_view(state: CollectorState, run: RunState, now: float) -> RankState | None:
    """The live rank whose step the run can vouch for: rank 0 (whose agreement every rank follows) unless
    its step runs more than ``STEP_SLACK`` ahead of every other live rank's; else the live rank of the
    lower median step, which one lying rank among honest ones cannot move up. None with no live rank."""
    live = live_ranks(state, run, now)
    if not live:
        return None
    zero = next((st for st in live if st.rank == 0), None)
    others = [st.step for st in live if st.rank != 0]
    if zero is not None and (not others or zero.step <= max(others) + STEP_SLACK):
        return zero
    live.sort(key=lambda st: st.step)
    return live[(len(live) - 1) // 2]


def world_size(state: CollectorState, run: RunState, now: float) -> int:
    """The run's world size: the live job report's (its poster speaks for the job), else rank 0's latest
    view, else the most common one among the held ranks (ties: the smaller). One made-up rank cannot raise
    it beyond what real ranks then correct (a max over ranks could: one heartbeat said 2^53-1)."""
    job = live_job(state, run, now)
    if job is not None:
        return job.world_size
    zero = run.ranks.get(0)
    if zero is not None:
        return zero.world_size
    return min(run.worlds.items(), key=lambda kv: (-kv[1], kv[0]), default=(1, 0))[0]


def apply_step(state: CollectorState, run_id: str, now: float) -> int:
    """The earliest step every rank can apply a directive at, from the live ranks the run can vouch for
    (steps count per incarnation: a restarted job counts from 0 again, and a rank that went silent
    does not hold the step up): the next step for one rank; under torch.distributed the next agreement
    step (ranks agree every ``agree_every`` steps and switch together there).

    One report must not push it out of reach (#19): the step and cadence are those of ``vouched_view``,
    and a cadence beyond ``MAX_AGREE_EVERY`` is not believed (the next step is asked for instead). Too
    early is harmless -- a trainer applies a directive at the first step >= ``apply_at_step`` once its
    ranks have agreed on it -- too late is not."""
    run = state.runs.get(run_id)
    view = vouched_view(state, run, now) if run is not None else None
    if view is None:
        return next_apply_step(0, world_size=1, agree_every=None)
    every = view.agree_every if view.agree_every is not None and view.agree_every <= MAX_AGREE_EVERY else None
    return min(next_apply_step(view.step, world_size=view.world_size, agree_every=every), MAX_INT)
