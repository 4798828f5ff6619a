"""The collector's request counters (``nanwatch_collector_reports_*_total``, ``..._requests_rejected_total``):
the ledger counts what a batch applied, the web layer what it refused.

Example usage::

    requests.applied(state, accepted=16, duplicates=0)
    requests.rejected(state, "body_invalid")
"""

from __future__ import annotations

from nanwatch.monitor.data.state import CollectorState

__all__ = ["applied", "rejected"]


def applied(state: CollectorState, *, accepted: int, duplicates: int) -> None:
    """A batch was committed: ``accepted`` new reports, ``duplicates`` resent ones."""
    state.requests.accepted += accepted
    state.requests.duplicates += duplicates


def rejected(state: CollectorState, reason: str) -> None:
    """A request was refused for ``reason``."""
    state.requests.rejected[reason] += 1
