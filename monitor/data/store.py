"""SQLite persistence (WAL): what must survive a restart. Events, versioned directives, ingest
high-water marks and counter totals are written in one transaction per ingest request, before the
request is acknowledged, so a crash after the 2xx loses nothing and a resent report is never counted twice.

All calls happen on the event-loop thread (one uvicorn worker); with ``synchronous=NORMAL`` a WAL commit
does not fsync, so a commit costs tens of microseconds and survives a process crash (not a power cut).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import sqlite3
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from nanwatch.monitor.data import schema
from nanwatch.monitor.data.schema import DB_SCHEMA_VERSION, ForeignDatabase
from nanwatch.wire import Directive

log = logging.getLogger("nanwatch.monitor")

#: the schema's version and refusal, importable from here as before (``nanwatch.monitor.data.schema``)
__all__ = ["DB_SCHEMA_VERSION", "DELETE_BATCH", "DatabaseInUse", "EventRow", "ForeignDatabase", "Loaded", "Store"]

#: event rows deleted per transaction when a run is forgotten: each one a few milliseconds of the loop
DELETE_BATCH = 2000
#: ``meta`` key of the directive-version floor: above every version a forgotten run ever had, so a run id
#: that comes back never reuses a version a poller may still hold (one row, whatever the number of runs)
_FLOOR_KEY = "directive_floor"
class DatabaseInUse(ValueError):
    """Another collector holds the database: two writers would each keep their own totals of one run."""


def _lock(path: str) -> int | None:
    """An exclusive, non-blocking ``flock`` on ``<path>.lock``, held until the fd is closed (also by the
    kernel when the process dies, so a kill -9 leaves no stale lock). A sidecar file, not the database:
    SQLite's own locks are POSIX record locks, which must not be mixed with ours on the same file."""
    if path == ":memory:" or path.startswith("file:"):
        return None
    try:
        fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as e:  # a read-only directory: nothing can be written there, by us or another collector
        log.warning("nanwatch: cannot create %s.lock (%s): running without the one-writer lock", path, e)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(fd)
        if isinstance(e, BlockingIOError):
            raise DatabaseInUse(f"{path} is in use by another nanwatch collector (it holds {path}.lock): one "
                                "database, one collector; give this one its own --db") from None
        log.warning("nanwatch: cannot lock %s.lock (%s): running without the one-writer lock", path, e)
        return None
    return fd


