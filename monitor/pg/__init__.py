"""The collector's durable state in PostgreSQL (``nanwatch serve --database-url``), for replicas that share
one database (docs/replicas.md). Needs the ``postgres`` extra (psycopg 3 and psycopg_pool); the SQLite store
(``--db``) stays the default, and nothing imports this package unless a database URL is given."""

from nanwatch.monitor.pg.database import NOTIFY_CHANNEL, PgStore, StaleRun, StoreError, redact
from nanwatch.monitor.pg.migrations import PG_SCHEMA_VERSION, SchemaRefused

__all__ = ["NOTIFY_CHANNEL", "PG_SCHEMA_VERSION", "PgStore", "SchemaRefused", "StaleRun", "StoreError", "redact"]
