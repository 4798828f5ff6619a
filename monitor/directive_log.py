"""Versioned directives per run, in memory, and waiting for a change.

A change is a new version (``DELETE`` too: it becomes mode ``none``), so a poller that asks for
``index=N`` wakes on any change and never misses one. The ledger (``nanwatch.monitor.ledger``) writes a
version to the store, records its audit event and puts it here, and announces it once committed; waiting
is :mod:`nanwatch.monitor.long_poll`'s job.
"""

from __future__ import annotations

import time

from nanwatch.monitor.long_poll import LongPoll
from nanwatch.wire import Directive, DirectiveSpec

__all__ = ["DirectiveLog"]


class DirectiveLog:
    """The active directive of each run (what polls, the scrape and ``/v1/runs`` answer)."""

    def __init__(self, *, polls: LongPoll, current: dict[str, Directive] | None = None) -> None:
        self._polls = polls
        self._current: dict[str, Directive] = dict(current or {})

    def reload(self, current: dict[str, Directive]) -> None:
        """Take the store's directives (after a failed commit)."""
        self._current = dict(current)

    def forget(self, run_ids: list[str]) -> None:
        """The runs' history was deleted (retention)."""
        for run_id in run_ids:
            self._current.pop(run_id, None)

    def current(self, run_id: str) -> Directive:
        """The active directive; version 0, mode ``none`` when the run never had one."""
        d = self._current.get(run_id)
        return d if d is not None else Directive(run_id=run_id, version=0, mode="none", apply_at_step=0)

    def successor(self, run_id: str, spec: DirectiveSpec, *, apply_at_step: int, actor: str) -> Directive:
        """The version that ``spec`` makes of the run's current one (nothing is written)."""
        return Directive(run_id=run_id, version=self.current(run_id).version + 1, mode=spec.mode,
                         apply_at_step=apply_at_step, revert_after_clean_steps=spec.revert_after_clean_steps,
                         reason=spec.reason, set_by=actor, created_at=time.time())

    def put(self, d: Directive) -> None:
        """``d`` is the run's active directive now (the ledger calls this inside its transaction)."""
        self._current[d.run_id] = d

    def announce(self, run_id: str) -> None:
        """Wake the run's pollers (once the version is committed)."""
        self._polls.notify(run_id)

    async def wait(self, run_id: str, *, index: int, wait_s: float) -> Directive:
        """The run's directive as soon as its version exceeds ``index``, else after ``wait_s``."""
        await self._polls.wait(run_id, lambda: self.current(run_id).version > index, wait_s=wait_s)
        return self.current(run_id)
