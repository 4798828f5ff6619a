"""The collector's PostgreSQL schema: numbered migrations, applied in order by the collector at start,
under a transaction-scoped advisory lock so that replicas starting together upgrade it once.

``nanwatch_schema`` holds one row per applied migration. A database with none of these tables is fresh and
gets every migration; one that has some of them but no version row is someone else's (refused); one whose
version is above ``PG_SCHEMA_VERSION`` was upgraded by a newer collector (refused: this one would write rows
the newer one cannot read back).

The tables mirror the SQLite store's (``nanwatch.monitor.data.schema``), in PostgreSQL's own types:
counter totals are ``NUMERIC`` (exact at any size), event detail stays JSON text (non-finite floats are
the data, and ``jsonb`` refuses ``NaN``). Migration 2 adds what replicas share: a revision per run, bumped
under the run's row lock by every write, so a replica whose memory of a run is older than the database's
finds out inside its transaction (``nanwatch.monitor.pg.database``). The weight-sync migration adds the runs' weight syncs
(``weight_syncs``, rows of ``nanwatch.monitor.data.weight_rows``), so that a version published through one
replica is compared with a rollout set posted through another, and a weight revision per run (``runs.wrev``),
bumped by a write that changed the run's weight rows, so a replica re-reads them only when they changed. The
shared-metrics migration adds what the replicas' metrics share (``nanwatch.monitor.pg.shared_metrics``): ranks'
latest views and the totals of a run's last export.
"""

from __future__ import annotations

from functools import partial

import psycopg

from nanwatch.monitor.data.schema import lacking

__all__ = ["COLUMNS", "MIGRATIONS", "PG_SCHEMA_VERSION", "SchemaRefused", "check", "problem"]

#: migration N (1-based) takes the schema from version N-1 to N; never edit one that shipped, add one
MIGRATIONS: tuple[str, ...] = (
    """
    CREATE TABLE events (
        id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        run_id TEXT NOT NULL, time DOUBLE PRECISION NOT NULL, kind TEXT NOT NULL, dedupe TEXT NOT NULL,
        rank INTEGER, step BIGINT, site TEXT, actor TEXT NOT NULL DEFAULT '', detail TEXT NOT NULL DEFAULT '{}',
        UNIQUE (run_id, dedupe)
    );
    CREATE TABLE directives (
        run_id TEXT NOT NULL, version BIGINT NOT NULL, body TEXT NOT NULL, PRIMARY KEY (run_id, version)
    );
    CREATE TABLE hwm (
        run_id TEXT NOT NULL, rank INTEGER NOT NULL, incarnation TEXT NOT NULL, seq BIGINT NOT NULL,
        step BIGINT NOT NULL, PRIMARY KEY (run_id, rank, incarnation)
    );
    CREATE TABLE counters (
        run_id TEXT NOT NULL, family TEXT NOT NULL, labels TEXT NOT NULL, value NUMERIC NOT NULL,
        PRIMARY KEY (run_id, family, labels)
    );
    CREATE TABLE runs (run_id TEXT PRIMARY KEY, touched DOUBLE PRECISION NOT NULL);
    CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
    """,
    """
    ALTER TABLE runs ADD COLUMN rev BIGINT NOT NULL DEFAULT 0;
    """,
    """
    CREATE TABLE weight_syncs (
        run_id TEXT NOT NULL, kind TEXT NOT NULL, key TEXT NOT NULL, body TEXT NOT NULL,
        PRIMARY KEY (run_id, kind, key)
    );
    ALTER TABLE runs ADD COLUMN wrev BIGINT NOT NULL DEFAULT 0;
    """,
    # what the replicas' metrics share (nanwatch.monitor.pg.shared_metrics): each rank's latest view, whichever
    # replica received it, for the run's exporter; and the totals a run's last export showed, where its next
    # exporter's series starts
    """
    CREATE SEQUENCE rank_views_version;
    CREATE TABLE rank_views (
        run_id TEXT NOT NULL, rank INTEGER NOT NULL, replica TEXT NOT NULL, received DOUBLE PRECISION NOT NULL,
        version BIGINT NOT NULL, view TEXT NOT NULL, PRIMARY KEY (run_id, rank)
    );
    CREATE INDEX rank_views_by_version ON rank_views (version);
    CREATE TABLE exported (run_id TEXT PRIMARY KEY, totals TEXT NOT NULL, at DOUBLE PRECISION NOT NULL);
    """,
)
PG_SCHEMA_VERSION = len(MIGRATIONS)
COLUMNS = {
    "events": ["id", "run_id", "time", "kind", "dedupe", "rank", "step", "site", "actor", "detail"],
    "directives": ["run_id", "version", "body"],
    "hwm": ["run_id", "rank", "incarnation", "seq", "step"],
    "counters": ["run_id", "family", "labels", "value"],
    "runs": ["run_id", "touched", "rev", "wrev"],
    "meta": ["key", "value"],
    "weight_syncs": ["run_id", "kind", "key", "body"],
    "rank_views": ["run_id", "rank", "replica", "received", "version", "view"],
    "exported": ["run_id", "totals", "at"],
}
_VERSION_TABLE = "nanwatch_schema"
#: the advisory lock key the migrations run under (any constant; 'nanw' in ASCII)
_MIGRATION_LOCK = 0x6E616E77


class SchemaRefused(ValueError):
    """The database is not one this collector can use: someone else's tables, or a newer schema."""


def _tables(conn: psycopg.Connection) -> set[str]:
    return {r[0] for r in conn.execute(
        "SELECT table_name FROM information_schema.tables WHERE table_schema = current_schema()")}


def _columns(conn: psycopg.Connection, table: str) -> list[str]:
    return [r[0] for r in conn.execute(
        "SELECT column_name FROM information_schema.columns WHERE table_schema = current_schema() "
        "AND table_name = %s ORDER BY ordinal_position", (table,))]


def check(conn: psycopg.Connection, where: str, *, upto: int = PG_SCHEMA_VERSION) -> int:
    """Create or upgrade the schema to version ``upto`` (tests stop short of the latest to hold an older
    database), in one transaction; returns the version found before. ``where`` names the database in errors
    (its URL without the password)."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATION_LOCK,))
        tables = _tables(conn)
        if _VERSION_TABLE in tables:
            found = conn.execute(f"SELECT COALESCE(MAX(version), 0) FROM {_VERSION_TABLE}").fetchone()[0]
        elif tables & set(COLUMNS):
            raise SchemaRefused(f"{where} holds tables named like nanwatch's ({', '.join(sorted(tables & set(COLUMNS)))}) "
                                "but no nanwatch_schema version: not a nanwatch collector database; give the "
                                "collector a database of its own")
        else:
            conn.execute(f"CREATE TABLE {_VERSION_TABLE} (version INTEGER PRIMARY KEY, "
                         "applied_at TIMESTAMPTZ NOT NULL DEFAULT now())")
            found = 0
        if found > PG_SCHEMA_VERSION:
            raise SchemaRefused(f"{where}: schema version {found}, newer than this collector's "
                                f"{PG_SCHEMA_VERSION}: run the collector version that upgraded it")
        for version in range(found + 1, upto + 1):
            conn.execute(MIGRATIONS[version - 1])
            conn.execute(f"INSERT INTO {_VERSION_TABLE} (version) VALUES (%s)", (version,))
    return found


def problem(conn: psycopg.Connection) -> str | None:
    """None when every table holds its columns, else what is missing (``/readyz`` names it)."""
    return lacking(COLUMNS, partial(_columns, conn))
