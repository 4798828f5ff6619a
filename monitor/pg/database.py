"""The collector's durable state in PostgreSQL (``--database-url``): a ``DurableStore``
(``nanwatch.monitor.data.durable``) as the SQLite ``Store`` is, method for method, so the ledger writes
through either. Plain SQL over psycopg 3; connections come from a psycopg_pool pool, which replaces one the
server dropped (a restart, a failover), and a transaction holds its connection from BEGIN to COMMIT.

What replicas need on top, inside the same transactions (docs/replicas.md):

* every write of a run bumps its revision in ``runs`` (``touch``), under that row's lock. A replica that
  finds a revision other than the one it last read or wrote has an older memory of the run than the
  database: its transaction raises ``StaleRun`` and rolls back, the ledger re-reads the run (``load``,
  which records the revision it read) and applies the request again, once (then 503, and the client
  retries), now folded against the database's truth -- a resend already accepted elsewhere is then a duplicate, a total never overwrites
  another replica's increments, and a directive version is never issued twice;
* events keep their unique (run_id, dedupe) key and directives their (run_id, version) key: a second
  replica's insert of either conflicts, whatever its memory says;
* ``changed_runs`` lists the runs whose revision moved under this replica (another replica wrote them):
  the app re-reads them on a short period, and when ``NOTIFY nanwatch_runs`` (sent by every commit that
  touched a run) wakes it.

All calls happen on the event-loop thread, as the SQLite store's do: each is one round trip on loopback.
Errors come out as ``StoreError``, the store's ``failures`` (``DurableStore``): the ledger's handling of a
failed write (roll back, re-read, 503) is the same for both stores.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from urllib.parse import urlsplit, urlunsplit

import psycopg
import psycopg_pool

from nanwatch.monitor.data.store import DELETE_BATCH, EventRow, Loaded
from nanwatch.monitor.pg import migrations
from nanwatch.wire import Directive

__all__ = ["NOTIFY_CHANNEL", "PgStore", "StaleRun", "StoreError", "redact"]

log = logging.getLogger("nanwatch.monitor")

_FLOOR_KEY = "directive_floor"
#: the channel every commit that touched a run notifies, with the run ids as payload
NOTIFY_CHANNEL = "nanwatch_runs"
#: a NOTIFY payload is at most 8000 bytes: longer lists of runs are cut, and the poll catches the rest
_PAYLOAD_MAX = 7000


class StoreError(Exception):
    """The database refused or could not be reached (the psycopg error is its ``__cause__``)."""


class StaleRun(StoreError):
    """Another replica wrote the run since this one last read it: re-read it, and retry (the ledger does,
    once, inside the request; a second conflict is the client's 503)."""

    reread_and_retry = True


def redact(url: str) -> str:
    """The URL without its password, for messages and logs."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<an unparsable database URL>"
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


@contextmanager
def _errors() -> Iterator[None]:
    try:
        yield
    except (psycopg.Error, psycopg_pool.PoolTimeout) as e:
        raise StoreError(f"{type(e).__name__}: {e}") from e


class _Connections:
    """The pool, and the open transaction's connection: inside a transaction every statement goes on it,
    outside one each takes a connection from the pool for itself."""

    def __init__(self, pool: psycopg_pool.ConnectionPool) -> None:
        self.pool = pool
        self.conn: psycopg.Connection | None = None

    @contextmanager
    def connection(self) -> Iterator[psycopg.Connection]:
        if self.conn is not None:
            yield self.conn
            return
        with _errors(), self.pool.connection() as conn:
            yield conn

    def execute(self, sql: str, args: tuple | list = ()) -> psycopg.Cursor:
        with _errors(), self.connection() as conn:
            return conn.execute(sql, args)

    def executemany(self, sql: str, rows: list) -> None:
        if rows:
            with _errors(), self.connection() as conn, conn.cursor() as cur:
                cur.executemany(sql, rows)


class PgStore:
    """The collector's PostgreSQL database. Opening it checks (creates, upgrades) the schema; raises
    ``ValueError`` naming the URL without its password when the server cannot be reached or the database
    is not one this collector can use."""

    #: what a write or a read that failed in the database raises (the ledger's ``DurableStore.failures``)
    failures: tuple[type[BaseException], ...] = (StoreError,)

    def __init__(self, url: str, *, connect_timeout_s: float = 10.0, pool_size: int = 4,
                 schema_upto: int = migrations.PG_SCHEMA_VERSION) -> None:
        self.url, self.where = url, redact(url)
        self._pool = psycopg_pool.ConnectionPool(
            url, min_size=1, max_size=pool_size, open=False, name="nanwatch",
            kwargs={"autocommit": True, "connect_timeout": max(1, int(connect_timeout_s))})
        try:
            self._pool.open(wait=True, timeout=connect_timeout_s)
        except (psycopg.Error, psycopg_pool.PoolTimeout) as e:
            self._pool.close()
            raise ValueError(f"cannot reach the database {self.where} within {connect_timeout_s:g} s "
                             f"({type(e).__name__}: {e})") from None
        try:
            with self._pool.connection() as conn:
                self.schema_found = migrations.check(conn, self.where, upto=schema_upto)
        except psycopg.Error as e:
            self._pool.close()
            raise ValueError(f"cannot use the database {self.where}: {type(e).__name__}: {e}") from None
        except BaseException:
            self._pool.close()
            raise
        self._db = _Connections(self._pool)
        self._after: list[Callable[[], None]] | None = None
        #: each run's revision as this replica last read or wrote it
        self._revs: dict[str, int] = {}
        #: revisions the open transaction set, kept once it commits
        self._pending_revs: dict[str, int] = {}
        #: each run's weight-sync revision (``runs.wrev``, bumped by a write that changed its weight rows) as
        #: this process last read or wrote the rows: a re-read skips the rows of a run whose revision is this
        #: one (they are what memory holds: a run's re-read after another replica's report costs no weights)
        self._wrevs: dict[str, int] = {}
        self._pending_wrevs: dict[str, int] = {}
        #: runs whose weight rows the open transaction wrote
        self._weights_written: set[str] = set()

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """One transaction on one connection; what ``after_commit`` queued runs once COMMIT succeeded."""
        self._after, self._pending_revs, self._pending_wrevs, self._weights_written = [], {}, {}, set()
        try:
            with _errors(), self._pool.connection() as conn, conn.transaction():
                self._db.conn = conn
                try:
                    yield
                finally:
                    self._db.conn = None
        except BaseException:
            self._after, self._pending_revs = None, {}
            # memory may now hold weight syncs no row holds (the ledger re-reads what the write touched): the
            # next re-read of any run reads its weight rows whole, once
            self._wrevs.clear()
            raise
        self._revs.update(self._pending_revs)
        self._wrevs.update(self._pending_wrevs)
        after, self._after, self._pending_revs = self._after, None, {}
        for fn in after:
            fn()

    def after_commit(self, fn: Callable[[], None]) -> None:
        if self._after is None:
            fn()
        else:
            self._after.append(fn)

    # ---- health -------------------------------------------------------------------------------------

    def schema_problem(self) -> str | None:
        try:
            with _errors(), self._db.connection() as conn:
                return migrations.problem(conn)
        except StoreError as e:
            return str(e)

    def probe(self) -> str | None:
        try:
            with self.transaction():
                self._db.execute("INSERT INTO meta VALUES ('probe', now()::text) ON CONFLICT (key) "
                           "DO UPDATE SET value = excluded.value")
        except StoreError as e:
            return str(e)
        return None

    # ---- writes (inside a transaction) --------------------------------------------------------------

    def put_hwm(self, rows: list[tuple[str, int, str, int, int]]) -> None:
        self._db.executemany("INSERT INTO hwm VALUES (%s,%s,%s,%s,%s) ON CONFLICT (run_id, rank, incarnation) "
                   "DO UPDATE SET seq = excluded.seq, step = excluded.step", rows)

    def put_counters(self, rows: list[tuple[str, str, tuple, int]]) -> None:
        """Counter totals, exact (``NUMERIC``)."""
        self._db.executemany("INSERT INTO counters VALUES (%s,%s,%s,%s) ON CONFLICT (run_id, family, labels) "
                   "DO UPDATE SET value = excluded.value",
                   [(run, fam, json.dumps(labels), int(value)) for run, fam, labels, value in rows])

    def add_event(self, ev: EventRow) -> bool:
        cur = self._db.execute(
            "INSERT INTO events (run_id, time, kind, dedupe, rank, step, site, actor, detail) "
            "VALUES (%s,%s,%s,%s,%s,%s,%s,%s,%s) ON CONFLICT (run_id, dedupe) DO NOTHING",
            (ev.run_id, ev.time, ev.kind, ev.dedupe, ev.rank, ev.step, ev.site, ev.actor,
             json.dumps(ev.detail, allow_nan=True)))
        return cur.rowcount == 1

    def touch(self, run_ids: set[str], wall: float) -> None:
        """The runs were written to now: retention counts from here, and each run's revision moves on by
        one under its row lock. A revision other than the next of the one this replica knows means
        another replica wrote the run meanwhile: ``StaleRun`` (the transaction rolls back)."""
        for run_id in sorted(run_ids):  # one order for every replica: two never wait on each other's rows
            bump = int(run_id in self._weights_written)
            rev, wrev = self._db.execute(
                "INSERT INTO runs (run_id, touched, rev, wrev) VALUES (%s,%s,1,%s) ON CONFLICT (run_id) DO UPDATE "
                "SET touched = excluded.touched, rev = runs.rev + 1, wrev = runs.wrev + excluded.wrev "
                "RETURNING rev, wrev", (run_id, wall, bump)).fetchone()
            known = self._pending_revs.get(run_id, self._revs.get(run_id, 0))
            if rev != known + 1:
                raise StaleRun(f"run {run_id!r} was written by another replica (revision {rev - 1}, this one "
                               f"knew {known}): re-read, retry")
            self._pending_revs[run_id] = rev
            if bump or run_id in self._wrevs:  # (unknown rows stay unknown until read)
                self._pending_wrevs[run_id] = wrev
        if run_ids:
            payload = ",".join(sorted(run_ids))
            self._db.execute("SELECT pg_notify(%s, %s)", (NOTIFY_CHANNEL, payload if len(payload) <= _PAYLOAD_MAX else ""))

    def delete_events(self, run_id: str, *, limit: int = DELETE_BATCH) -> int:
        return self._db.execute("DELETE FROM events WHERE id IN (SELECT id FROM events WHERE run_id = %s LIMIT %s)",
                          (run_id, limit)).rowcount

    def delete_runs(self, run_ids: list[str]) -> None:
        top = self._db.execute("SELECT MAX(version) FROM directives WHERE run_id = ANY(%s)", (run_ids,)).fetchone()[0] or 0
        # GREATEST: a floor another replica raised meanwhile never goes down
        self._db.execute("INSERT INTO meta VALUES (%s, %s) ON CONFLICT (key) DO UPDATE SET value = "
                   "GREATEST(meta.value::bigint, excluded.value::bigint)::text", (_FLOOR_KEY, str(top)))
        for table in ("events", "directives", "hwm", "counters", "weight_syncs", "runs"):
            self._db.execute(f"DELETE FROM {table} WHERE run_id = ANY(%s)", (run_ids,))
        for run_id in run_ids:
            self._revs.pop(run_id, None)
            self._wrevs.pop(run_id, None)

    def delete_hwm(self, keys: list[tuple[str, int, str]]) -> None:
        self._db.executemany("DELETE FROM hwm WHERE run_id = %s AND rank = %s AND incarnation = %s", keys)

    def put_weights(self, rows: list[tuple[str, str, str, str]]) -> None:
        """Weight-sync rows, upserted: written, like the counters, only by a replica whose memory of the run
        holds every committed write of it (the revision check of ``touch``, which the ledger calls in the same
        transaction, and which bumps the run's weight revision)."""
        self._weights_written.update(r[0] for r in rows)
        self._db.executemany("INSERT INTO weight_syncs VALUES (%s,%s,%s,%s) ON CONFLICT (run_id, kind, key) "
                             "DO UPDATE SET body = excluded.body", rows)

    def delete_weights(self, keys: list[tuple[str, str, str]]) -> None:
        self._weights_written.update(k[0] for k in keys)
        self._db.executemany("DELETE FROM weight_syncs WHERE run_id = %s AND kind = %s AND key = %s", keys)

    def put_directive(self, d: Directive) -> None:
        """A new version; a version another replica already issued conflicts on the primary key: this
        replica's memory of the run is stale (``StaleRun``: re-read, and the next version is above it)."""
        try:
            self._db.execute("INSERT INTO directives VALUES (%s,%s,%s)", (d.run_id, d.version, d.model_dump_json()))
        except StoreError as e:
            if isinstance(e.__cause__, psycopg.errors.UniqueViolation):
                raise StaleRun(f"run {d.run_id!r}: directive version {d.version} was issued by another replica; "
                               "re-read, retry") from e.__cause__
            raise

    # ---- reads --------------------------------------------------------------------------------------

    def directive_floor(self) -> int:
        row = self._db.execute("SELECT value FROM meta WHERE key = %s", (_FLOOR_KEY,)).fetchone()
        return int(row[0]) if row else 0

    def has_event(self, run_id: str, dedupe: str) -> bool:
        return self._db.execute("SELECT 1 FROM events WHERE run_id = %s AND dedupe = %s", (run_id, dedupe)).fetchone() \
            is not None

    def events(self, run_id: str, *, limit: int) -> list[EventRow]:
        rows = self._db.execute("SELECT run_id, time, kind, dedupe, rank, step, site, actor, detail FROM events "
                          "WHERE run_id = %s ORDER BY id DESC LIMIT %s", (run_id, limit)).fetchall()
        return [_event(r) for r in reversed(rows)]

    def changed_runs(self) -> set[str]:
        """Runs whose revision is not the one this replica last read or wrote (outside a transaction)."""
        rows = self._db.execute("SELECT run_id, rev FROM runs").fetchall()
        stored = dict(rows)
        changed = {run for run, rev in stored.items() if self._revs.get(run) != rev}
        changed |= {run for run in self._revs if run not in stored}  # forgotten by another replica
        return changed

    def load(self, run_ids: set[str] | None = None) -> Loaded:
        """What the database holds, of every run or of ``run_ids``; records each run's revision as read,
        in one snapshot (REPEATABLE READ), so the revision matches the rows. A run's weight rows are left
        unread (``Loaded.weights_kept``) when its weight revision is the one this process last read or wrote."""
        loaded = Loaded({}, {}, [], {}, {}, {}, {}, {}, 0)
        with _errors(), self._pool.connection() as conn:
            conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
            try:
                with conn.transaction():
                    row = conn.execute("SELECT value FROM meta WHERE key = %s", (_FLOOR_KEY,)).fetchone()
                    loaded.directive_floor = int(row[0]) if row else 0
                    where, args = ("", ()) if run_ids is None else (" WHERE run_id = ANY(%s)", (sorted(run_ids),))
                    revs, wrevs = _read(conn, loaded, where, args)
                    _read_weights(conn, loaded, run_ids, wrevs, {} if run_ids is None else self._wrevs)
            finally:
                conn.isolation_level = None
        if run_ids is None:
            self._revs, self._wrevs = revs, wrevs
        else:
            for run_id in run_ids:
                if run_id in revs:
                    self._revs[run_id], self._wrevs[run_id] = revs[run_id], wrevs[run_id]
                else:
                    self._revs.pop(run_id, None)
                    self._wrevs.pop(run_id, None)
        return loaded

    def close(self) -> None:
        self._pool.close()


def _event(r: tuple) -> EventRow:
    return EventRow(r[0], r[1], r[2], r[3], r[4], r[5], r[6], r[7], json.loads(r[8]))


def _read(conn: psycopg.Connection, into: Loaded, where: str, args: tuple) -> tuple[dict[str, int], dict[str, int]]:
    """Add to ``into`` what the database holds of the runs ``where`` selects, but their weight rows (``_read_weights``);
    returns their revisions and weight revisions."""
    names: dict[str, str] = {}
    one = names.setdefault
    for run, rank, inc, seq, step in conn.execute("SELECT run_id, rank, incarnation, seq, step FROM hwm" + where, args):
        run = one(run, run)
        into.hwm[(run, rank, one(inc, inc))] = seq
        if step > into.latest_step.get(run, 0):
            into.latest_step[run] = step
        else:
            into.latest_step.setdefault(run, step)
    into.counters += [(one(run, run), one(fam, fam), tuple(one(x, x) for x in json.loads(lab)), int(val))
                      for run, fam, lab, val in conn.execute("SELECT run_id, family, labels, value FROM counters"
                                                             + where, args)]
    into.directives.update(
        (run, Directive.model_validate_json(body)) for run, body in conn.execute(
            "SELECT DISTINCT ON (run_id) run_id, body FROM directives" + where + " ORDER BY run_id, version DESC",
            args))
    kind = " AND kind = %s" if where else " WHERE kind = %s"
    for run, key in conn.execute("SELECT run_id, dedupe FROM events" + where + kind, (*args, "rank_crashed")):
        into.event_keys.setdefault(run, set()).add(key)
    into.event_counts.update(((run, k), n) for run, k, n in conn.execute(
        f"SELECT run_id, kind, COUNT(*) FROM events{where} GROUP BY run_id, kind", args))
    into.first_offenders.update((r[0], _event(r)) for r in conn.execute(
        "SELECT run_id, time, kind, dedupe, rank, step, site, actor, detail FROM events" + where + kind,
        (*args, "first_nonfinite")))
    now_wall, now_mono = time.time(), time.monotonic()
    revs, wrevs = {}, {}
    for run, wall, rev, wrev in conn.execute("SELECT run_id, touched, rev, wrev FROM runs" + where, args):
        into.touched[run] = now_mono - max(0.0, now_wall - wall)
        revs[run], wrevs[run] = rev, wrev
    return revs, wrevs


def _read_weights(conn: psycopg.Connection, into: Loaded, run_ids: set[str] | None, wrevs: dict[str, int],
                  known: dict[str, int]) -> None:
    """The weight rows of ``run_ids`` (None: of every run) but those whose weight revision is ``known``'s:
    memory holds them (a run's sets can be megabytes, re-read otherwise on every write another replica
    makes to the run)."""
    into.weights_kept = {run for run, wrev in wrevs.items() if known.get(run) == wrev}
    if run_ids is None:
        rows = conn.execute("SELECT run_id, kind, key, body FROM weight_syncs")
    else:
        rows = conn.execute("SELECT run_id, kind, key, body FROM weight_syncs WHERE run_id = ANY(%s)",
                            (sorted(run_ids - into.weights_kept),))
    for run, kind, key, body in rows:
        into.weights.setdefault(run, []).append((kind, key, body))
