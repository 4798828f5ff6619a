"""Reports the collector did not take, kept on disk for ``nanwatch push`` (no torch: the CLI imports this).

Where: ``<log_dir>/undelivered`` when ``MonitorConfig.log_dir`` (``NANWATCH_LOG_DIR``) is set, else
``$XDG_STATE_HOME/nanwatch/undelivered``, else ``~/.local/state/nanwatch/undelivered``; under it one folder
per run (:func:`run_folder_name`: ``run-`` and the run id, percent-encoded, so that no run id reaches
outside the folder and no two run ids share one) and one file per rank and incarnation,
``rank<r>-<incarnation>.jsonl``: JSON lines, one wire ``StepReport`` each, oldest first.

Bounded: a file stops growing at :data:`MAX_FILE_BYTES`, and nothing more is written once the undelivered
folder holds :data:`MAX_TOTAL_BYTES` or :data:`MAX_FILES` files; what could not be kept is counted as lost.
A writer holds an advisory lock (``flock``) on its file while it is open: :func:`push` skips a file still
being written.

:func:`push` sends the files to a collector, oldest first, in batches, and removes what was acknowledged.
The collector keeps a high-water mark per ``(run, rank, incarnation)``: a report already applied comes back
as a duplicate and is not applied twice, so a second push (or a push of a copy) changes nothing.

Example usage::

    spool = Spool(undelivered_root(config.log_dir), run_id="r1", rank=0, incarnation="ab12")
    spool.keep([report])          # -> 1 (kept), on the sender's thread or at close
    spool.close()
    push(["~/.local/state/nanwatch/undelivered"], "http://collector:8000", token=None, out=print)
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from nanwatch.wire import ReportBatch, StepReport

try:
    import fcntl
except ImportError:  # Windows: no advisory lock; push may then read a file still being written
    fcntl = None

__all__ = ["MAX_FILES", "MAX_FILE_BYTES", "MAX_TOTAL_BYTES", "PushResult", "Spool", "push", "run_folder_name",
           "undelivered_root"]

#: one rank incarnation's file stops growing here
MAX_FILE_BYTES = 64 << 20
#: nothing more is kept once the undelivered folder (all runs) holds this many bytes ...
MAX_TOTAL_BYTES = 1 << 30
#: ... or this many files
MAX_FILES = 1024
#: reports per request of ``push``
PUSH_BATCH = 64

_SAFE = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._@+=-")


def undelivered_root(log_dir: str | os.PathLike | None) -> Path:
    """The folder undelivered reports go to: ``<log_dir>/undelivered``, else the user's state folder's."""
    if log_dir:
        return Path(log_dir).expanduser() / "undelivered"
    state = os.environ.get("XDG_STATE_HOME", "")
    base = Path(state) if os.path.isabs(state) else Path.home() / ".local" / "state"
    return base / "nanwatch" / "undelivered"


def _encode(text: str) -> str:
    """Percent-encode every character outside ``[A-Za-z0-9._@+=-]`` (``%`` itself included): injective."""
    return "".join(c if c in _SAFE else "".join(f"%{b:02X}" for b in c.encode()) for c in text)


def run_folder_name(run_id: str) -> str:
    """One folder name per run id, never ``.``, ``..``, hidden or containing a separator: ``run-`` and the
    percent-encoded id. An encoding longer than 200 characters is cut and ends in ``~`` and a SHA-256 prefix
    of the id (``~`` is never in an encoding, so a cut name never equals a whole one)."""
    name = "run-" + _encode(run_id)
    if len(name) > 200:
        name = name[:160] + "~" + hashlib.sha256(run_id.encode()).hexdigest()[:32]
    return name


def _usage(root: Path) -> tuple[int, int]:
    """(bytes, files) under ``root``."""
    size = files = 0
    for dirpath, _, names in os.walk(root):
        for n in names:
            try:
                size += os.stat(os.path.join(dirpath, n)).st_size
                files += 1
            except OSError:
                pass
    return size, files


class Spool:
    """One sender's file of undelivered reports, opened on the first :meth:`keep`. Thread-safe."""

    def __init__(self, root: str | os.PathLike, *, run_id: str, rank: int, incarnation: str) -> None:
        self.folder = Path(root) / run_folder_name(run_id)
        self.path = self.folder / f"rank{int(rank)}-{_encode(incarnation)}.jsonl"
        self._lock = threading.Lock()
        self._file = None
        self._room = 0  # bytes this file may still take
        self.kept = 0
        self.error: str | None = None  # why the last reports could not be kept

    def keep(self, reports: Iterable[StepReport]) -> int:
        """Append ``reports`` (in order); returns how many were kept. Stops at the first one that would pass
        a bound or cannot be written: the rest are not kept (``error`` says why). Never raises."""
        n = 0
        with self._lock:
            try:
                self._open()
                for r in reports:
                    line = (r.model_dump_json() + "\n").encode()
                    if len(line) > self._room:
                        self.error = (f"the undelivered folder is full ({MAX_FILE_BYTES} bytes a file, "
                                      f"{MAX_TOTAL_BYTES} bytes or {MAX_FILES} files in all)")
                        break
                    self._file.write(line)
                    self._room -= len(line)
                    n += 1
                self._file.flush()
            except (OSError, ValueError) as e:
                self.error = f"cannot write {self.path}: {e}"
            self.kept += n
        return n

    def _open(self) -> None:
        if self._file is not None:
            return
        if self.error is not None:
            raise OSError(self.error)
        root = self.folder.parent
        self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        size, files = _usage(root)
        f = open(self.path, "ab")  # noqa: SIM115 - held open until close()
        if fcntl is not None:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                f.close()
                raise
        self._file = f
        new = 1 if f.tell() == 0 else 0
        self._room = max(0, min(MAX_FILE_BYTES - f.tell(), MAX_TOTAL_BYTES - size)) if files + new <= MAX_FILES else 0

    def close(self) -> None:
        """Flush to disk, release the lock. A later :meth:`keep` appends to the same file again."""
        with self._lock:
            f, self._file = self._file, None
            if f is None:
                return
            try:
                f.flush()
                os.fsync(f.fileno())
            except OSError:
                pass
            finally:
                f.close()


