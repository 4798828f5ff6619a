"""The one door for every write: reports, directives, events and retention change the store and memory
together, through the ``Ledger`` alone, all or nothing.

Ingest, report by report inside one transaction: the fold changes memory and returns what the store must
hold (``nanwatch.monitor.write.fold``), the directive-rule engine returns its intents (``nanwatch.monitor.write.directive_rules``),
and the ledger carries out both before the next report is folded, so that the directive rules of one report see the
reports before it in the same batch; the batch's marks and counter totals are written at its end. Nothing
below the ledger writes: values come up, and only the ledger applies them.

A request's changes to memory, to the store and to long-pollers happen together after the COMMIT succeeds,
or not at all. Changes are made in memory inside the store's transaction; if anything fails -- the database (a full disk, a read-only
file) or the batch itself (a value the store cannot hold) -- the transaction is rolled back, memory is
reloaded from the store -- the touched runs' rows alone, so a repair costs what those runs hold (bounded by
the caps), not what the whole file does -- and no poller was woken (``DurableStore.after_commit``). The client gets a
503 to retry, or a 422 for a batch that can never be stored, and its retry is applied exactly once. Should the
reload fail too, nothing is answered from memory (503, ``/readyz`` not ready) until one succeeds (``MemorySync.resync``);
directives are safe even then, since readers see only committed versions (``DirectiveLog``).

Forgetting runs (retention, an admin's deletion: ``forget``) deletes their events a batch at a time, yielding
to the loop between batches, then the rest of their rows in one small transaction; writes to a run being
forgotten are refused with a 503 meanwhile, so nothing acknowledged is deleted after it was acknowledged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple, TypeVar

from nanwatch.monitor.data.auth import ANY_NAMESPACE
from nanwatch.monitor.data.directive_log import DirectiveLog
from nanwatch.monitor.data.durable import DurableStore
from nanwatch.monitor.data.event_log import DirectiveChange
from nanwatch.monitor.data.liveness import apply_step
from nanwatch.monitor.data.memory import MemoryBudget
from nanwatch.monitor.data.refusal import CapReached, Refused, StoreUnavailable, Unstorable
from nanwatch.monitor.data.state import Applied, CollectorState, RankState
from nanwatch.monitor.data.store import DELETE_BATCH, EventRow
from nanwatch.monitor.data.weight_syncs import WeightSyncs
from nanwatch.monitor.write import requests
from nanwatch.monitor.write.caps import Caps
from nanwatch.monitor.write.directive_rules import DirectiveRuleEngine, Intents, Issue
from nanwatch.monitor.write.events import EventLog
from nanwatch.monitor.write.fold import Folded, Mark, fold
from nanwatch.monitor.write.lifetimes import (
    ensure_run,
    expired,
    export_only,
    forget,
    forget_incarnations,
    share_views,
    sweep,
)
from nanwatch.monitor.write.memory_sync import MemorySync
from nanwatch.policy import Rule
from nanwatch.wire import MAX_INT, Directive, DirectiveSpec, ReportBatch, StepReport

__all__ = ["Changes", "Ingested", "Ledger"]

log = logging.getLogger("nanwatch.monitor")
T = TypeVar("T")


class Ingested(NamedTuple):
    """What the collector did with a batch. Resent reports are acknowledged too: they are ``duplicates``."""

    accepted: int
    duplicates: int


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


@dataclass(frozen=True, slots=True)
class _Reads:
    """What the directive-rule engine may read while it decides (``DirectiveRuleReads``): memory and the store, with the open
    transaction's pending events and directive versions (the batch's earlier reports' intents)."""

    state: CollectorState
    store: DurableStore
    events: EventLog
    directive_log: DirectiveLog

    def has_event(self, run_id: str, dedupe: str) -> bool:
        """Memory knows the keys recorded since start-up; the store, those before (not all read back)."""
        return self.events.has(run_id, dedupe) or self.store.has_event(run_id, dedupe)

    def directive(self, run_id: str) -> Directive:
        return self.directive_log.latest(run_id)

    def event_count(self, run_id: str, kind: str) -> int:
        run = self.state.runs.get(run_id)
        return run.event_counts[kind] if run is not None else 0

    def witness(self, run_id: str) -> Applied | None:
        run = self.state.runs.get(run_id)
        return run.applied if run is not None else None


