"""The run's event log: first non-finite value, mode changes, rule hits, directive changes. Each event has
a dedupe key, so a condition that persists for hours is one event, not one per step and rank."""

from __future__ import annotations

from nanwatch.monitor.state import CollectorState
from nanwatch.monitor.store import EventRow, Store

__all__ = ["EventLog"]

#: directive changes: the audit trail, never dropped by the events cap (each one is a directive version)
_AUDIT = frozenset({"directive_set", "directive_cleared"})


class EventLog:
    def __init__(self, *, store: Store, state: CollectorState) -> None:
        self._store = store
        self._state = state

    def has(self, run_id: str, dedupe: str) -> bool:
        run = self._state.runs.get(run_id)
        return run is not None and dedupe in run.event_keys

    def record(self, ev: EventRow) -> bool:
        """Append an event unless the run already has one with its dedupe key (inside a transaction)."""
        state = self._state
        run = state.ensure_run(ev.run_id)
        if ev.dedupe in run.event_keys:
            return False
        if len(run.event_keys) >= state.max_events and ev.kind not in _AUDIT:
            state.caps_hit["events"] += 1  # keys may hold client-chosen values: bounded (the audit trail is not)
            return False
        if self._store.add_event(ev):
            run.event_counts[ev.kind] += 1
            if ev.kind == "first_nonfinite":
                run.first_offender = ev
        run.event_keys.add(ev.dedupe)
        return True
