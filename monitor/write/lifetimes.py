"""The runs' lives in memory, as the ledger changes them outside a report's fold: a run made by its first
write (``ensure_run``: the ledger makes a batch's runs before folding it), runs read back from the
store (``restore``, at start-up, and ``reload`` after a failed write), their silent ranks swept past their TTL (``sweep``), their high-water marks or whole history forgotten
(``forget_incarnations``, ``forget``), the runs past retention found (``expired``), and, with replicas on
a shared database, the runs whose series this one shows (``export_only``: the runs whose lease it holds) and
the views of their ranks that other replicas received (``share_views``).

Example usage::

    restore(state, store.load())        # start-up: what the store holds
    sweep(state, time.monotonic())      # the sweeper, every few seconds
"""

from __future__ import annotations

from collections.abc import Callable

from nanwatch.monitor.data.liveness import ttl
from nanwatch.monitor.data.metric_table import ENDED_FAMILY, FAMILIES, RUN_NONFINITE_CALLS, SDPA_CALLS
from nanwatch.monitor.data.state import (
    CRASH_KEY,
    RANK_SERIES,
    CollectorState,
    Crash,
    RankState,
    RunState,
    Silent,
)
from nanwatch.monitor.data.store import Loaded
from nanwatch.monitor.write.counting import admit
from nanwatch.monitor.write.events import recount_events
from nanwatch.monitor.write.rank_views import drop

__all__ = ["ensure_run", "expired", "export_only", "forget", "forget_incarnations", "reload", "restore",
           "share_views", "sweep"]


def ensure_run(state: CollectorState, run_id: str) -> RunState:
    """The run's state, created empty if the run is new (write paths only: ingest, directives, weight syncs)."""
    run = state.runs.get(run_id)
    if run is None:
        run = state.runs[run_id] = RunState(run_id)
    return run


def restore(state: CollectorState, loaded: Loaded) -> None:
    """Add the runs ``loaded`` holds (absent from memory) as the store has them."""
    if state.hwm:
        state.hwm.update(loaded.hwm)
    else:  # start-up: take the marks as read, not a second copy of them (the peak of a restart)
        state.hwm = loaded.hwm
    for run_id, _rank, _inc in loaded.hwm:
        ensure_run(state, run_id).incarnations += 1
    for run_id, step in loaded.latest_step.items():
        ensure_run(state, run_id).latest_step = step
    for run_id, touched in loaded.touched.items():  # monotonic, from the stored wall time
        ensure_run(state, run_id).touched = touched
    for run_id, fam, labels, value in loaded.counters:
        if fam in (SDPA_CALLS.key, RUN_NONFINITE_CALLS.key) and len(labels) == 2:  # stored before their stage label
            labels = (*labels, "train")
        run = ensure_run(state, run_id)
        if fam == ENDED_FAMILY:  # the run's normal end outlives a restart of the collector
            run.ended = value == 1
            continue
        key = (fam, labels)  # a pre-label row and its labelled successor: counters only grow
        run.counters[key] = max(value, run.counters.get(key, value))
        per_rank = fam in FAMILIES and FAMILIES[fam].per_rank
        if per_rank:  # its series were exposed before the restart: shown at once
            run.exposed_ranks.add(int(labels[0]))
        admit(run, ("rank", int(labels[0])) if per_rank else (fam, *labels), RANK_SERIES if per_rank else 1,
                  state.series_cap)
    for run_id, keys in loaded.event_keys.items():
        run = ensure_run(state, run_id)
        run.event_keys.update(keys)
        for key in keys:  # a crash outlives a restart of the collector (a restarted rank clears it)
            parts = key.split(":")
            if parts[0] == CRASH_KEY and len(parts) == 4 and parts[1].isdigit():
                run.crashed[int(parts[1])] = Crash(parts[3], parts[2], -1)
    for (run_id, kind), n in loaded.event_counts.items():
        ensure_run(state, run_id).event_counts[kind] = n
    for run_id, ev in loaded.first_offenders.items():
        ensure_run(state, run_id).first_offender_event = ev
    for run_id in loaded.directives:  # every run the store holds is a run in memory
        ensure_run(state, run_id)
    for run_id in _run_ids(loaded):  # series read back were exposed before: never born again
        ensure_run(state, run_id).exposed = True



def _run_ids(loaded: Loaded) -> set[str]:
    """Every run something was read back for."""
    return {*loaded.latest_step, *loaded.directives, *loaded.event_keys, *loaded.first_offenders, *loaded.touched,
            *loaded.weights,
            *(k[0] for k in loaded.hwm), *(c[0] for c in loaded.counters), *(k[0] for k in loaded.event_counts)}


