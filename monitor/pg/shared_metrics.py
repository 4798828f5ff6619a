"""What the replicas' metrics share through the database, so that a run's series add up over replicas
(docs/replicas.md#metrics): one replica exports a run (``nanwatch.monitor.pg.leases``), yet

* **every rank's gauges are in its export**, whichever replica the rank reports to: each replica publishes
  the latest views of the ranks it received (each held rank's, heartbeat-only ones included, and a job's
  view, as rank -1) of the runs it does not export to ``rank_views``, one row per (run, rank), the newest report's; the
  exporter reads the rows other replicas wrote for the runs it exports and shows them beside its own views
  (the newer of the two per rank). With a run's reports routed to one replica (its exporter), nothing is
  published, and the exporter's read finds nothing new in one indexed ``max(version)``. Both happen on the lease tick (every half ``NANWATCH_DATABASE_REFRESH_S``): a rank's latest
  gauges reach the exporter within about one period. The views are latest gauges, not counts: written
  after the report's transaction, not in it (a kill -9 loses at most one period of them, and the rank's
  next report brings them back; its counts are in the totals, committed before the 200);
* **no increment is lost or counted twice at a handover**: every export records the totals it showed for
  each run (``exported``), and the run's next exporter starts its series there (``data.tenures``).

Example usage::

    shared = SharedMetrics(url)
    shared.publish(ledger.state)                      # this replica's ranks' latest views
    views = shared.foreign(held)                      # the other replicas' views of the runs held here
    start = shared.recorded("run-1")                  # where a new tenure's series start
    shared.record_later({"run-1": totals})            # what this render showed (off the event loop)
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import psycopg

from nanwatch.monitor.data.liveness import ttl
from nanwatch.monitor.data.state import CollectorState, RankState
from nanwatch.monitor.data.tenures import Key
from nanwatch.wire import MoeStat, RlhfStat

__all__ = ["SharedMetrics", "decode_view", "encode_view"]

log = logging.getLogger("nanwatch.monitor")

#: the rank number a run's job view is published under
JOB_RANK = -1
#: RankState fields not published: ``seen`` is this process's monotonic clock (the reader makes its own)
_LOCAL = {"seen"}
_FIELDS = [f.name for f in dataclasses.fields(RankState) if f.name not in _LOCAL]
#: rows of runs whose history is gone are deleted every this many ticks
_CLEAN_EVERY = 600


def encode_view(st: RankState) -> str:
    """A rank's view as JSON text (non-finite floats are the data: JSON's NaN/Infinity, never null)."""
    out = {name: getattr(st, name) for name in _FIELDS}
    for name in ("rlhf", "moe"):
        if out[name] is not None:
            out[name] = out[name].model_dump(mode="python")
    return json.dumps(out)


def decode_view(text: str, *, wall: float, mono: float) -> RankState:
    """A view published by another replica, its ``seen`` on this process's monotonic clock (``mono`` now,
    ``wall`` now: the view is as old here as its ``received`` says)."""
    raw = json.loads(text)
    raw["rlhf"] = RlhfStat.model_validate(raw["rlhf"]) if raw.get("rlhf") is not None else None
    raw["moe"] = MoeStat.model_validate(raw["moe"]) if raw.get("moe") is not None else None
    return RankState(**{k: v for k, v in raw.items() if k in _FIELDS}, seen=mono - max(0.0, wall - raw["received"]))


def _key_text(totals: dict[Key, int]) -> str:
    return json.dumps([(fam, labels, value) for (fam, labels), value in totals.items()])


class SharedMetrics:
    """This replica's side of the shared metrics, on one autocommit connection of its own (the calls come
    from the event loop's lease tick and render, one at a time, as the store's do)."""

    def __init__(self, url: str, *, replica: str | None = None) -> None:
        self._url = url
        self._conn: psycopg.Connection | None = None
        #: this process: the rows it publishes are its own, those of others it reads
        self.replica = replica or uuid.uuid4().hex[:12]
        self._published: dict[tuple[str, int], RankState] = {}
        self._recorded: dict[str, dict[Key, int]] = {}
        #: the largest ``rank_views.version`` read, by exported run, and over the table
        self._read: dict[str, int] = {}
        self._top = 0
        self._ticks = 0
        #: the records are written by a thread of their own, in order, on a connection of their own: their
        #: JSON and round trip (a few hundred ms for 1,000 runs whose totals all moved) stay off the event loop
        self._records = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nanwatch-record")
        self._record_conn: psycopg.Connection | None = None

    def _connection(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed:
            self._conn = psycopg.connect(self._url, autocommit=True, connect_timeout=5)
        return self._conn

    def _fail(self, what: str, e: psycopg.Error) -> None:
        log.warning("nanwatch collector: cannot %s (%s); retrying", what, e)
        if self._conn is not None:
            self._conn.close()
        self._conn = None

    def publish(self, state: CollectorState) -> int:
        """Write the views of this replica's ranks that changed since the last call (a report replaces a
        view, never mutates it); returns how many. Only the newest report's view of a rank is kept."""
        now = time.monotonic()
        rows, seen = [], set()
        exported = state.exported_runs or set()
        for run_id, run in state.runs.items():
            if run_id in exported:  # its exporter's own views: shown here, nobody else needs them
                continue
            horizon = now - ttl(state, run)
            views = list(run.ranks.items())  # heartbeat-only ranks too: the exporter counts them live
            if run.job is not None:
                views.append((JOB_RANK, run.job))
            for rank, st in views:
                key = (run_id, rank)
                seen.add(key)
                if st.seen >= horizon and self._published.get(key) is not st:
                    rows.append((key, st))
        try:
            if rows:  # one statement, one round trip, whatever the number of rows
                self._connection().execute(
                    "INSERT INTO rank_views (run_id, rank, replica, received, version, view) "
                    "SELECT r, k, %s, t, nextval('rank_views_version'), v "
                    "FROM unnest(%s::text[], %s::int[], %s::float8[], %s::text[]) AS u(r, k, t, v) "
                    "ON CONFLICT (run_id, rank) DO UPDATE SET replica = EXCLUDED.replica, "
                    "received = EXCLUDED.received, version = EXCLUDED.version, view = EXCLUDED.view "
                    "WHERE rank_views.received <= EXCLUDED.received",
                    (self.replica, [k[0] for k, _ in rows], [k[1] for k, _ in rows], [st.received for _, st in rows],
                     [encode_view(st) for _, st in rows]))
        except psycopg.Error as e:
            self._fail("publish this replica's rank views", e)
            return 0
        self._published = {k: v for k, v in self._published.items() if k in seen}
        self._published.update(rows)
        return len(rows)

    def foreign(self, runs: set[str]) -> dict[str, dict[int, RankState]]:
        """The views other replicas published of these runs' ranks since the last call (all of them for a
        run new to the call), by run, then rank."""
        self._read = {run_id: v for run_id, v in self._read.items() if run_id in runs}
        if not runs:
            return {}
        out: dict[str, dict[int, RankState]] = {}
        wall, mono = time.time(), time.monotonic()
        try:
            conn = self._connection()
            top = conn.execute("SELECT COALESCE(MAX(version), 0) FROM rank_views").fetchone()[0]
            if top <= self._top and runs <= self._read.keys():
                return {}  # nothing published since the last call, and no run new to it
            found = conn.execute(
                "SELECT v.run_id, v.rank, v.version, v.view FROM rank_views v "
                "JOIN unnest(%s::text[], %s::bigint[]) AS r(run_id, since) ON v.run_id = r.run_id "
                "WHERE v.version > r.since AND v.replica <> %s",
                (sorted(runs), [self._read.get(r, 0) for r in sorted(runs)], self.replica)).fetchall()
        except psycopg.Error as e:
            self._fail("read the other replicas' rank views", e)
            return {}
        for run_id, rank, version, view in found:
            out.setdefault(run_id, {})[rank] = decode_view(view, wall=wall, mono=mono)
            self._read[run_id] = max(self._read.get(run_id, 0), version)
        for run_id in runs:
            self._read.setdefault(run_id, 0)
        self._top = top
        return out

    def recorded(self, run_id: str) -> dict[Key, int]:
        """The totals the run's last export showed, whichever replica made it ({} if none)."""
        try:
            row = self._connection().execute("SELECT totals FROM exported WHERE run_id = %s", (run_id,)).fetchone()
        except psycopg.Error as e:
            self._fail("read where a run's last export stood", e)
            return {}
        return {} if row is None else {(fam, tuple(labels)): int(v) for fam, labels, v in json.loads(row[0])}

    def record_later(self, totals: dict[str, dict[Key, int]]) -> None:
        """``record`` on the recording thread, after the records asked for before (``totals`` is the render's
        snapshot: nothing changes it afterwards)."""
        self._records.submit(self.record, totals)

    def record(self, totals: dict[str, dict[Key, int]]) -> None:
        """Record what this render showed of each run (only the runs whose totals moved since the last), on
        the recording connection: one caller at a time (``record_later``'s thread)."""
        rows = {run_id: counts for run_id, counts in totals.items() if self._recorded.get(run_id) != counts}
        try:
            if self._record_conn is None or self._record_conn.closed:
                self._record_conn = psycopg.connect(self._url, autocommit=True, connect_timeout=5)
            if rows:  # one statement, one round trip
                self._record_conn.execute(
                    "INSERT INTO exported (run_id, totals, at) SELECT r, t, %s FROM unnest(%s::text[], %s::text[]) "
                    "AS u(r, t) ON CONFLICT (run_id) DO UPDATE SET totals = EXCLUDED.totals, at = EXCLUDED.at",
                    (time.time(), list(rows), [_key_text(counts) for counts in rows.values()]))
        except psycopg.Error as e:
            log.warning("nanwatch collector: cannot record what a render exported (%s); retrying", e)
            if self._record_conn is not None:
                self._record_conn.close()
            self._record_conn = None
            self._recorded.clear()
            return
        self._recorded = {run_id: counts for run_id, counts in {**self._recorded, **rows}.items()
                          if run_id in totals}

    def clean(self) -> None:
        """Now and then: delete the rows of runs whose history the database no longer holds."""
        self._ticks += 1
        if self._ticks % _CLEAN_EVERY:
            return
        try:
            conn = self._connection()
            for table in ("rank_views", "exported"):
                conn.execute(f"DELETE FROM {table} t WHERE NOT EXISTS (SELECT 1 FROM runs r WHERE r.run_id = t.run_id)")
        except psycopg.Error as e:
            self._fail("delete the shared metrics of forgotten runs", e)

    def close(self) -> None:
        self._records.shutdown(wait=True)  # the records asked for are written
        for conn in (self._conn, self._record_conn):
            if conn is not None:
                conn.close()
        self._conn = self._record_conn = None
