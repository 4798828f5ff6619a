"""The collector's own request counters: reports applied and replayed, requests refused by reason. One
small object, so that each count has one writer: the ledger counts what it applied, and the one refusal
handler (``nanwatch.monitor.web.exception_handlers``) counts what was refused."""

from __future__ import annotations

from collections import Counter

__all__ = ["RequestCounters"]


class RequestCounters:
    """Totals since the process started (they feed ``nanwatch_collector_*_total``)."""

    __slots__ = ("accepted", "duplicates", "rejected")

    def __init__(self) -> None:
        self.accepted = 0
        """Step reports applied to the state."""
        self.duplicates = 0
        """Step reports already applied (replays), acknowledged and ignored."""
        self.rejected: Counter[str] = Counter()
        """Requests refused with a 4xx or 503, by reason."""

    def applied(self, accepted: int, duplicates: int) -> None:
        """A batch was committed: ``accepted`` new reports, ``duplicates`` replays."""
        self.accepted += accepted
        self.duplicates += duplicates

    def reject(self, reason: str) -> None:
        """A request was refused for ``reason``."""
        self.rejected[reason] += 1

    def version(self) -> tuple[int, int, int]:
        """Changes whenever a count does (the exporter reuses a render only while nothing changed)."""
        return self.accepted, self.duplicates, sum(self.rejected.values())
