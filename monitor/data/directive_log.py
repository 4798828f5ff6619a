"""Versioned directives per run, in memory, and waiting for a change.

A change is a new version (``DELETE`` too: it becomes mode ``none``), so a poller that asks for
``index=N`` wakes on any change and never misses one. The ledger (``nanwatch.monitor.write.ledger``) writes a
version to the store, records its audit event and puts it here, and announces it once committed; waiting
is :mod:`nanwatch.monitor.data.long_poll`'s job.

What a transaction puts is *pending* until its COMMIT succeeds (``commit``) and dropped if it fails
(``rollback``): readers (polls, the scrape, ``/v1/runs``) see committed versions only, whatever happens to the
store afterwards (a double fault -- the COMMIT fails, then re-reading the store fails too -- cannot leak a
version that was never committed). Versions never restart for a run id: after a run is forgotten, its next
version is above the store's floor (``Store.directive_floor``), so a poller holding an old index wakes. With
replicas on one PostgreSQL database the floor is the database's: read again when a version is issued and
when a run is re-read (``raise_floor``), since another replica may have forgotten a run meanwhile.
"""

from __future__ import annotations

import time

from nanwatch.monitor.data.long_poll import LongPoll
from nanwatch.wire import Directive, DirectiveSpec

__all__ = ["DirectiveLog"]


class DirectiveLog:
    """The active directive of each run (what polls, the scrape and ``/v1/runs`` answer)."""

    def __init__(self, *, polls: LongPoll, current: dict[str, Directive] | None = None, floor: int = 0) -> None:
        self._polls = polls
        self._current: dict[str, Directive] = dict(current or {})
        self._pending: dict[str, Directive] = {}
        #: every version a forgotten run had is at most this (the store's ``directive_floor``)
        self._floor = floor


    def polled(self, run_id: str) -> bool:
        """Whether a trainer's long-poll waits on the run's directive now."""
        return self._polls.waiting_on(run_id)
    def forget(self, run_ids: list[str]) -> None:
        """The runs' history was deleted (retention, or an admin): their next versions start above the
        highest they had."""
        for run_id in run_ids:
            d = self._current.pop(run_id, None)
            if d is not None:
                self._floor = max(self._floor, d.version)

    def raise_floor(self, floor: int) -> None:
        """The store's floor (``DurableStore.directive_floor``), which another collector replica sharing its
        database may have raised by forgetting a run: never lowered."""
        self._floor = max(self._floor, floor)

    def current(self, run_id: str) -> Directive:
        """The active, committed directive; version 0, mode ``none`` when the run has none."""
        d = self._current.get(run_id)
        return d if d is not None else Directive(run_id=run_id, version=0, mode="none", apply_at_step=0)

    def latest(self, run_id: str) -> Directive:
        """The directive the open transaction would leave (its pending one, else the committed one): what the
        rules and the next version build on, inside the ledger's transaction."""
        d = self._pending.get(run_id)
        return d if d is not None else self.current(run_id)

    def successor(self, run_id: str, spec: DirectiveSpec, *, apply_at_step: int, actor: str) -> Directive:
        """The version that ``spec`` makes of the run's latest one (nothing is written)."""
        version = max(self.latest(run_id).version, self._floor) + 1
        return Directive(run_id=run_id, version=version, mode=spec.mode,
                         apply_at_step=apply_at_step, revert_after_clean_steps=spec.revert_after_clean_steps,
                         reason=spec.reason, set_by=actor, created_at=time.time())

    def put(self, d: Directive) -> None:
        """``d`` is the run's directive once the open transaction commits (the ledger calls this inside it)."""
        self._pending[d.run_id] = d

    def commit(self, run_id: str) -> None:
        """The transaction that put the run's pending version committed: it is the active one, and the run's
        pollers are woken."""
        d = self._pending.pop(run_id, None)
        if d is not None:
            self._current[run_id] = d
        self._polls.notify(run_id)

    def rollback(self) -> None:
        """The open transaction failed: what it put never happened."""
        self._pending.clear()

    async def wait(self, run_id: str, *, index: int, wait_s: float) -> Directive:
        """The run's directive as soon as its version exceeds ``index``, else after ``wait_s``."""
        await self._polls.wait(run_id, lambda: self.current(run_id).version > index, wait_s=wait_s)
        return self.current(run_id)