class Ledger:
    """Owns the store, the state, the directive and event logs and the directive-rule engine; routes write through
    its public methods and nothing else writes around it. Reads (polls, scrapes, ``/v1/runs``) go to the
    state and the directive log directly, after ``sync.resync``.

    Example usage::

        ledger = Ledger(store=store, state=state, directive_log=DirectiveLog(polls=LongPoll()), directive_rules=rules,
                        logit_tau=100.0, margin_steps=0)
        ledger.ingest(batch)                       # Ingested(accepted=..., duplicates=...)
        ledger.set_directive("run-1", DirectiveSpec(mode="fp32"), actor="alice")
    """

    def __init__(self, *, store: DurableStore, state: CollectorState, directive_log: DirectiveLog, directive_rules: list[Rule],
                 logit_tau: float, margin_steps: int,
                 namespace_of: Callable[[str], str] = lambda _run_id: ANY_NAMESPACE,
                 memory_limit_bytes: int | None = None, max_events: int | None = None,
                 weight_sync_wait_s: float = 120.0, weight_sync_expire_s: float = 21_600.0,
                 weight_bytes_per_namespace: int = 256 << 20, weight_versions_per_namespace: int = 1024) -> None:
        self.store = store
        #: the run-id namespace a run's caps count in (``TokenTable.namespace_of``)
        self.namespace_of = namespace_of
        self.state = state
        self.directive_log = directive_log
        self.directive_rules = DirectiveRuleEngine(directive_rules, logit_tau=logit_tau)
        self._margin = margin_steps
        #: what the run and incarnation caps remember between requests
        self.caps = Caps()
        #: above its limit, nothing new is kept (``nanwatch.monitor.data.memory``); events are bounded in all
        self.budget = MemoryBudget(limit_bytes=memory_limit_bytes, max_events=max_events,
                                   count_events=lambda: sum(len(run.event_keys) for run in state.runs.values()))
        self.events = EventLog(state, store=store, budget=self.budget)
        self._reads = _Reads(state, store, self.events, directive_log)
        #: runs whose deletion is under way (``forget``): writes to them wait for it to end (503)
        self._forgetting: set[str] = set()
        #: each run's recent weight versions and their comparisons (``write.weight_compare``), kept in the store
        #: and read back with the run (``MemorySync.restore``; at start-up, the app's ``weight_rows.decode_all``)
        self.weight_syncs = WeightSyncs(wait_s=weight_sync_wait_s, expire_s=weight_sync_expire_s,
                                        max_bytes_per_namespace=weight_bytes_per_namespace,
                                        max_versions_per_namespace=weight_versions_per_namespace)
        #: memory kept in step with the store: repaired after a failed write, other replicas' writes re-read
        self.sync = MemorySync(store=store, state=state, directive_log=directive_log, weight_syncs=self.weight_syncs,
                               forgetting=self._forgetting)

    # ---- the requests' writes ----------------------------------------------------------------------------

    def ingest(self, batch: ReportBatch) -> Ingested:
        """Apply the batch all or nothing; raises ``CapReached`` (429), ``StoreUnavailable`` (retry) or
        ``Unstorable`` (a value that can never be stored)."""
        runs = {r.run_id for r in batch.reports}
        keys = {(r.run_id, r.rank, r.incarnation) for r in batch.reports if r.scope != "heartbeat"}
        self._make_room(self.caps.check(self.state, batch, keys))
        self._check_caps(keys, runs, {(r.run_id, r.rank, r.incarnation) for r in batch.reports if r.scope == "heartbeat"})
        marks = {(r.run_id, r.rank, r.incarnation) for r in batch.reports}

        def apply() -> Ingested:
            return self._fold(batch)

        # above the memory limit, existing series keep moving; new ones are dropped and counted
        done = self.atomically(runs, marks,
                                (lambda: self._without_new_series(runs, apply)) if self.budget.over() else apply)
        requests.applied(self.state, accepted=done.accepted, duplicates=done.duplicates)
        return done

    def set_directive(self, run_id: str, spec: DirectiveSpec, *, actor: str) -> Directive:
        """A new version, all or nothing: a poller never sees a version the store does not hold."""
        self._check_caps(set(), {run_id})
        return self.atomically({run_id}, set(), lambda: self.issue_directive(run_id, spec, actor=actor))

    def clear_directive(self, run_id: str, *, actor: str) -> Directive:
        """Back to the model's own attention path: a new version with mode ``none``."""
        return self.set_directive(run_id, DirectiveSpec(mode="none", reason="cleared"), actor=actor)

    # ---- the sweeper's ---------------------------------------------------------------------------------

    def sweep(self, now: float) -> int:
        """Forget the latest view of ranks silent past the TTL (memory only: totals stay)."""
        return sweep(self.state, now)

    def export_only(self, run_ids: set[str], recorded: Callable[[str], dict] | None = None,
                    views: Callable[[set[str]], dict[str, dict[int, RankState]]] | None = None) -> None:
        """Show the series of these runs alone (replicas on a shared database: the runs whose lease this one
        holds; ``recorded``: where a newly shown run's series start; ``views``: the views other replicas
        received of these runs' ranks, shown beside this one's), memory only."""
        export_only(self.state, run_ids, recorded)
        if views is not None:
            share_views(self.state, views(set(run_ids)))

    async def retire(self, now: float, retention_s: float, *, limit: int = 1000) -> int:
        """Forget runs past retention (at most ``limit`` a call). Returns how many went."""
        gone = await self.forget(expired(self.state, now, retention_s, limit=limit))
        if gone:
            log.info("nanwatch collector: forgot %d runs past NANWATCH_RUN_RETENTION_S", gone)
        return gone

    async def forget(self, run_ids: list[str]) -> int:
        """Delete the runs' whole history, from the store first, then from memory: their events
        ``DELETE_BATCH`` rows a transaction, yielding to the loop between them (a run of 760k events held
        it 5 s in one), then their marks, counters, directives and retention rows, several runs' worth (about
        ``DELETE_BATCH`` rows, or one run at its caps) a transaction, which also raises the directive-version
        floor. A run already being forgotten is skipped; writes to a run are refused (503, retry) until its
        deletion ends. Returns how many runs went (on a store error, the rest are left for a later call)."""
        todo = [r for r in dict.fromkeys(run_ids) if r not in self._forgetting]
        self._forgetting.update(todo)
        gone, group, rows = 0, [], 0
        try:
            for i, run_id in enumerate(todo):
                while True:
                    with self.store.transaction():
                        n = self.store.delete_events(run_id)
                    await asyncio.sleep(0)
                    if n < DELETE_BATCH:
                        break
                group.append(run_id)
                run = self.state.runs.get(run_id)
                rows += 1 + (run.incarnations + len(run.counters) if run is not None else 0)
                if rows >= DELETE_BATCH or i == len(todo) - 1:
                    with self.store.transaction():
                        self.store.delete_runs(group)
                    forget(self.state, group)  # one pass over memory's marks per group, not per run
                    self.weight_syncs.forget(group)
                    self.directive_log.forget(group)
                    self._forgetting.difference_update(group)
                    gone, group, rows = gone + len(group), [], 0
                    await asyncio.sleep(0)
        except self.store.failures:
            log.exception("nanwatch collector: could not delete %d runs; will retry", len(todo) - gone)
        finally:
            self._forgetting.difference_update(todo)
        return gone

    async def delete_run(self, run_id: str, *, actor: str) -> bool:
        """An admin deletes a run's whole history (``DELETE /v1/runs/{run_id}``) through ``forget``, the path
        retention takes, logged with the actor. False if there is no such run; raises ``StoreUnavailable`` if
        the store refused (what was not deleted is still there: retry)."""
        if not self.sync.resync():
            raise StoreUnavailable("the collector could not re-read its store after a failed write; nothing "
                                   "was deleted, retry")
        if run_id not in self.state.runs:
            return False
        if await self.forget([run_id]) != 1:
            raise StoreUnavailable("could not delete the run (the store refused, or it is being deleted now); "
                                   "retry")
        log.warning("nanwatch collector: run %r deleted by %r", run_id, actor)
        return True

    def _fold(self, batch: ReportBatch) -> Ingested:
        """Fold the batch report by report, carrying out what each calls for before the next is folded, then
        write what the batch changed (inside the caller's transaction)."""
        now, mono = time.time(), time.monotonic()
        changes = Changes()
        for run_id in dict.fromkeys(r.run_id for r in batch.reports):  # a new run is made by its first report
            ensure_run(self.state, run_id)
        for r in batch.reports:
            folded = fold(self.state, r, received=now, seen=mono)
            changes.add(r, folded)
            if folded is None:
                continue
            for ev in folded.events:
                self.events.record(ev)
            self._carry_out(self.directive_rules.observe(r, folded.rank, folded.previous_mode, now, reads=self._reads))
        self.store.put_hwm(changes.marks)
        self.store.put_counters(changes.counter_rows())
        self.store.touch(changes.touched, now)  # retention counts from the last write
        return changes.ingested()

    def _carry_out(self, intents: Intents) -> None:
        """The directive-rule engine's intents, in order: events recorded, directives issued, the auto-revert's witness."""
        for action in intents.actions:
            if isinstance(action, Issue):
                self.issue_directive(action.run_id, action.spec, actor=action.actor)
            else:
                self.events.record(action)
        if intents.witness is not None and (run := self.state.runs.get(intents.run_id)) is not None:
            run.applied = intents.witness

    def record_event(self, ev: EventRow) -> bool:
        """Append an event unless the run already has one with its dedupe key (inside a transaction; the run
        exists in memory). True if it was recorded (``EventLog.record``)."""
        return self.events.record(ev)

    def issue_directive(self, run_id: str, spec: DirectiveSpec, *, actor: str) -> Directive:
        """Record a new version with its audit event (inside a transaction) and wake the run's pollers once
        it has committed."""
        step = spec.apply_at_step
        if step is None:
            step = min(apply_step(self.state, run_id, time.monotonic()) + self._margin, MAX_INT)
        cur = self.directive_log.latest(run_id)
        # the floor as committed now: another replica may have forgotten a run since this one last read it
        self.directive_log.raise_floor(self.store.directive_floor())
        d = self.directive_log.successor(run_id, spec, apply_at_step=step, actor=actor)
        ensure_run(self.state, run_id).touched = time.monotonic()
        kind = "directive_cleared" if spec.mode == "none" else "directive_set"
        audit = DirectiveChange(version=d.version, mode=d.mode, reason=d.reason, previous_mode=cur.mode,
                                previous_version=cur.version)
        self.events.record(EventRow(run_id, d.created_at, kind, f"directive:{d.version}", step=step, actor=actor,
                                    detail=audit))
        self.store.put_directive(d)
        self.store.touch({run_id}, d.created_at)
        self.directive_log.put(d)  # pending: a failed commit is never seen, and wakes nobody
        self.store.after_commit(lambda: self.directive_log.commit(run_id))
        return d

    # ---- all or nothing --------------------------------------------------------------------------------

    def _make_room(self, stale: list[tuple[str, int, str]]) -> None:
        """Forget the high-water marks of incarnations that are no longer live in runs a request would take
        past their incarnation cap (``Caps.stale`` says which, and why that is safe), in a transaction of
        their own, committed before the request's."""
        if not stale:
            return

        def forget() -> None:
            self.store.delete_hwm(stale)
            forget_incarnations(self.state, stale)

        self.atomically({run_id for run_id, _, _ in stale}, set(), forget)
        log.info("nanwatch collector: forgot %d high-water marks of incarnations no longer live, to make room "
                 "under NANWATCH_MAX_INCARNATIONS_PER_RUN", len(stale))

    def _check_caps(self, keys: set[tuple[str, int, str]], run_ids: set[str],
                    heartbeats: set[tuple[str, int, str]] = frozenset()) -> None:
        over = self.caps.over(self.state, keys, run_ids, heartbeats, namespace_of=self.namespace_of)
        if over is not None:
            raise CapReached(over)
        if self.budget.over() and self._grows(keys, run_ids, heartbeats):
            self.state.caps_hit["memory"] += 1
            raise CapReached(f"the collector is above its memory limit ({self.budget.limit_bytes >> 20} MiB, "
                             "NANWATCH_MEMORY_LIMIT_MIB): no new run, incarnation or rank is taken until it is "
                             "below; existing ones are still updated", reason="memory")

    def _grows(self, keys: set[tuple[str, int, str]], run_ids: set[str],
               heartbeats: set[tuple[str, int, str]]) -> bool:
        """Whether a request adds a run, a (run, rank, incarnation) high-water mark or a held rank."""
        state = self.state
        return (any(r not in state.runs for r in run_ids) or any(k not in state.hwm for k in keys)
                or any(run_id not in state.runs or rank not in state.runs[run_id].ranks
                       for run_id, rank, _inc in heartbeats))

    def _without_new_series(self, runs: set[str], write: Callable[[], T]) -> T:
        """``write()`` with no new series (the series cap at 0 while it runs, inside the transaction, so that a
        failed write's reload sees the real cap: admitted series still update), counted when it dropped any."""
        state = self.state
        dropped = sum(state.runs[r].series_dropped for r in runs if r in state.runs)
        cap, state.series_cap = state.series_cap, 0
        try:
            return write()
        finally:
            state.series_cap = cap
            if sum(state.runs[r].series_dropped for r in runs if r in state.runs) > dropped:
                state.caps_hit["memory"] += 1

    def atomically(self, runs: set[str], marks: set[tuple[str, int, str]], write: Callable[[], T]) -> T:
        """``write()`` in one transaction (the ledger's writes, and ``write.weight_compare``'s); ``runs``: the
        runs it may change, ``marks``: the high-water marks it may add (a report's own: what a repair takes
        out of memory without walking every mark)."""
        if not self.sync.resync():
            raise StoreUnavailable("the collector could not re-read its store after a failed write; nothing "
                                   "was applied, retry")
        if runs & self._forgetting:
            raise StoreUnavailable(f"run {sorted(runs & self._forgetting)[0]!r} is being deleted; nothing was "
                                   "applied, retry")
        try:
            try:
                with self.store.transaction():
                    result = write()
            except Exception as e:
                if not getattr(e, "reread_and_retry", False):
                    raise
                # another collector replica wrote these runs (a shared database): re-read them, once, and
                # apply the request to what the database holds, as the client's retry would. This replica's
                # rank views stay (the database holds none: a view the first try replaced is the request's
                # own, applied again next): without them a trainer's weight set would no longer bind here
                self.directive_log.rollback()
                self.sync.restore(runs, marks, keep_views=True)
                if not self.sync.in_step:
                    raise
                with self.store.transaction():
                    result = write()
        except Exception as e:
            self.directive_log.rollback()
            self.sync.restore(runs, marks)
            if isinstance(e, Refused):  # the write's own check refused it (the run as re-read): nothing applied
                raise
            if isinstance(e, (OverflowError, ValueError)) and not isinstance(e, self.store.failures):
                raise Unstorable(f"the request holds a value the collector cannot store ({type(e).__name__}: "
                                 f"{str(e)[:200]}); nothing was applied") from e
            if not isinstance(e, self.store.failures):
                log.exception("nanwatch collector: a write failed and was rolled back")
            raise StoreUnavailable(f"could not persist the request ({type(e).__name__}: {str(e)[:200]}); "
                                   "nothing was applied, retry") from e
        self.state.writes += 1
        return result
