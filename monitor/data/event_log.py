"""The run's event log in memory: first non-finite value, mode changes, rule hits, directive changes. Each
event has a dedupe key, so a condition that persists for hours is one event, not one per step and rank.

This is the memory side only (dedupe keys, counts per kind, the first offender) and the record each kind
keeps in ``EventRow.detail``; the ledger (``nanwatch.monitor.write.ledger``) writes an event to the store and
here together.
"""

from __future__ import annotations

from typing import Any, TypedDict

from nanwatch.monitor.data.state import CollectorState
from nanwatch.monitor.data.store import EventRow

__all__ = ["AUDIT_KINDS", "DirectiveChange", "EventLog", "FirstNonfinite", "ModeChange", "first_nonfinite"]

#: directive changes: the audit trail, never dropped by the events cap (each one is a directive version)
AUDIT_KINDS = frozenset({"directive_set", "directive_cleared"})


class FirstNonfinite(TypedDict, total=False):
    """``first_nonfinite``: where the run's first non-finite value was (``stage`` is missing from events
    stored before it existed: read it as ``train``)."""

    phase: str | None
    stage: str
    nonfinite: int


class ModeChange(TypedDict, total=False):
    """``mode_applied`` / ``mode_reverted``: a rank reported another attention mode."""

    mode: str
    previous_mode: str
    directive_version: int


class DirectiveChange(TypedDict):
    """``directive_set`` / ``directive_cleared``: the audit record of a new directive version."""

    version: int
    mode: str
    reason: str
    previous_mode: str
    previous_version: int


def first_nonfinite(ev: EventRow) -> FirstNonfinite:
    """The detail of a ``first_nonfinite`` event, typed."""
    detail: Any = ev.detail
    return detail


class EventLog:
    """Which events each run holds (by dedupe key) and how many of each kind, in the state."""

    def __init__(self, state: CollectorState) -> None:
        self._state = state

    def has(self, run_id: str, dedupe: str) -> bool:
        """Whether the key was recorded since start-up (keys read back at start are the store's to answer:
        ``Ledger.has_event``)."""
        run = self._state.runs.get(run_id)
        return run is not None and dedupe in run.event_keys

    def admits(self, ev: EventRow) -> bool:
        """Whether ``ev`` is to be recorded: not when its run has one with its dedupe key, nor beyond the
        events cap (counted; directive changes, the audit trail, are always recorded)."""
        state = self._state
        run = state.ensure_run(ev.run_id)
        if ev.dedupe in run.event_keys:
            return False
        if sum(run.event_counts.values()) >= state.max_events and ev.kind not in AUDIT_KINDS:
            state.caps_hit["events"] += 1  # keys may hold client-chosen values: bounded (the audit trail is not)
            return False
        if ev.kind not in AUDIT_KINDS and state.namespace_events.full(state.runs, ev.run_id):
            state.caps_hit["events_per_namespace"] += 1  # one team's events leave the others' share alone
            return False
        return True

    def add(self, ev: EventRow, *, stored: bool) -> None:
        """``ev`` was admitted; ``stored``: whether the store inserted it (else it already held the key)."""
        run = self._state.ensure_run(ev.run_id)
        if stored:
            self._state.namespace_events.stored(ev.run_id)
            if not run.event_counts[ev.kind]:  # a kind new to the run: its events_total series is born at 0
                run.newborn.add(("events", (ev.kind,)))
            run.event_counts[ev.kind] += 1
            if ev.kind == "first_nonfinite":
                run.first_offender_event = ev
        run.event_keys.add(ev.dedupe)
