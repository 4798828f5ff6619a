"""Memory kept in step with the store: the touched runs read back after a failed write (and, should that read
fail too, nothing answered from memory until one succeeds), and on a shared PostgreSQL database the runs other
replicas wrote re-read: at once for the runs this replica follows, when a request names them for the others.

A replica follows a run that is live here (it took the run's recent reports, and may export its series) or on
whose directive a trainer's long-poll waits here. The others are only marked behind: with N replicas every
write would otherwise be re-read N - 1 times (measured with ``nanwatch bench collector --replicas 2``: a
replica that received nothing spent as much CPU as the one that received every report). A run behind is
re-read when a request names it (``catch_up``, from the app's dependencies) or lists runs, and a write to it
finds it stale inside its transaction and re-reads it there (``Ledger.atomically``).

Example usage::

    sync = MemorySync(store=store, state=state, directive_log=log, weight_syncs=syncs, forgetting=set())
    sync.resync(store.changed_runs())   # the follower, after a NOTIFY
    sync.catch_up({"run-1"})            # a request names run-1
"""

from __future__ import annotations

import logging
import time

from nanwatch.monitor.data.directive_log import DirectiveLog
from nanwatch.monitor.data.durable import DurableStore
from nanwatch.monitor.data.liveness import is_live
from nanwatch.monitor.data.state import CollectorState
from nanwatch.monitor.data.weight_rows import decode_all
from nanwatch.monitor.data.weight_syncs import WeightSyncs
from nanwatch.monitor.write.lifetimes import reload

__all__ = ["MemorySync"]

log = logging.getLogger("nanwatch.monitor")


class MemorySync:
    """The collector's memory against its store (see the module docstring)."""

    def __init__(self, *, store: DurableStore, state: CollectorState, directive_log: DirectiveLog,
                 weight_syncs: WeightSyncs, forgetting: set[str]) -> None:
        self._store, self._state, self._directive_log, self._weight_syncs = store, state, directive_log, weight_syncs
        #: runs whose deletion is under way (the ledger's ``forget``): never re-read meanwhile
        self._forgetting = forgetting
        #: runs a failed write touched while the store could not be re-read: memory may hold what was never
        #: committed; None when memory agrees with the store
        self._unsynced: set[str] | None = None
        #: the (run, rank, incarnation) marks those unsynced writes may have added to memory
        self._unsynced_marks: set[tuple[str, int, str]] = set()
        #: runs other replicas wrote that this one has not re-read, as it does not follow them
        self._behind: set[str] = set()

    @property
    def in_step(self) -> bool:
        """Memory agrees with the store (no failed write waits for its repair)."""
        return self._unsynced is None

    def resync(self, written_elsewhere: set[str] = frozenset()) -> bool:
        """Whether memory agrees with the store: after a failed write whose reload failed too, memory may
        hold what was never committed, until a reload succeeds (tried here: before every write, and before
        every read through the app's dependencies and /readyz, which say "not ready" meanwhile).
        ``written_elsewhere``: runs other collector replicas wrote (``nanwatch.monitor.pg``); between
        requests, never inside a transaction. Those this replica follows are re-read now, the others marked
        behind."""
        if self._unsynced is not None:
            self.restore(self._unsynced, set())
        runs = set(written_elsewhere) - self._forgetting
        followed = {run_id for run_id in runs if self._follows(run_id)}
        self._behind |= runs - followed
        if followed and self._unsynced is None:
            self.restore(followed, set(), keep_views=True)
        return self._unsynced is None

    def catch_up(self, run_ids: set[str] | None = None) -> None:
        """Re-read the runs of ``run_ids`` (None: all) that are behind: a request that names a run (or lists
        them) is answered from what the database holds, within the follow's bound, like a followed run."""
        todo = self._behind if run_ids is None else self._behind & run_ids
        if todo and self._unsynced is None:
            self.restore(set(todo), set(), keep_views=True)

    def _follows(self, run_id: str) -> bool:
        run = self._state.runs.get(run_id)
        return run is not None and is_live(self._state, run, time.monotonic()) or self._directive_log.polled(run_id)

    def restore(self, runs: set[str], marks: set[tuple[str, int, str]], *, keep_views: bool = False) -> None:
        """The touched runs' memory back to what the store holds, read for those runs alone (their per-rank
        latest views come back with their next reports, unless ``keep_views``; other runs are not touched).
        If the store cannot be read, the runs are remembered as unsynced, and ``resync`` tries again.
        Directives need no repair: the failed transaction's were pending, and are dropped
        (``DirectiveLog.rollback``); a newer version another replica committed (a shared database) is taken,
        and wakes this replica's pollers."""
        runs, marks = runs | (self._unsynced or set()), marks | self._unsynced_marks
        try:
            loaded = self._store.load(runs)
        except self._store.failures:
            log.exception("nanwatch collector: could not reload the store after a failed write")
            self._unsynced, self._unsynced_marks = runs, marks
            return
        reload(self._state, loaded, touched=runs, marks=marks, keep_views=keep_views)
        self._behind -= runs
        self._weight_syncs.replace(decode_all(loaded.weights), runs - loaded.weights_kept)
        # a run the store no longer holds was forgotten (by another replica): its directive goes too, and the
        # floor it raised is taken, so no version at or below it is issued here again
        directives = self._directive_log
        directives.forget([r for r in runs if r not in loaded.directives and directives.current(r).version])
        directives.raise_floor(loaded.directive_floor)
        for run_id, d in loaded.directives.items():  # a version another replica issued (a shared database)
            if d.version > directives.current(run_id).version:
                directives.put(d)
                directives.commit(run_id)  # wakes the run's pollers here too
        self._unsynced, self._unsynced_marks = None, set()
        self._state.writes += 1
