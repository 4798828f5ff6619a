"""What a scrape asks of the state, as functions of the plain data (``nanwatch.monitor.data.state``): which
ranks get per-rank series now, which are hung, when the next one turns late, and whether anything changed
since the last render. Who is live at all is ``nanwatch.monitor.data.liveness``, shared with the writers.

Example usage::

    live, shown = ranks_view(state, run, time.monotonic(), late_s=120.0)
"""

from __future__ import annotations

import math

from nanwatch.monitor.data.liveness import late_after, ttl
from nanwatch.monitor.data.state import CollectorState, RankState, RunState

__all__ = ["hung", "next_late", "ranks_view", "version"]


def version(state: CollectorState) -> tuple:
    """Changes whenever anything a scrape shows may have: a cached render is reused only while equal."""
    req = state.requests
    return state.writes, req.accepted, req.duplicates, sum(req.rejected.values()), sum(state.caps_hit.values())


def ranks_view(state: CollectorState, run: RunState, now: float, late_s: float) -> tuple[int, list[RankState]]:
    """(live ranks, the ranks with per-rank series now: ``shown`` ones and late ones), walking only the
    silent front of ``ranks`` besides the shown ones."""
    horizon, late_before = now - ttl(state, run), now - late_after(run, late_s)
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


def hung(state: CollectorState, run: RunState, now: float) -> list[tuple[int, float]]:
    """(rank, last report wall time) of the run's ranks silent past their TTL without a final report or a
    crash: the swept ones (``silent``) and those the sweeper has not reached yet (the silent front)."""
    out = [(k, s.received) for k, s in run.silent.items()]
    horizon = now - ttl(state, run)
    for st in run.ranks.values():
        if st.seen >= horizon:
            break
        if st.crashed is None and st.rank not in run.crashed:
            out.append((st.rank, st.received))
    return out


def next_late(run: RunState, now: float, late_s: float) -> float:
    """Monotonic time at which the run's next heartbeat-only rank turns late (/metrics changes then)."""
    late_s = late_after(run, late_s)
    late_before = now - late_s
    for st in run.ranks.values():
        if st.seen >= late_before:
            return st.seen + late_s
    return math.inf
