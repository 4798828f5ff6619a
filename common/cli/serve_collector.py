"""``nanwatch serve``: the collector (``nanwatch.monitor``), its settings from the flags and ``NANWATCH_*``.
The web stack is imported when the command runs, never when the CLI starts.

Example usage::

    nanwatch serve --host 0.0.0.0 --port 8000 --db /var/lib/nanwatch/nanwatch.db
    nanwatch serve --database-url postgresql://nanwatch@db/nanwatch     # replicas on one PostgreSQL
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["add_parser", "serve_command"]


def add_parser(sub) -> None:
    """The ``serve`` subcommand, on the ``nanwatch`` parser's subparsers."""
    s = sub.add_parser("serve", help="run the collector (settings also from NANWATCH_* env)")
    s.add_argument("--host", help="listen address (default 127.0.0.1; beyond loopback tokens are required)")
    s.add_argument("--port", type=int, help="listen port (default 8000)")
    s.add_argument("--db", help="SQLite file for events, directives and counters (default nanwatch.db); "
                                "never with a database URL (flag or NANWATCH_DATABASE_URL[_FILE]): exit 2")
    s.add_argument("--database-url", metavar="URL",
                   help="postgresql://... : keep that state in PostgreSQL instead, shared by collector replicas "
                        "(default: NANWATCH_DATABASE_URL, else SQLite); never with --db or NANWATCH_DB_PATH")
    s.add_argument("--tls-cert", metavar="PATH", help="serve HTTPS with this PEM certificate (chain); with --tls-key")
    s.add_argument("--tls-key", metavar="PATH", help="the certificate's PEM private key")
    s.set_defaults(func=serve_command)


def serve_command(args: argparse.Namespace) -> int:
    """0 when the collector stopped; 2 on a bad setting (one line)."""
    from nanwatch.monitor import Settings
    from nanwatch.monitor.server import serve

    given = (("host", args.host), ("port", args.port), ("db_path", args.db), ("database_url", args.database_url),
             ("tls_cert_file", args.tls_cert), ("tls_key_file", args.tls_key))
    overrides = {k: v for k, v in given if v is not None}
    if "database_url" in overrides:  # the flag beats the environment's URL, in either of its forms
        overrides["database_url_file"] = None
    try:
        settings = Settings(**overrides)
        settings.check_store(flags=set(overrides))  # --db with a URL, from flags or env: exit 2, naming both
        serve(settings)
    except ValueError as e:
        print(f"nanwatch serve: {e}", file=sys.stderr)
        return 2
    return 0