@dataclass(slots=True)
class EventRow:
    """One event of a run's log, as stored. ``detail`` is the kind's own record (typed per kind in
    ``nanwatch.monitor.data.event_log``), stored as JSON."""

    run_id: str
    time: float
    kind: str
    dedupe: str
    rank: int | None = None
    step: int | None = None
    site: str | None = None
    actor: str = ""
    detail: Mapping[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class Loaded:
    """Everything read back at start-up."""

    hwm: dict[tuple[str, int, str], int]
    latest_step: dict[str, int]
    counters: list[tuple[str, str, tuple, int]]
    directives: dict[str, Directive]
    event_keys: dict[str, set[str]]
    """Only the dedupe keys that decide something at load time (rank crashes): a run's other keys are looked
    up in the store when asked (``has_event``), so a restart does not hold every event's key in memory."""
    event_counts: dict[tuple[str, str], int]
    first_offenders: dict[str, EventRow]
    #: monotonic time of each run's last write (runs written before this was kept: none, so load time)
    touched: dict[str, float]
    #: the highest directive version of any forgotten run: a run's next version is above it
    directive_floor: int = 0
    #: each run's weight-sync rows, (kind, key, body) (``nanwatch.monitor.data.weight_rows.decode``)
    weights: dict[str, list[tuple[str, str, str]]] = field(default_factory=dict)
    #: runs whose weight rows were left unread: they are what this process last read or wrote (PostgreSQL's
    #: weight revision), so memory keeps its own
    weights_kept: set[str] = field(default_factory=set)


class Store:
    """The collector's SQLite file, a ``DurableStore`` (``nanwatch.monitor.data.durable``, whose contract it
    keeps). ``":memory:"`` keeps everything in memory (tests)."""

    #: what a failed statement or COMMIT raises (the ledger answers 503: retry)
    failures: tuple[type[BaseException], ...] = (sqlite3.Error,)

    def __init__(self, path: str) -> None:
        self._path = path
        self._lock = _lock(path)  # before anything is read: the holder may be mid-write
        try:
            self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        except BaseException:
            self._unlock()
            raise
        self._after: list[Callable[[], None]] | None = None
        try:
            schema.check(self._db, path)
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
        except BaseException:
            self.close()
            raise

    def _unlock(self) -> None:
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def schema_problem(self) -> str | None:
        """None when every table holds its columns, else what is missing (``/readyz`` names it: every
        ingest would fail on it)."""
        return schema.problem(self._db)

    def probe(self) -> str | None:
        """None when the store takes a write now (a one-row transaction), else why not: a full disk, a
        read-only file. ``/readyz`` asks this, so it never says ready while writes fail."""
        try:
            with self.transaction():
                self._db.execute("INSERT OR REPLACE INTO meta VALUES ('probe', datetime('now'))")
        except sqlite3.Error as e:
            return f"{type(e).__name__}: {e}"
        return None

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """One transaction; what ``after_commit`` queued inside it runs once the COMMIT has succeeded, and
        is dropped if anything fails (the COMMIT included: a full disk can refuse it)."""
        self._db.execute("BEGIN")
        self._after = []
        try:
            yield
            self._db.execute("COMMIT")
        except BaseException:
            if self._db.in_transaction:
                self._db.execute("ROLLBACK")
            self._after = None
            raise
        after, self._after = self._after, None
        for fn in after:
            fn()

    def after_commit(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once the open transaction commits (now, outside one): pollers are woken only for
        what the store holds."""
        if self._after is None:
            fn()
        else:
            self._after.append(fn)

    def put_hwm(self, rows: list[tuple[str, int, str, int, int]]) -> None:
        self._db.executemany(
            "INSERT INTO hwm VALUES (?,?,?,?,?) ON CONFLICT (run_id, rank, incarnation) "
            "DO UPDATE SET seq=excluded.seq, step=excluded.step", rows)

    def put_counters(self, rows: list[tuple[str, str, tuple, int]]) -> None:
        """Counter totals, exact: decimal text of a Python int (see ``schema.DB_SCHEMA_VERSION``)."""
        self._db.executemany(
            "INSERT INTO counters VALUES (?,?,?,?) ON CONFLICT (run_id, family, labels) "
            "DO UPDATE SET value=excluded.value",
            [(run, fam, json.dumps(labels), str(int(value))) for run, fam, labels, value in rows])

    def add_event(self, ev: EventRow) -> bool:
        """Insert unless the run already has an event with this dedupe key; True if inserted."""
        cur = self._db.execute(
            "INSERT OR IGNORE INTO events (run_id, time, kind, dedupe, rank, step, site, actor, detail) "
            "VALUES (?,?,?,?,?,?,?,?,?)",
            (ev.run_id, ev.time, ev.kind, ev.dedupe, ev.rank, ev.step, ev.site, ev.actor,
             json.dumps(ev.detail, allow_nan=True)))
        return cur.rowcount == 1

    def touch(self, run_ids: set[str], wall: float) -> None:
        """The runs were written to now: retention counts from here."""
        self._db.executemany("INSERT INTO runs VALUES (?,?) ON CONFLICT (run_id) DO UPDATE SET "
                             "touched=excluded.touched", [(r, wall) for r in run_ids])

    def delete_events(self, run_id: str, *, limit: int = DELETE_BATCH) -> int:
        """Delete up to ``limit`` of the run's events (inside a transaction); returns how many went. The
        events are the one table a run can fill by the hundred thousand: forgetting it in one transaction
        held the loop for seconds, so it goes a batch at a time, before ``delete_runs``."""
        return self._db.execute("DELETE FROM events WHERE id IN (SELECT id FROM events WHERE run_id=? LIMIT ?)",
                                (run_id, limit)).rowcount

    def delete_runs(self, run_ids: list[str]) -> None:
        """Forget the runs' whole history (inside a transaction), and raise the directive-version floor
        above every version they had. The rest of their rows are bounded by the caps (marks, series)."""
        rows = [(r,) for r in run_ids]
        top = max((self._db.execute("SELECT MAX(version) FROM directives WHERE run_id=?", r).fetchone()[0] or 0
                   for r in rows), default=0)
        if top > self.directive_floor():
            self._db.execute("INSERT OR REPLACE INTO meta VALUES (?,?)", (_FLOOR_KEY, str(top)))
        for table in schema.TABLES:
            self._db.executemany(f"DELETE FROM {table} WHERE run_id=?", rows)

    def delete_hwm(self, keys: list[tuple[str, int, str]]) -> None:
        """Forget these (run_id, rank, incarnation) high-water marks (inside a transaction)."""
        self._db.executemany("DELETE FROM hwm WHERE run_id=? AND rank=? AND incarnation=?", keys)

    def put_weights(self, rows: list[tuple[str, str, str, str]]) -> None:
        """Upsert (run_id, kind, key) -> body weight-sync rows (``nanwatch.monitor.data.weight_rows``)."""
        self._db.executemany("INSERT INTO weight_syncs VALUES (?,?,?,?) ON CONFLICT (run_id, kind, key) "
                             "DO UPDATE SET body=excluded.body", rows)

    def delete_weights(self, keys: list[tuple[str, str, str]]) -> None:
        """Delete these (run_id, kind, key) weight-sync rows (inside a transaction)."""
        self._db.executemany("DELETE FROM weight_syncs WHERE run_id=? AND kind=? AND key=?", keys)

    def directive_floor(self) -> int:
        """The highest directive version any forgotten run had (0: none)."""
        row = self._db.execute("SELECT value FROM meta WHERE key=?", (_FLOOR_KEY,)).fetchone()
        return int(row[0]) if row else 0

    def put_directive(self, d: Directive) -> None:
        self._db.execute("INSERT INTO directives VALUES (?,?,?)", (d.run_id, d.version, d.model_dump_json()))

    def has_event(self, run_id: str, dedupe: str) -> bool:
        """Whether the run holds an event with this dedupe key (one lookup in its unique index)."""
        return self._db.execute("SELECT 1 FROM events WHERE run_id=? AND dedupe=?", (run_id, dedupe)).fetchone() \
            is not None

    def events(self, run_id: str, *, limit: int) -> list[EventRow]:
        """The run's most recent events, oldest first."""
        rows = self._db.execute(
            "SELECT run_id, time, kind, dedupe, rank, step, site, actor, detail FROM events "
            "WHERE run_id=? ORDER BY id DESC LIMIT ?", (run_id, limit)).fetchall()
        return [_event(r) for r in reversed(rows)]

    def load(self, run_ids: set[str] | None = None) -> Loaded:
        """What the store holds: of every run (start-up), or of ``run_ids`` alone (the repair after a failed
        write, which costs what those runs hold, not what the whole file does)."""
        db = self._db
        if not {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")} >= set(schema.TABLES):
            return Loaded({}, {}, [], {}, {}, {}, {}, {})  # a read-only fresh file: nothing to read
        if run_ids is not None:
            loaded = Loaded({}, {}, [], {}, {}, {}, {}, {}, self.directive_floor())
            for run_id in sorted(run_ids):
                _read(db, loaded, " WHERE run_id=?", (run_id,))
            return loaded
        loaded = Loaded({}, {}, [], {}, {}, {}, {}, {}, self.directive_floor())
        _read(db, loaded, "", ())
        return loaded

    def close(self) -> None:
        self._db.close()
        self._unlock()


def _event(r: tuple) -> EventRow:
    return EventRow(r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], json.loads(r[8]))


def _read(db: sqlite3.Connection, into: Loaded, where: str, args: tuple) -> None:
    """Add to ``into`` what the store holds of the runs ``where`` selects (all of them: an empty ``where``)."""
    names: dict[str, str] = {}
    one = names.setdefault  # one str object per distinct run id, incarnation, family or label, not per row
    for run, rank, inc, seq, step in db.execute("SELECT * FROM hwm" + where, args):
        run = one(run, run)
        into.hwm[(run, rank, one(inc, inc))] = seq
        if step > into.latest_step.get(run, 0):
            into.latest_step[run] = step
        else:
            into.latest_step.setdefault(run, step)
    into.counters += [(one(run, run), one(fam, fam), tuple(one(x, x) for x in json.loads(lab)), int(val))
                      for run, fam, lab, val in db.execute("SELECT * FROM counters" + where, args)]
    d_where = where.replace("run_id", "d.run_id")
    into.directives.update(
        (run, Directive.model_validate_json(body))
        for run, body in db.execute(
            "SELECT d.run_id, d.body FROM directives d JOIN (SELECT run_id, MAX(version) v FROM directives "
            f"{where} GROUP BY run_id) m ON d.run_id = m.run_id AND d.version = m.v{d_where}", args * 2))
    crashes = " AND kind='rank_crashed'" if where else " WHERE kind='rank_crashed'"
    for run, key in db.execute("SELECT run_id, dedupe FROM events" + where + crashes, args):
        into.event_keys.setdefault(run, set()).add(key)
    into.event_counts.update(((run, kind), n) for run, kind, n in db.execute(
        f"SELECT run_id, kind, COUNT(*) FROM events{where} GROUP BY run_id, kind", args))
    first = " AND kind='first_nonfinite'" if where else " WHERE kind='first_nonfinite'"
    into.first_offenders.update((r[0], _event(r)) for r in db.execute(
        "SELECT run_id, time, kind, dedupe, rank, step, site, actor, detail FROM events" + where + first, args))
    now_wall, now_mono = time.time(), time.monotonic()
    into.touched.update((run, now_mono - max(0.0, now_wall - wall))
                        for run, wall in db.execute("SELECT * FROM runs" + where, args))
    for run, kind, key, body in db.execute("SELECT run_id, kind, key, body FROM weight_syncs" + where, args):
        into.weights.setdefault(one(run, run), []).append((kind, key, body))
