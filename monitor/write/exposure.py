"""What a scrape has shown: the exporter's bookkeeping of series born at zero, of the counters replicas start
from, and of its own render errors. Writes to the state, so they live here (``write`` is the only code that
mutates the collector's state); the exporter in ``read`` is handed this module (it is the exporter's
``Exposure``, wired in ``nanwatch.monitor.app``) and never writes a field itself.

Born at zero: a counter series the fold creates (``counting``, ``events``, ``weight_compare``) is put in its
run's ``newborn``; the next render shows it at 0 and takes it out, the one after shows its value, so that
``increase()`` sees its first event. What a render has shown (``exposed``, ``exposed_ranks``) tells the fold
which series need no birth render.

Example usage::

    born, fresh = exposure.take_run(state, "run-1", run, shown, live=True)   # a render's copy of one run
    exposure.take_collector(state, rejected, caps, runs_consumed=False)      # the collector's own births
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from nanwatch.monitor.data.state import CollectorState, RankState, RunState

__all__ = ["Key", "rendered", "take_collector", "take_counters", "take_run"]

#: a counter's key: (family, labels after run_id)
Key = tuple[str, tuple]


def take_run(state: CollectorState, run_id: str, run: RunState, shown: Sequence[RankState], *,
             live: bool) -> tuple[frozenset[Key], frozenset[int]]:
    """The run's series this render shows for the first time (``born``: shown at 0, their value next time)
    and the ranks it shows for the first time (``fresh``); both marked shown. An event kind's count is
    shown whether or not the run is live (a directive set on an idle run); the rest only while it is."""
    born = frozenset(k for k in run.newborn if k[0] == "events")
    run.newborn.difference_update(born)
    if not live:
        return born, frozenset()
    born, run.newborn = born | run.newborn, set()
    fresh = frozenset(st.rank for st in shown if st.rank not in run.exposed_ranks)
    run.exposed_ranks.update(fresh)
    run.exposed = True
    if run.series_dropped and ("series_dropped", run_id) not in state.exposed:
        state.exposed.add(("series_dropped", run_id))
        born |= {("series_dropped", ())}
    if state.tenures is not None:  # replicas: the tenures start every counter series (born at zero included)
        born = frozenset(k for k in born if k == ("series_dropped", ()))
    return born, fresh


def take_counters(state: CollectorState, run_id: str, run: RunState, *, live: bool) -> tuple[
        dict[Key, int], dict[str, int], dict[Key, int] | None, bool]:
    """(the counters, the event counts a render shows, with replicas the totals that is (this export's
    record), and whether a series was shown at its start below its figure). One collector shows its totals,
    event counts whether or not the run is live (a directive set on an idle run). Replicas: only the run's
    exporter shows its counters and event counts, from where its tenure's series start (``data.tenures``),
    so that a sum of ``increase()`` over replicas counts each increment once."""
    if state.tenures is None:
        return (dict(run.counters) if live else {}), dict(run.event_counts), None, False
    if not live:
        return {}, {}, None, False
    shown, totals, news = state.tenures.show(run_id, {**run.counters, **{("events", (kind,)): n
                                                                          for kind, n in run.event_counts.items()}})
    counters = {k: v for k, v in shown.items() if k[0] != "events"}
    return counters, {k[1][0]: v for k, v in shown.items() if k[0] == "events"}, totals, news


def take_collector(state: CollectorState, rejected: dict[str, int], caps: dict[str, int], *,
                   runs_consumed: bool) -> None:
    """The collector's own counters born at zero: a refusal reason or a cap first shown is set to 0 in this
    render's copies (``rejected``, ``caps``) and marked shown. If any was, or the runs' copies showed a birth
    (``runs_consumed``), the values behind those zeros are news: the state's write count moves, so a cached
    render of them is not reused."""
    consumed = runs_consumed
    for kind, counts in (("rejected", rejected), ("caps", caps)):
        for label in counts:
            if (kind, label) not in state.exposed:
                state.exposed.add((kind, label))
                counts[label] = 0
                consumed = True
    if consumed:
        state.writes += 1


def rendered(state: CollectorState, notes: Mapping[str, int]) -> None:
    """A render's notes (``nanwatch_collector_render_errors_total`` by reason) added to the totals."""
    state.render_errors.update(notes)
