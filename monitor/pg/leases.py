"""Which replica exports a run's series: the one holding the run's lease, a PostgreSQL session-level
advisory lock keyed by the run id, taken on a connection of its own. Every replica the run is live on (it
took the run's recent reports) tries to take it; one holds it, the others show none of the run's series, so
``sum by (run_id)`` over replicas counts each total once. The holder lets go when the run is no longer live
on it; when it dies, the server ends its session and the lock with it (a kill -9 closes the socket at
once; a lost host, within the server's TCP keepalive), and the next ``update`` of another replica takes
it: a run's series move between replicas within ``NANWATCH_DATABASE_REFRESH_S``, never shown twice.

Rules fire once per cause without a lease: two replicas never commit a write of one run from the same
memory of it (``nanwatch.monitor.pg.database``), so the second's fold sees the first's events and directives.

Example usage::

    leases = RunLeases(url)
    held = leases.update({"run-1", "run-2"})   # the live runs whose series this replica shows
"""

from __future__ import annotations

import logging

import psycopg

__all__ = ["RunLeases"]

log = logging.getLogger("nanwatch.monitor")

#: the lock key of a run: 64 bits of PostgreSQL's own text hash, salted so no other user of advisory locks
#: on the database shares nanwatch's keys by accident
_KEY = "hashtextextended(%s, 7234)"


class RunLeases:
    """This replica's leases, on one connection that lives as long as they do."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._conn: psycopg.Connection | None = None
        self.held: set[str] = set()

    def _connection(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed:
            self.held = set()  # a new session holds nothing: the old one's locks went with it
            self._conn = psycopg.connect(self._url, autocommit=True, connect_timeout=5)
        return self._conn

    def update(self, live: set[str]) -> set[str]:
        """Take the leases of the runs live here that nobody holds, let go of those no longer live here;
        returns the runs this replica holds (none while the database cannot be reached: better no series
        for a while than series counted twice)."""
        try:
            conn = self._connection()
            for run_id in sorted(self.held - live):
                conn.execute(f"SELECT pg_advisory_unlock({_KEY})", (run_id,))
                self.held.discard(run_id)
            for run_id in sorted(live - self.held):
                if conn.execute(f"SELECT pg_try_advisory_lock({_KEY})", (run_id,)).fetchone()[0]:
                    self.held.add(run_id)
        except psycopg.Error as e:
            log.warning("nanwatch collector: cannot hold run leases (%s): exporting no run's series until it can", e)
            self.close()
            return set()
        return set(self.held)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
        self._conn, self.held = None, set()
