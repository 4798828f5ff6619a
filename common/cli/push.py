"""``nanwatch push --collector URL [DIR ...]``: send the reports a trainer could not deliver (kept on disk by
its sender, ``nanwatch.hooks.report.spool``) to a collector, oldest first, and remove what it acknowledged
(a file sent in part keeps only what is left; a file still being written by a running trainer is skipped).
Never through a link, never unbounded (#37): the folders and files are opened as the spool's writer makes them
(``nanwatch.hooks.report.spool.open_folder``, ``open_checked``: no link followed, a regular file of this user's,
else skipped and named); a file over the writer's bound (``MAX_FILE_BYTES``, 64 MiB) is skipped and named
unread, the others read line by line within it; the rest of a file sent in part goes to a new file push makes
itself (``O_CREAT | O_EXCL``, in the same folder) that then replaces it (``os.replace``), so nothing planted
beside it is ever written through.
Light: no torch, no web stack. A second push (or a push of a copy) applies nothing twice: the collector
recognises every report it already holds by ``(run, rank, incarnation, seq)`` and answers it as a duplicate.

Example usage::

    nanwatch push --collector http://collector:8000                      # the default undelivered folder
    nanwatch push --collector http://collector:8000 /runs/logs/undelivered/run-grpo-0412
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

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
        for found in spool_files(paths, refused=lambda why: result.problems.append(f"{why}; skipped")):
            _push_file(http, found, result, out)
    finally:
        http.close()
    return result


def _push_file(http, found, result: PushResult, out: Callable[[str], object]) -> None:
    from nanwatch.hooks.report.spool import Refused, lock_for_push, open_checked

    path = found.path
    try:
        fd = open_checked(found.name, os.O_RDONLY, at=found.at, shown=str(path))
    except OSError as e:
        result.problems.append(f"{e.strerror}; skipped" if isinstance(e, Refused) else f"{path}: {e.strerror or e}")
        return
    with os.fdopen(fd, "rb") as f:  # the lock is held until the file is settled
        if not lock_for_push(f):
            result.problems.append(f"{path}: still being written by a running trainer; skipped")
            return
        lines = _lines(f, path, result)
        if lines is None:
            return
        sent, applied, dup, problem = _send_lines(http, lines)
        result.applied += applied
        result.duplicates += dup
        left = lines[sent:]
        result.left += len(left)
        if problem:
            result.problems.append(f"{path}: {problem}")
        out(f"{path}: {sent} of {len(lines)} sent ({applied} applied, {dup} already held)"
            + (f"; {len(left)} left: {problem}" if left else ""))
        try:
            if not left:
                os.unlink(found.name, dir_fd=found.at)
                result.files_done += 1
            elif sent:
                _replace(found.at, found.name, left)
        except OSError as e:
            result.problems.append(f"{path}: the {sent} lines sent could not be removed from it ({e}); a second "
                                   "push sends them again, answered as duplicates")
    if not left and found.parent is not None:
        with contextlib.suppress(OSError):
            os.rmdir(found.folder, dir_fd=found.parent)  # the run's folder, once empty


def _lines(f, path, result: PushResult) -> list[bytes] | None:
    """The file's non-blank lines, read one by one within the writer's bound; None (skipped, named) when the
    file is over it: it is never read whole."""
    from nanwatch.hooks.report.spool import MAX_FILE_BYTES

    size = os.fstat(f.fileno()).st_size
    over = (f"{path}: {size:,} bytes, over the {MAX_FILE_BYTES:,}-byte bound ({MAX_FILE_BYTES >> 20} MiB) a spool "
            "file has (not a trainer's); skipped, not read")
    if size > MAX_FILE_BYTES:
        result.problems.append(over)
        return None
    lines, budget = [], MAX_FILE_BYTES
    while line := f.readline(budget + 1):
        budget -= len(line)
        if budget < 0:  # grew past the bound while read
            result.problems.append(over)
            return None
        if line.strip():
            lines.append(line.rstrip(b"\r\n"))
    return lines


def _replace(at: int, name: str, left: list[bytes]) -> None:
    """``name`` (in the folder ``at``) holds only ``left`` afterwards: a new file that push itself makes (a
    fresh name, ``O_EXCL``: never something planted) is written, synced, then renamed over it."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    tmp = f".{name}.{secrets.token_hex(8)}.tmp"  # not *.jsonl: never taken for a spool file
    fd = os.open(tmp, flags, 0o600, dir_fd=at)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(b"".join(ln + b"\n" for ln in left))
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, name, src_dir_fd=at, dst_dir_fd=at)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=at)
        raise


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
