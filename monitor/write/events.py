"""The run's event log in memory: which events each run holds (by dedupe key), how many of each kind, its
first offender, and the events each run-id namespace holds against its cap. ``EventLog.record`` writes an
event to the store and here together, inside the ledger's transaction; the records themselves are
``nanwatch.monitor.data.event_log``'s.

Example usage::

    events = EventLog(state, store=store, budget=budget)
    events.record(EventRow("run-1", time.time(), "first_nonfinite", "first_nonfinite"))  # True: recorded
"""

from __future__ import annotations

from collections import Counter

from nanwatch.monitor.data.durable import DurableStore
from nanwatch.monitor.data.event_log import AUDIT_KINDS
from nanwatch.monitor.data.memory import MemoryBudget
from nanwatch.monitor.data.state import CollectorState
from nanwatch.monitor.data.store import EventRow

__all__ = ["EventLog", "recount_events"]


def recount_events(state: CollectorState) -> None:
    """Runs went: each namespace's events are counted again from the runs when next asked."""
    state.namespace_events.counted = None


def _namespace_full(state: CollectorState, run_id: str) -> bool:
    """Whether the namespace of ``run_id`` holds its cap of events."""
    ns = state.namespace_events
    if ns.counted is None:
        counted: Counter[str] = Counter()
        for other, run in state.runs.items():
            counted[ns.namespace_of(other)] += sum(run.event_counts.values())
        ns.counted = counted
    return ns.counted[ns.namespace_of(run_id)] >= ns.cap


def _stored(state: CollectorState, run_id: str) -> None:
    """One more event is kept for ``run_id``."""
    ns = state.namespace_events
    if ns.counted is not None:
        ns.counted[ns.namespace_of(run_id)] += 1


class EventLog:
    """Which events each run holds (by dedupe key) and how many of each kind, in the state. An event's run
    exists in memory before it is recorded (the ledger makes it: ``write.lifetimes.ensure_run``)."""

    def __init__(self, state: CollectorState, *, store: DurableStore, budget: MemoryBudget) -> None:
        self._state, self._store, self._budget = state, store, budget

    def record(self, ev: EventRow) -> bool:
        """Append an event unless the run already has one with its dedupe key, to the store and here together
        (inside the ledger's transaction). True if it was recorded."""
        if not self.has(ev.run_id, ev.dedupe) and self._store.has_event(ev.run_id, ev.dedupe):
            self.add(ev, stored=False)  # recorded before start-up: known in memory from now on
            return False
        if not self.admits(ev):
            return False
        budget = self._budget
        if ev.kind not in AUDIT_KINDS and (budget.over() or budget.events_full()):
            self._state.caps_hit["memory" if budget.over() else "total_events"] += 1
            return False
        self.add(ev, stored=self._store.add_event(ev))
        budget.event_added()
        return True

    def has(self, run_id: str, dedupe: str) -> bool:
        """Whether the key was recorded since start-up (keys read back at start are the store's to answer:
        ``has_event`` of the ledger's reads)."""
        run = self._state.runs.get(run_id)
        return run is not None and dedupe in run.event_keys

    def admits(self, ev: EventRow) -> bool:
        """Whether ``ev`` is to be recorded: not when its run has one with its dedupe key, nor beyond the
        events cap (counted; directive changes, the audit trail, are always recorded)."""
        state = self._state
        run = state.runs[ev.run_id]
        if ev.dedupe in run.event_keys:
            return False
        if sum(run.event_counts.values()) >= state.max_events and ev.kind not in AUDIT_KINDS:
            state.caps_hit["events"] += 1  # keys may hold client-chosen values: bounded (the audit trail is not)
            return False
        if ev.kind not in AUDIT_KINDS and _namespace_full(state, ev.run_id):
            state.caps_hit["events_per_namespace"] += 1  # one team's events leave the others' share alone
            return False
        return True

    def add(self, ev: EventRow, *, stored: bool) -> None:
        """``ev`` was admitted; ``stored``: whether the store inserted it (else it already held the key)."""
        run = self._state.runs[ev.run_id]
        if stored:
            _stored(self._state, ev.run_id)
            if not run.event_counts[ev.kind]:  # a kind new to the run: its events_total series is born at 0
                run.newborn.add(("events", (ev.kind,)))
            run.event_counts[ev.kind] += 1
            if ev.kind == "first_nonfinite":
                run.first_offender_event = ev
        run.event_keys.add(ev.dedupe)
