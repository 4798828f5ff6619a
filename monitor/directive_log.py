"""Versioned directives per run, and their persistence.

A change is a new version (``DELETE`` too: it becomes mode ``none``), so a poller that asks for
``index=N`` wakes on any change and never misses one. Each change is also an audit event naming who made
it. Waiting for a change is :mod:`nanwatch.monitor.long_poll`'s job; this module only tells it.
"""

from __future__ import annotations

import time

from nanwatch.monitor.event_log import EventLog
from nanwatch.monitor.long_poll import LongPoll
from nanwatch.monitor.state import CollectorState
from nanwatch.monitor.store import EventRow, Store
from nanwatch.wire import MAX_INT, Directive, DirectiveSpec

__all__ = ["DirectiveLog"]


class DirectiveLog:
    def __init__(self, *, store: Store, state: CollectorState, events: EventLog, polls: LongPoll,
                 margin_steps: int, current: dict[str, Directive] | None = None) -> None:
        self._store = store
        self._state = state
        self._events = events
        self._polls = polls
        self._margin = margin_steps
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

    def set(self, run_id: str, spec: DirectiveSpec, *, actor: str) -> Directive:
        """Record a new version (call inside a store transaction, through ``nanwatch.monitor.atomic``) and
        wake the run's pollers once it has committed."""
        cur = self.current(run_id)
        step = spec.apply_at_step
        if step is None:
            step = min(self._state.next_apply_step(run_id, time.monotonic()) + self._margin, MAX_INT)
        d = Directive(run_id=run_id, version=cur.version + 1, mode=spec.mode, apply_at_step=step,
                      revert_after_clean_steps=spec.revert_after_clean_steps, reason=spec.reason,
                      set_by=actor, created_at=time.time())
        self._store.put_directive(d)
        self._store.touch({run_id}, d.created_at)
        self._state.ensure_run(run_id).touched = time.monotonic()
        kind = "directive_cleared" if spec.mode == "none" else "directive_set"
        self._events.record(EventRow(run_id, d.created_at, kind, f"directive:{d.version}", step=step, actor=actor,
                                     detail={"version": d.version, "mode": d.mode, "reason": d.reason,
                                             "previous_mode": cur.mode, "previous_version": cur.version}))
        self._current[run_id] = d
        self._store.after_commit(lambda: self._polls.notify(run_id))  # a failed commit wakes nobody
        return d

    async def wait(self, run_id: str, *, index: int, wait_s: float) -> Directive:
        """The run's directive as soon as its version exceeds ``index``, else after ``wait_s``."""
        await self._polls.wait(run_id, lambda: self.current(run_id).version > index, wait_s=wait_s)
        return self.current(run_id)
