"""``nanwatch status [RUN]``: what a collector knows of every run, or of one (``--file``: a trainer's local
JSONL record instead, no collector needed). What is shown is rendered by ``nanwatch.cli.status_view``; every
field passes the printable filter. Standard library only: it starts fast anywhere.

Example usage::

    nanwatch status                                   # every run the token may read
    nanwatch status grpo-0412 --events 50
    nanwatch status --file /runs/logs/nanwatch        # no collector: the trainer's JSONL record
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.parse

from nanwatch.cli.calls import BAD_ANSWER, call, default_url, fail, runs, say
from nanwatch.readable import printable
from nanwatch.tokens import token_from_env

__all__ = ["add_parser", "status_command"]


def add_parser(sub) -> None:
    """The ``status`` subcommand, on the ``nanwatch`` parser's subparsers."""
    s = sub.add_parser("status", help="summarise runs, or one run (from a collector, or a local file: --file)")
    s.add_argument("run", nargs="?", help="run id (omit to list runs)")
    s.add_argument("--url", default=default_url())
    s.add_argument("--token", help="ingest or admin token (default: NANWATCH_TOKEN or NANWATCH_TOKEN_FILE, "
                                  "else NANWATCH_ADMIN_TOKEN or NANWATCH_ADMIN_TOKEN_FILE)")
    s.add_argument("--events", type=int, default=20, help="how many recent events to show")
    s.add_argument("--file", help="read a trainer's local JSONL record instead of a collector: a file, a rotated "
                                 "backup, or a folder of them (MonitorConfig.log.dir / NANWATCH_LOG_DIR)")
    s.add_argument("--late-after", type=float, default=90.0,
                   help="with --file: a rank whose latest report is older than this many seconds (and that "
                        "neither ended nor crashed) is shown as silent (default 90, the collector's)")
    s.set_defaults(func=status_command)


def status_command(args: argparse.Namespace) -> int:
    """0 when shown; 2 on a bad answer, file or use (one line); ``--file`` of one run that is not there: 1."""
    from nanwatch.cli import status_view

    if args.file is not None:
        return _status_file(args)
    try:
        token = args.token or token_from_env("NANWATCH_TOKEN") or token_from_env("NANWATCH_ADMIN_TOKEN")
    except ValueError as e:
        print(f"nanwatch status: {e}", file=sys.stderr)
        return 2
    base = args.url.rstrip("/")
    if args.run is None:
        shown = 0
        for r in runs(base, token):
            try:
                line = status_view.render_summary(r)
            except BAD_ANSWER as e:
                fail(f"nanwatch status: a run in the collector's list lacks or mistypes a field: {e!r:.200}")
            say(line)
            shown += 1
        if not shown:
            print("no runs yet")
        return 0
    r = call("GET", f"{base}/v1/runs/{urllib.parse.quote(args.run, safe='')}", token)
    try:
        lines = status_view.render_detail(r, events=args.events)
    except BAD_ANSWER as e:
        fail(f"nanwatch status: the collector's view of run {args.run} lacks or mistypes a field: {e!r:.200}")
    for line in lines:
        say(line)
    return 0


def _status_file(args: argparse.Namespace) -> int:
    """``nanwatch status --file PATH``: a trainer's local JSONL record (a file, its backups or a folder)."""
    from nanwatch.cli import status_view

    if not os.path.exists(args.file):
        print(printable(f"nanwatch status: no such file or folder: {args.file}"), file=sys.stderr)
        return 2
    skipped: list[str] = []
    try:
        runs = status_view.fold(status_view.read_records(args.file, skipped=skipped), late_s=args.late_after)
        if args.run is not None:
            runs = [r for r in runs if r["run_id"] == args.run]
        views = [status_view.render_detail(r, events=args.events) for r in runs]
    except OSError as e:
        fail(f"nanwatch status: cannot read {args.file}: {e}")
    except BAD_ANSWER as e:
        fail(f"nanwatch status: a record in {args.file} lacks or mistypes a field: {e!r:.200}")
    if skipped:
        print(printable(f"nanwatch status: skipped {len(skipped)} unreadable line(s), first: {skipped[0]}"),
              file=sys.stderr)
    if not runs:
        say(f"no reports{f' of run {args.run}' if args.run else ''} in {args.file}")
        return 1 if args.run else 0
    for lines in views:
        for line in lines:
            say(line)
    return 0
