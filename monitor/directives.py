"""Versioned directives per run, their persistence and audit events, and the long-poll that waits for them.

A change is a new version (``DELETE`` too: it becomes mode ``none``), so a poller that asks for
``index=N`` wakes on any change and never misses one. Waiters are woken through one ``asyncio.Event`` per
run that is replaced on every change; events of runs nobody waits on are dropped, so polling random run
ids cannot grow memory.
"""

from __future__ import annotations

import asyncio
import time

from nanwatch.monitor.state import CollectorState
from nanwatch.monitor.store import EventRow, Store
from nanwatch.wire import Directive, DirectiveSpec

__all__ = ["DirectiveHub"]


class DirectiveHub:
    def __init__(self, *, store: Store, state: CollectorState, margin_steps: int,
                 current: dict[str, Directive] | None = None) -> None:
        self._store = store
        self._state = state
        self._margin = margin_steps
        self._current: dict[str, Directive] = dict(current or {})
        self._wakers: dict[str, asyncio.Event] = {}
        self._waiting: dict[str, int] = {}
        self._closing = False

    def reload(self, current: dict[str, Directive]) -> None:
        """Take the store's directives (after a failed commit)."""
        self._current = dict(current)

    def current(self, run_id: str) -> Directive:
        """The active directive; version 0, mode ``none`` when the run never had one."""
        d = self._current.get(run_id)
        return d if d is not None else Directive(run_id=run_id, version=0, mode="none", apply_at_step=0)

    def set(self, run_id: str, spec: DirectiveSpec, *, actor: str) -> Directive:
        """Record a new version (call inside a store transaction) and wake the run's pollers."""
        cur = self.current(run_id)
        step = spec.apply_at_step
        if step is None:
            step = self._state.run(run_id).latest_step + self._margin
        d = Directive(run_id=run_id, version=cur.version + 1, mode=spec.mode, apply_at_step=step,
                      revert_after_clean_steps=spec.revert_after_clean_steps, reason=spec.reason,
                      set_by=actor, created_at=time.time())
        self._store.put_directive(d)
        kind = "directive_cleared" if spec.mode == "none" else "directive_set"
        self.record(EventRow(run_id, d.created_at, kind, f"directive:{d.version}", step=step, actor=actor,
                             detail={"version": d.version, "mode": d.mode, "reason": d.reason,
                                     "previous_mode": cur.mode, "previous_version": cur.version}))
        self._current[run_id] = d
        waker = self._wakers.pop(run_id, None)
        if waker is not None:
            waker.set()
        return d

    def event_keys(self, run_id: str) -> set[str]:
        return self._state.run(run_id).event_keys

    def record(self, ev: EventRow) -> bool:
        """Append an event unless the run already has one with its dedupe key (inside a transaction)."""
        run = self._state.run(ev.run_id)
        if ev.dedupe in run.event_keys:
            return False
        if self._store.add_event(ev):
            run.event_counts[ev.kind] += 1
            if ev.kind == "first_nonfinite":
                run.first_offender = ev
        run.event_keys.add(ev.dedupe)
        return True

    def close(self) -> None:
        """Server shutdown: answer every long-poll now (with the current directive) instead of letting
        uvicorn cancel them mid-wait once its graceful-shutdown timeout runs out."""
        self._closing = True
        for waker in self._wakers.values():
            waker.set()

    async def wait(self, run_id: str, *, index: int, wait_s: float) -> Directive:
        """Return as soon as the run's directive version exceeds ``index``, else after ``wait_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            d = self.current(run_id)
            remaining = deadline - loop.time()
            if d.version > index or remaining <= 0 or self._closing:
                return d
            waker = self._wakers.get(run_id)
            if waker is None:
                waker = self._wakers[run_id] = asyncio.Event()
            self._waiting[run_id] = self._waiting.get(run_id, 0) + 1
            try:
                await asyncio.wait_for(waker.wait(), remaining)
            except asyncio.TimeoutError:
                pass
            finally:
                left = self._waiting[run_id] - 1
                if left:
                    self._waiting[run_id] = left
                else:
                    del self._waiting[run_id]
                    if self._wakers.get(run_id) is waker and not waker.is_set():
                        del self._wakers[run_id]
