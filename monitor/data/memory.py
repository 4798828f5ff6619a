"""The collector's memory budget (issue #19.11), after the OpenTelemetry Collector's ``memory_limiter``: the
process's resident memory is checked against a soft limit, at most once per ``check_interval_s``; above it,
what would make memory grow for good -- a new run, a new (rank, incarnation), a new series, a new event -- is
refused and counted, while what already exists keeps being updated. The limit sits below the pod's, so the
collector says no before the kernel kills it (a crash loop on the same volume is one OOM away).

Events are bounded globally too (each is ~735 B of disk): the total the collector keeps, over all runs.

Stdlib only: memory is read from ``/proc/self/statm`` and the cgroup's limit from ``/sys/fs/cgroup``; where
neither exists (not Linux), the memory limit is not enforced.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["CGROUP_SHARE", "DEFAULT_LIMIT_MIB", "MemoryBudget", "cgroup_limit_bytes", "default_limit_bytes",
           "resident_bytes"]

#: the limit without a cgroup memory limit (a bare host or ``docker run`` without ``--memory``)
DEFAULT_LIMIT_MIB = 2048
#: the share of the cgroup's memory limit the collector lets itself grow to. Half: a ``/metrics`` render
#: briefly needs about as much again as the series it renders (measured: 157 -> 306 MiB at 200k series), so
#: at 80 % (the OpenTelemetry Collector's hard limit) one scrape could take the pod past its limit.
CGROUP_SHARE = 0.5
#: cgroup v2, then v1 (v1 says "no limit" with a huge number)
_CGROUP_FILES = (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"))
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def cgroup_limit_bytes() -> int | None:
    """This container's memory limit, or None where there is none."""
    for path in _CGROUP_FILES:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:
            return int(text)
        return None
    return None


def default_limit_bytes() -> int:
    """``CGROUP_SHARE`` of the cgroup's memory limit, else ``DEFAULT_LIMIT_MIB``."""
    cgroup = cgroup_limit_bytes()
    return int(cgroup * CGROUP_SHARE) if cgroup is not None else DEFAULT_LIMIT_MIB << 20


def resident_bytes() -> int | None:
    """This process's resident memory now, or None where it cannot be read."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


class MemoryBudget:
    """Says whether the collector may grow: ``over()`` (resident memory above ``limit_bytes``, read at most
    every ``check_interval_s``) and ``events_full()`` (``count_events()`` plus the events added since it was
    last asked, at most every ``check_interval_s`` too, against ``max_events``). ``None`` limits nothing.

    Example usage::

        budget = MemoryBudget(limit_bytes=512 << 20, max_events=1_000_000, count_events=lambda: 0)
        if budget.over(): ...      # refuse new runs, incarnations and series (429, counted)
    """

    def __init__(self, *, limit_bytes: int | None, max_events: int | None = None,
                 count_events: Callable[[], int] = lambda: 0, check_interval_s: float = 1.0,
                 resident: Callable[[], int | None] = resident_bytes) -> None:
        self.limit_bytes = limit_bytes
        self.max_events = max_events
        self._count_events, self._resident, self._interval = count_events, resident, check_interval_s
        self._checked = self._counted = -float("inf")
        self._over = False
        self._events = 0

    def over(self) -> bool:
        """Whether resident memory is above the limit (as of the last check, at most an interval old)."""
        if self.limit_bytes is None:
            return False
        now = time.monotonic()
        if now - self._checked >= self._interval:
            self._checked = now
            rss = self._resident()
            self._over = rss is not None and rss > self.limit_bytes
        return self._over

    def events_full(self) -> bool:
        """Whether the collector holds ``max_events`` events in all (recounted at most every interval)."""
        if self.max_events is None:
            return False
        now = time.monotonic()
        if now - self._counted >= self._interval:
            self._counted = now
            self._events = self._count_events()
        return self._events >= self.max_events

    def event_added(self) -> None:
        """One more event is kept (counted until the next recount)."""
        self._events += 1
