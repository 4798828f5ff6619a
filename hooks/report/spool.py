"""Reports the collector did not take, kept on disk for ``nanwatch push`` (no torch: the CLI imports this).

Where: ``<log_dir>/undelivered`` when ``MonitorConfig.log_dir`` (``NANWATCH_LOG_DIR``) is set, else
``$XDG_STATE_HOME/nanwatch/undelivered``, else ``~/.local/state/nanwatch/undelivered``; under it one folder
per run (:func:`run_folder_name`: ``run-`` and the run id, percent-encoded, so that no run id reaches
outside the folder and no two run ids share one) and one file per rank and incarnation,
``rank<r>-<incarnation>.jsonl``: JSON lines, one wire ``StepReport`` each, oldest first.

Bounded: a file stops growing at :data:`MAX_FILE_BYTES`, and nothing more is written once the undelivered
folder holds :data:`MAX_TOTAL_BYTES` or :data:`MAX_FILES` files; what could not be kept is counted as lost.
A writer holds an advisory lock (``flock``) on its file while it is open: ``nanwatch push``
(``nanwatch.cli.push``) takes it too (:func:`lock_for_push`), and skips a file still being written.

Example usage::

    spool = Spool(undelivered_root(config.log_dir), run_id="r1", rank=0, incarnation="ab12")
    spool.keep([report])          # -> 1 (kept), on the sender's thread or at close
    spool.close()
    list(spool_files([undelivered_root(None)]))   # what nanwatch push would send
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path

from nanwatch.readable import file_name
from nanwatch.wire import StepReport

try:
    import fcntl
except ImportError:  # Windows: no advisory lock; push may then read a file still being written
    fcntl = None

__all__ = ["MAX_FILES", "MAX_FILE_BYTES", "MAX_TOTAL_BYTES", "Spool", "lock_for_push", "run_folder_name",
           "spool_files", "undelivered_root"]

#: one rank incarnation's file stops growing here
MAX_FILE_BYTES = 64 << 20
#: nothing more is kept once the undelivered folder (all runs) holds this many bytes ...
MAX_TOTAL_BYTES = 1 << 30
#: ... or this many files
MAX_FILES = 1024

def undelivered_root(log_dir: str | os.PathLike | None) -> Path:
    """The folder undelivered reports go to: ``<log_dir>/undelivered``, else the user's state folder's."""
    if log_dir:
        return Path(log_dir).expanduser() / "undelivered"
    state = os.environ.get("XDG_STATE_HOME", "")
    base = Path(state) if os.path.isabs(state) else Path.home() / ".local" / "state"
    return base / "nanwatch" / "undelivered"


def run_folder_name(run_id: str) -> str:
    """One folder name per run id, never ``.``, ``..``, hidden or containing a separator: ``run-`` and the
    percent-encoded id (:func:`nanwatch.readable.file_name`, cut past 200 characters)."""
    return "run-" + file_name(run_id, room=196)


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
        self.path = self.folder / f"rank{int(rank)}-{file_name(incarnation)}.jsonl"
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


def spool_files(paths: Iterable[str | os.PathLike]) -> Iterator[Path]:
    """The spool files (``*.jsonl``) named by ``paths``: files as given, folders searched, in name order."""
    for p in map(Path, paths):
        p = p.expanduser()
        if p.is_file():
            yield p
        elif p.is_dir():
            yield from sorted(q for q in p.rglob("*.jsonl") if q.is_file())


def lock_for_push(f) -> bool:
    """Take ``f``'s advisory lock without waiting: False while a running sender still writes it."""
    if fcntl is None:
        return True
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True
