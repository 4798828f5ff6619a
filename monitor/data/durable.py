"""The collector's durable store, as an interface: what the collector asks of it, and what each operation
promises. ``nanwatch.monitor.data.store.Store`` (SQLite, WAL) is one implementation; a second (PostgreSQL,
issue #40) implements the same ``DurableStore`` and nothing above ``data/`` changes.

What is stored: the runs and their retention times, the (run, rank, incarnation) high-water marks of accepted
reports (the dedupe keys), counter totals (incidents are counted there, by class and host, and recorded as
events), events with their dedupe keys, directives and their versions (with a floor above every version a
forgotten run had), and the runs' weight syncs (versions, sets, verdicts, workers: ``data.weight_rows``).

The contract:

* **Atomic.** Every write happens inside ``transaction()``: one ingest request's marks, counters, events,
  directives and retention rows commit together or not at all. A failure (of a statement, or of the COMMIT
  itself) rolls back the whole transaction and raises; what ``after_commit`` queued inside it is then dropped,
  and runs only after a successful COMMIT (so pollers are woken for what the store holds, never more).
* **Idempotent.** ``put_hwm``, ``put_counters``, ``put_weights`` and ``touch`` are upserts: a row is written as the new value,
  never added to (counter totals are exact integers, as decimal text where the engine has no big integers).
  ``add_event`` inserts only if the run holds no event with that dedupe key, and says whether it did, so a
  resent report's events are never stored twice. ``delete_*`` of what is gone is a no-op. ``put_directive``
  is an insert of a new (run, version): versions only grow (``directive_floor``).
* **Failures are typed.** An exception of one of ``failures`` means the store could not do what was asked
  (full disk, read-only file, a lost connection): the collector answers 503 and retries later. Any other
  exception from a write is the request's (a value the store cannot hold): 422.
* **Reads are of committed rows**, except inside a transaction, which sees its own writes (``has_event``
  during an ingest sees the events its earlier reports added).
* **One thread.** Every call comes from the event-loop thread; an implementation needs no lock of its own.

Example usage::

    store: DurableStore = Store(":memory:")
    with store.transaction():
        store.put_hwm([("run-1", 0, "inc-a", 5, 5)])
        store.after_commit(lambda: print("committed"))
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Protocol

from nanwatch.monitor.data.store import EventRow, Loaded
from nanwatch.wire import Directive

__all__ = ["DurableStore"]


class DurableStore(Protocol):
    """What the collector needs of its durable store (see the module docstring for the contract)."""

    #: the exceptions that mean the store failed (503, retry), as opposed to a value it cannot hold (422)
    failures: tuple[type[BaseException], ...]

    # ---- health ------------------------------------------------------------------------------------
    def schema_problem(self) -> str | None:
        """None when the schema holds every table and column the collector writes, else what is missing."""

    def probe(self) -> str | None:
        """None when a write would succeed now (a one-row transaction), else why not (``/readyz``)."""

    # ---- transactions ------------------------------------------------------------------------------
    def transaction(self) -> AbstractContextManager[None]:
        """One transaction, committed on exit, rolled back (and re-raised) on any exception."""

    def after_commit(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once the open transaction commits (at once outside one); dropped if it rolls back."""

    # ---- writes (inside a transaction) -------------------------------------------------------------
    def put_hwm(self, rows: list[tuple[str, int, str, int, int]]) -> None:
        """Upsert (run_id, rank, incarnation) -> (seq, step) high-water marks: the dedupe keys."""

    def delete_hwm(self, keys: list[tuple[str, int, str]]) -> None:
        """Forget these high-water marks (incarnations no longer live, to make room under a cap)."""

    def put_counters(self, rows: list[tuple[str, str, tuple, int]]) -> None:
        """Upsert (run_id, family, labels) -> total, exact (Python ints; they never saturate)."""

    def add_event(self, ev: EventRow) -> bool:
        """Insert unless the run holds an event with ``ev.dedupe``; True if inserted."""

    def put_directive(self, d: Directive) -> None:
        """Insert a directive version (``(run_id, version)`` is unique)."""

    def put_weights(self, rows: list[tuple[str, str, str, str]]) -> None:
        """Upsert (run_id, kind, key) -> body weight-sync rows (``(run_id, kind, key)`` is unique)."""

    def delete_weights(self, keys: list[tuple[str, str, str]]) -> None:
        """Delete these (run_id, kind, key) weight-sync rows (versions dropped, sets compared)."""

    def touch(self, run_ids: set[str], wall: float) -> None:
        """Upsert the runs' last write time (retention counts from it)."""

    def delete_events(self, run_id: str, *, limit: int = ...) -> int:
        """Delete up to ``limit`` of the run's events; returns how many went (the first step of forgetting)."""

    def delete_runs(self, run_ids: list[str]) -> None:
        """Delete the runs' every other row, raising the directive-version floor above their versions."""

    # ---- reads -------------------------------------------------------------------------------------
    def has_event(self, run_id: str, dedupe: str) -> bool:
        """Whether the run holds an event with this dedupe key."""

    def events(self, run_id: str, *, limit: int) -> list[EventRow]:
        """The run's most recent events, oldest first."""

    def directive_floor(self) -> int:
        """The highest directive version any forgotten run had (0: none)."""

    def load(self, run_ids: set[str] | None = None) -> Loaded:
        """What the store holds of every run (start-up), or of ``run_ids`` alone (the repair after a failed
        write): marks, latest steps, counters, latest directives, crash keys, event counts, first offenders,
        retention times, weight-sync rows and the directive floor. A run's weight rows may be left out when
        they are what this store last read or wrote for it (``Loaded.weights_kept``: memory holds them)."""

    def close(self) -> None:
        """Release the store (its connection, its lock)."""
