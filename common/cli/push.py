"""``nanwatch push --collector URL [DIR ...]``: send the reports a trainer could not deliver (kept on disk by
its sender, ``nanwatch.hooks.report.spool``) to a collector, oldest first, and remove what it acknowledged
(a file sent in part keeps only what is left; a file still being written by a running trainer is skipped).
Light: no torch, no web stack. A second push (or a push of a copy) applies nothing twice: the collector
recognises every report it already holds by ``(run, rank, incarnation, seq)`` and answers it as a duplicate.

Example usage::

    nanwatch push --collector http://collector:8000                      # the default undelivered folder
    nanwatch push --collector http://collector:8000 /runs/logs/undelivered/run-grpo-0412
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["PushResult", "add_parser", "push", "push_command"]

#: reports per request
PUSH_BATCH = 64


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
    from nanwatch.hooks.report.spool import undelivered_root
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
    from nanwatch.readable import printable

    result = push([d for d in dirs if d not in missing], args.collector, token=token,
                  out=lambda line: print(printable(line)))
    for problem in result.problems:  # a collector's words: shown, never obeyed
        print(printable(f"nanwatch push: {problem}"), file=sys.stderr)
    print(f"pushed to {args.collector}: {result.applied} applied, {result.duplicates} already held "
          f"(duplicates), {result.left} left on disk; {result.files_done} files done")
    return 1 if result.left or result.problems else 0


@dataclass(slots=True)
class PushResult:
    """What ``push`` did: reports the collector applied, already held (duplicates), left on disk."""

    applied: int = 0
    duplicates: int = 0
    left: int = 0
    files_done: int = 0
    problems: list[str] = field(default_factory=list)


def push(paths: Iterable[str | os.PathLike], collector: str, *, token: str | None,
         out: Callable[[str], object] = print, timeout_s: float = 30.0) -> PushResult:
    """Send every spool file under ``paths`` to ``collector`` (``POST /v1/reports``). Stops a file at its first
    failure. ``token``: None reads ``NANWATCH_TOKEN`` / ``NANWATCH_TOKEN_FILE``, as the sender does."""
    from nanwatch.hooks.report.spool import spool_files
    from nanwatch.hooks.report.transport import KeepAliveHttp

    http = KeepAliveHttp(collector, token, timeout_s)
    result = PushResult()
    try:
        for path in spool_files(paths):
            _push_file(http, path, result, out)
    finally:
        http.close()
    return result


def _push_file(http, path: Path, result: PushResult, out: Callable[[str], object]) -> None:
    from nanwatch.hooks.report.spool import lock_for_push

    try:
        f = open(path, "r+b")  # noqa: SIM115 - closed below
    except OSError as e:
        result.problems.append(f"{path}: {e}")
        return
    with f:
        if not lock_for_push(f):
            result.problems.append(f"{path}: still being written by a running trainer; skipped")
            return
        lines = [ln for ln in f.read().splitlines() if ln.strip()]
        sent, applied, dup, problem = _send_lines(http, lines)
        result.applied += applied
        result.duplicates += dup
        left = lines[sent:]
        result.left += len(left)
        if problem:
            result.problems.append(f"{path}: {problem}")
        out(f"{path}: {sent} of {len(lines)} sent ({applied} applied, {dup} already held)"
            + (f"; {len(left)} left: {problem}" if left else ""))
        if not left:
            path.unlink()
            result.files_done += 1
            try:
                path.parent.rmdir()  # the run's folder, once empty
            except OSError:
                pass
        elif sent:
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_bytes(b"".join(ln + b"\n" for ln in left))
            os.replace(tmp, path)


def _send_lines(http, lines: list[bytes]) -> tuple[int, int, int, str | None]:
    """(lines acknowledged, applied, duplicates, the problem that stopped it or None)."""
    from nanwatch.wire import ReportBatch, StepReport

    sent = applied = dup = 0
    while sent < len(lines):
        chunk = lines[sent:sent + PUSH_BATCH]
        try:
            body = ReportBatch(reports=[StepReport.model_validate_json(ln) for ln in chunk]).model_dump_json()
        except ValueError as e:
            return sent, applied, dup, f"a line after the first {sent} is no StepReport: {str(e)[:200]}"
        try:
            status, data, _ = http.request("POST", "/v1/reports", body.encode())
        except Exception as e:  # noqa: BLE001 - told, never raised
            return sent, applied, dup, f"cannot reach the collector: {e!r}"
        if not 200 <= status < 300:
            return sent, applied, dup, f"HTTP {status}: {data[:300].decode('utf-8', 'replace')}"
        try:
            answer = json.loads(data)
            applied += int(answer.get("accepted", 0))
            dup += int(answer.get("duplicates", 0))
        except (ValueError, AttributeError, TypeError):
            applied += len(chunk)
        sent += len(chunk)
    return sent, applied, dup, None
