"""The collector database's schema: its tables and columns, its version, and the check (and in-place
upgrade) a file goes through before the store uses it. Apart from the store's reads and writes, so that what
the file must look like is read in one place.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from functools import partial

__all__ = ["COLUMNS", "DB_SCHEMA_VERSION", "TABLES", "ForeignDatabase", "check", "lacking", "problem", "table_columns"]

_COUNTERS_TABLE = """CREATE TABLE IF NOT EXISTS counters (
    run_id TEXT NOT NULL, family TEXT NOT NULL, labels TEXT NOT NULL, value TEXT NOT NULL,
    PRIMARY KEY (run_id, family, labels)
)"""
_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    run_id TEXT NOT NULL, time REAL NOT NULL, kind TEXT NOT NULL, dedupe TEXT NOT NULL,
    rank INTEGER, step INTEGER, site TEXT, actor TEXT NOT NULL DEFAULT '', detail TEXT NOT NULL DEFAULT '{{}}',
    UNIQUE (run_id, dedupe)
);
CREATE TABLE IF NOT EXISTS directives (
    run_id TEXT NOT NULL, version INTEGER NOT NULL, body TEXT NOT NULL, PRIMARY KEY (run_id, version)
);
CREATE TABLE IF NOT EXISTS hwm (
    run_id TEXT NOT NULL, rank INTEGER NOT NULL, incarnation TEXT NOT NULL, seq INTEGER NOT NULL,
    step INTEGER NOT NULL, PRIMARY KEY (run_id, rank, incarnation)
);
{_COUNTERS_TABLE};
CREATE TABLE IF NOT EXISTS runs (
    run_id TEXT PRIMARY KEY, touched REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS meta (
    key TEXT PRIMARY KEY, value TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS weight_syncs (
    run_id TEXT NOT NULL, kind TEXT NOT NULL, key TEXT NOT NULL, body TEXT NOT NULL, PRIMARY KEY (run_id, kind, key)
);
"""
#: ``PRAGMA user_version`` of this database schema (not the wire's ``SCHEMA_VERSION``). 0 is a file from
#: before the version was kept: accepted when its tables are a subset of these, with exactly these columns
#: (then upgraded); 2 is upgraded in place (its counter totals were REAL, rewritten as exact decimal text);
#: anything else is refused. 3: counter totals are exact integers of any size, stored as decimal TEXT
#: (SQLite's INTEGER stops at 2^63 and REAL at 2^53, past which +1 adds nothing). 4: the runs' weight syncs
#: (``weight_syncs``, ``nanwatch.monitor.data.weight_rows``), a table added to a version 3 file in place.
DB_SCHEMA_VERSION = 4
COLUMNS = {
    "events": ["id", "run_id", "time", "kind", "dedupe", "rank", "step", "site", "actor", "detail"],
    "directives": ["run_id", "version", "body"],
    "hwm": ["run_id", "rank", "incarnation", "seq", "step"],
    "counters": ["run_id", "family", "labels", "value"],
    "runs": ["run_id", "touched"],
    "meta": ["key", "value"],
    "weight_syncs": ["run_id", "kind", "key", "body"],
}
TABLES = tuple(t for t in COLUMNS if t != "meta")


class ForeignDatabase(ValueError):
    """The file is not a nanwatch collector database this version can use."""


def check(db: sqlite3.Connection, path: str) -> None:
    """Accept the file's schema, create what a fresh file lacks, or upgrade an older one in place; raises
    ``ForeignDatabase`` for a file this version cannot use."""
    version = db.execute("PRAGMA user_version").fetchone()[0]
    tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")
              if not r[0].startswith("sqlite_")}
    if version == DB_SCHEMA_VERSION:
        return
    if version not in (0, 2, 3):
        raise ForeignDatabase(f"{path}: schema version {version}; this collector speaks "
                              f"{DB_SCHEMA_VERSION} (use a new --db file, or the collector that wrote it)")
    foreign = sorted(t for t in tables if t not in COLUMNS or table_columns(db, t) != COLUMNS[t])
    if foreign:
        raise ForeignDatabase(f"{path} is not a nanwatch collector database (unexpected tables or "
                              f"columns: {', '.join(foreign)}); point --db at a new file")
    try:
        db.executescript(_SCHEMA)
    except sqlite3.Error:
        if not tables:  # a read-only fresh file: let probe() report it, and load() read nothing
            return
        raise
    if version == 3:  # its tables and counters are as they were: the weight syncs' table was added above
        db.execute(f"PRAGMA user_version={DB_SCHEMA_VERSION}")
    else:
        _exact_counters(db)

def table_columns(db: sqlite3.Connection, table: str) -> list[str]:
    return [c[1] for c in db.execute(f"PRAGMA table_info({table})")]

def _exact_counters(db: sqlite3.Connection) -> None:
    """Schema 2 (or 0) to 3 (and so to 4, whose table the caller created) in one transaction: the counter totals, REAL before, become exact decimal
    TEXT (a REAL total is a whole number, so ``int`` of it is exact). The table is bounded by the
    series caps, so this is quick; a crash midway leaves the file as it was."""
    db.execute("BEGIN IMMEDIATE")
    try:
        rows = [(r, f, lab, str(int(v))) for r, f, lab, v in db.execute("SELECT * FROM counters")]
        db.execute("DROP TABLE counters")
        db.execute(_COUNTERS_TABLE)
        db.executemany("INSERT INTO counters VALUES (?,?,?,?)", rows)
        db.execute(f"PRAGMA user_version={DB_SCHEMA_VERSION}")
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise


def lacking(expected: dict[str, list[str]], columns_of: Callable[[str], list[str]]) -> str | None:
    """None when every table of ``expected`` holds its columns (``columns_of(table)``: the ones it has, none
    for a missing table), else what is missing: ``/readyz`` names it, every ingest would fail on it. Either
    store's check (SQLite's ``problem`` here, PostgreSQL's in ``nanwatch.monitor.pg.migrations``)."""
    missing = []
    for table, columns in expected.items():
        have = columns_of(table)
        if not have:
            missing.append(f"table {table}")
        missing += [f"column {table}.{c}" for c in columns if have and c not in have]
    return f"the database lacks {', '.join(missing)}" if missing else None


def problem(db: sqlite3.Connection) -> str | None:
    """None when every table holds its columns, else what is missing (``lacking``)."""
    return lacking(COLUMNS, partial(table_columns, db))
