"""``nanwatch push --collector URL [DIR ...]``: send the reports a trainer could not deliver (kept on disk by
its sender, ``nanwatch.hooks.report.spool``) to a collector, and remove what it acknowledged. Light: no torch,
no web stack. A second push (or a push of a copy) applies nothing twice: the collector recognises every
report it already holds by ``(run, rank, incarnation, seq)`` and answers it as a duplicate.

Example usage::

    nanwatch push --collector http://collector:8000                      # the default undelivered folder
    nanwatch push --collector http://collector:8000 /runs/logs/undelivered/run-grpo-0412
"""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ["add_parser", "push_command"]


def add_parser(sub) -> None:
    """The ``push`` subcommand, on the ``nanwatch`` parser's subparsers."""
    s = sub.add_parser("push", help="send the reports a trainer kept on disk (undelivered) to a collector")
    s.add_argument("dirs", nargs="*", metavar="DIR",
                   help="undelivered folders or files (default: $NANWATCH_LOG_DIR/undelivered, else "
                        "$XDG_STATE_HOME/nanwatch/undelivered, else ~/.local/state/nanwatch/undelivered)")
    s.add_argument("--collector", required=True, metavar="URL", help="the collector's base URL")
    s.add_argument("--token", help="ingest token (default: NANWATCH_TOKEN or NANWATCH_TOKEN_FILE, as the trainer)")
    s.set_defaults(func=push_command)


def push_command(args: argparse.Namespace) -> int:
    """0: everything found was delivered (or nothing was there); 1: something is left on disk; 2: bad use."""
    from nanwatch.addresses import check_collector_url
    from nanwatch.hooks.report.spool import push, undelivered_root
    from nanwatch.tokens import token_from_env

    try:
        check_collector_url(args.collector)
        token = args.token or token_from_env("NANWATCH_TOKEN")
    except ValueError as e:
        print(f"nanwatch push: {e}", file=sys.stderr)
        return 2
    dirs = args.dirs or [str(undelivered_root(os.environ.get("NANWATCH_LOG_DIR") or None))]
    missing = [d for d in dirs if not os.path.exists(d)]
    if missing and args.dirs:
        print(f"nanwatch push: no such file or folder: {missing[0]}", file=sys.stderr)
        return 2
    result = push([d for d in dirs if d not in missing], args.collector, token=token, out=print)
    for problem in result.problems:
        print(f"nanwatch push: {problem}", file=sys.stderr)
    print(f"pushed to {args.collector}: {result.applied} applied, {result.duplicates} already held "
          f"(duplicates), {result.left} left on disk; {result.files_done} files done")
    return 1 if result.left or result.problems else 0