def reload(state: CollectorState, loaded: Loaded, *, touched: set[str], marks: set[tuple[str, int, str]] | None = None,
           keep_views: bool = False) -> None:
    """Take the store's view of the runs a failed write ``touched`` (``loaded`` holds those runs alone),
    when memory may hold changes the database does not: they lose their per-rank latest views (they come
    back with the next reports); every other run is left as it is, since the write did not change it.
    ``marks``: the only high-water marks the write may have added (else every mark of the touched runs
    is looked for, a walk over all of memory's marks). ``keep_views``: the runs were re-read because
    another collector replica wrote them (a shared database), not after a failed write of this one: their
    per-rank views, this replica's own and all committed, stay (``_VIEWS``)."""
    kept = {r: state.runs[r] for r in touched if r in state.runs} if keep_views else {}
    for run_id in touched:
        state.runs.pop(run_id, None)
    recount_events(state)
    if marks is None:
        state.hwm = {k: v for k, v in state.hwm.items() if k[0] not in touched}
    else:  # the touched runs' other marks are the store's, and ``loaded`` puts them back as stored
        for key in marks:
            state.hwm.pop(key, None)
    restore(state, loaded)
    for run_id, old_run in kept.items():
        run = state.runs.get(run_id)
        if run is not None:  # (a run another replica deleted stays deleted)
            for name in _VIEWS:
                setattr(run, name, getattr(old_run, name))


#: what a run holds that the store does not: the per-rank latest views and what this collector decided from
#: them (``reload(keep_views=True)``)
_VIEWS = ("ranks", "shown", "worlds", "job", "job_poster", "intervals", "heartbeat_s", "last_seen", "newborn",
          "exposed_ranks", "latest_offenders", "latest_incidents", "math_fallback", "counted_once", "latest_spikes",
          "overflow_steps", "ended_ranks", "ended_views", "applied", "silent", "weight_lag")


def forget_incarnations(state: CollectorState, keys: list[tuple[str, int, str]]) -> None:
    """Drop these high-water marks from memory (after the store's were deleted): ``Caps.stale``."""
    for key in keys:
        if state.hwm.pop(key, None) is not None:
            state.runs[key[0]].incarnations -= 1


def sweep(state: CollectorState, now: float) -> int:
    """Forget the latest view of ranks silent past the TTL (totals stay): a rank that neither ended nor
    crashed stays ``silent`` (its last report time exported) for ``silent_keep_s``. Returns how many
    views went."""
    gone = 0
    for run in state.runs.values():
        expired = []
        horizon = now - ttl(state, run)
        for k, st in run.ranks.items():  # in the order they last reported: the silent ones first
            if st.seen >= horizon:
                break
            expired.append(k)
        for rank in expired:
            st = run.ranks[rank]
            if st.crashed is None and rank not in run.crashed:
                run.silent[rank] = Silent(st.received, st.seen, st.incarnation)
            drop(run, rank)
        gone += len(expired)
        if run.silent:
            hung = [k for k, s in run.silent.items() if s.seen < now - state.silent_keep_s]
            for rank in hung:
                del run.silent[rank]
            gone += len(hung)
        if run.job is not None and run.job.seen < now - state.ttl_s:
            run.job = None
            gone += 1
    if gone:
        state.writes += 1
    return gone


def expired(state: CollectorState, now: float, retention_s: float, *, limit: int) -> list[str]:
    """Runs not written to for ``retention_s`` (at most ``limit``, oldest first)."""
    old = [run for run in state.runs.values() if run.touched < now - retention_s]
    old.sort(key=lambda run: run.touched)
    return [run.run_id for run in old[:limit]]


def forget(state: CollectorState, run_ids: list[str]) -> None:
    """Drop the runs from memory (after their history was deleted from the store)."""
    gone = set(run_ids)
    for run_id in run_ids:
        state.runs.pop(run_id, None)
    recount_events(state)
    state.hwm = {k: v for k, v in state.hwm.items() if k[0] not in gone}
    state.exposed -= {("series_dropped", run_id) for run_id in run_ids}
    for run_id in run_ids:
        state.foreign_views.pop(run_id, None)
        if state.tenures is not None:
            state.tenures.forget(run_id)
    state.writes += 1


def export_only(state: CollectorState, run_ids: set[str],
                recorded: Callable[[str], dict[tuple[str, tuple], int]] | None = None) -> None:
    """Show the series of these runs alone (``CollectorState.exported_runs``: replicas on a shared PostgreSQL
    database, each showing the runs whose lease it holds, ``nanwatch.monitor.pg.leases``); a change makes a
    cached render stale. A run newly shown begins a tenure from the totals its last export showed
    (``recorded(run_id)``, ``data.tenures``); one no longer shown ends its tenure and drops the views of its
    ranks from other replicas."""
    if run_ids == state.exported_runs:
        return
    before = state.exported_runs or set()
    if state.tenures is not None:
        for run_id in before - run_ids:
            state.tenures.end(run_id)
            state.foreign_views.pop(run_id, None)
        for run_id in sorted(run_ids - before):
            state.tenures.begin(run_id, recorded(run_id) if recorded is not None else {})
    state.exported_runs = set(run_ids)
    state.writes += 1


def share_views(state: CollectorState, views: dict[str, dict[int, RankState]]) -> None:
    """Adopt the latest views other replicas received of the exported runs' ranks (by run, then rank; -1 the
    job view): ``CollectorState.foreign_views``, shown beside this replica's own."""
    changed = False
    for run_id, ranks in views.items():
        if state.exported_runs is None or run_id not in state.exported_runs or run_id not in state.runs:
            continue
        state.foreign_views.setdefault(run_id, {}).update(ranks)
        changed = True
    if changed:
        state.writes += 1