# ---- sending them later ---------------------------------------------------------------------------------------

@dataclass(slots=True)
class PushResult:
    """What ``push`` did: reports the collector applied, already held (duplicates), left on disk."""

    applied: int = 0
    duplicates: int = 0
    left: int = 0
    files_done: int = 0
    problems: list[str] = field(default_factory=list)


def _files(paths: Iterable[str | os.PathLike]) -> Iterator[Path]:
    for p in map(Path, paths):
        p = p.expanduser()
        if p.is_file():
            yield p
        elif p.is_dir():
            yield from sorted(q for q in p.rglob("*.jsonl") if q.is_file())


def push(paths: Iterable[str | os.PathLike], collector: str, *, token: str | None,
         out: Callable[[str], object] = print, timeout_s: float = 30.0) -> PushResult:
    """Send every spool file under ``paths`` to ``collector`` (``POST /v1/reports``), oldest first, and remove
    each file once the collector acknowledged all of it (a file sent in part keeps only what is left). Stops
    a file at its first failure; a file locked by a running sender is skipped. ``token``: None reads
    ``NANWATCH_TOKEN`` / ``NANWATCH_TOKEN_FILE``, as the sender does."""
    from nanwatch.hooks.report.transport import _Http

    http = _Http(collector, token, timeout_s)
    result = PushResult()
    try:
        for path in _files(paths):
            _push_file(http, path, result, out)
    finally:
        http.close()
    return result


def _push_file(http, path: Path, result: PushResult, out: Callable[[str], object]) -> None:
    try:
        f = open(path, "r+b")  # noqa: SIM115 - closed below
    except OSError as e:
        result.problems.append(f"{path}: {e}")
        return
    with f:
        if fcntl is not None:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
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
    sent = applied = dup = 0
    while sent < len(lines):
        chunk = lines[sent:sent + PUSH_BATCH]
        try:
            body = ReportBatch(reports=[StepReport.model_validate_json(ln) for ln in chunk]).model_dump_json()
        except ValueError as e:
            return sent, applied, dup, f"a line after the first {sent} is no StepReport: {str(e)[:200]}"
        try:
            status, data, _ = http.request("POST", "/v1/reports", body.encode())
        except (OSError, Exception) as e:  # noqa: BLE001 - told, never raised
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
