"""The run's events as records: first non-finite value, mode changes, rule hits, directive changes, each
kind's record in ``EventRow.detail``. Each event has a dedupe key, so a condition that persists for hours is
one event, not one per step and rank.

The records only: the memory side (dedupe keys, counts per kind, the first offender) is written by
``nanwatch.monitor.write.events``, and the ledger (``nanwatch.monitor.write.ledger``) writes an event to the
store and there together.
"""

from __future__ import annotations

from typing import Any, TypedDict

from nanwatch.monitor.data.store import EventRow

__all__ = ["AUDIT_KINDS", "DirectiveChange", "FirstNonfinite", "ModeChange", "first_nonfinite"]

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
