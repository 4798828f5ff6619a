"""Every write is all or nothing: a request's changes to memory, to SQLite and to long-pollers happen
together after the COMMIT succeeds, or not at all.

Changes are made in memory inside the store's transaction (so that the rules of one report see the
reports before it in the same batch); if anything fails -- the database (a full disk, a read-only file) or
the batch itself (a value SQLite cannot hold) -- the transaction is rolled back, memory is reloaded from
the store, and no poller was woken (``Store.after_commit``). The client gets a 503 to retry, or a 422
for a batch that can never be stored, and its retry is applied exactly once. Should the reload fail too,
nothing is answered from memory (503, ``/readyz`` not ready) until one succeeds (``resync``).
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable
from typing import TypeVar

from nanwatch.monitor.directive_log import DirectiveLog
from nanwatch.monitor.state import CollectorState
from nanwatch.monitor.store import Store

__all__ = ["StoreUnavailable", "Unstorable", "atomically", "resync"]

log = logging.getLogger("nanwatch.monitor")
T = TypeVar("T")


class StoreUnavailable(Exception):
    """Nothing was applied: the store refused the write. The client should retry (503)."""


class Unstorable(Exception):
    """Nothing was applied: the request holds a value the store cannot keep (422)."""


def atomically(store: Store, state: CollectorState, directives: DirectiveLog, runs: set[str],
               write: Callable[[], T]) -> T:
    """``write()`` in one transaction; ``runs``: the runs it may change."""
    if not resync(store, state, directives):
        raise StoreUnavailable("the collector could not re-read its store after a failed write; nothing was "
                               "applied, retry")
    try:
        with store.transaction():
            result = write()
    except Exception as e:
        _restore(store, state, directives, runs)
        if isinstance(e, (OverflowError, ValueError)) and not isinstance(e, sqlite3.Error):
            raise Unstorable(f"the request holds a value the collector cannot store ({type(e).__name__}: "
                             f"{str(e)[:200]}); nothing was applied") from e
        if not isinstance(e, sqlite3.Error):
            log.exception("nanwatch collector: a write failed and was rolled back")
        raise StoreUnavailable(f"could not persist the request ({type(e).__name__}: {str(e)[:200]}); nothing was "
                               "applied, retry") from e
    state.wrote()
    return result


def resync(store: Store, state: CollectorState, directives: DirectiveLog) -> bool:
    """Whether memory agrees with the store: after a failed write whose reload failed too, memory may hold
    what was never committed, until a reload succeeds (tried here: before every write, and by /readyz,
    which says "not ready" meanwhile)."""
    if state.unsynced is not None:
        _restore(store, state, directives, state.unsynced)
    return state.unsynced is None


def _restore(store: Store, state: CollectorState, directives: DirectiveLog, runs: set[str]) -> None:
    """Memory back to what the store holds (the touched runs' per-rank latest views come back with their
    next reports; other runs keep theirs). If the store cannot be read, the runs are remembered as
    unsynced, and ``resync`` tries again."""
    try:
        loaded = store.load()
    except sqlite3.Error:
        log.exception("nanwatch collector: could not reload the store after a failed write")
        state.unsynced = (state.unsynced or set()) | runs
        return
    state.reload(loaded, touched=runs)
    directives.reload(loaded.directives)
    state.unsynced = None
    state.wrote()
