"""Reports the collector did not take, kept on disk for ``nanwatch push`` (no torch: the CLI imports this).

Where: ``<log_dir>/undelivered`` when ``MonitorConfig.log.dir`` (``NANWATCH_LOG_DIR``) is set, else
``$XDG_STATE_HOME/nanwatch/undelivered``, else ``~/.local/state/nanwatch/undelivered``; under it one folder
per run (:func:`run_folder_name`: ``run-`` and the run id, percent-encoded, so that no run id reaches
outside the folder and no two run ids share one) and one file per rank and incarnation,
``rank<r>-<incarnation>.jsonl``: JSON lines, one wire ``StepReport`` each, oldest first.

Bounded: a file stops growing at :data:`MAX_FILE_BYTES`, and nothing more is written once the undelivered
folder holds :data:`MAX_TOTAL_BYTES` or :data:`MAX_FILES` files; what could not be kept is counted as lost.
A writer holds an advisory lock (``flock``) on its file while it is open: ``nanwatch push``
(``nanwatch.cli.push``) takes it too (:func:`lock_for_push`), and skips a file still being written.

Never through a link (#37): a shared ``log_dir`` is a folder other users may write, so whatever they planted
there is refused, not followed. The ``undelivered`` folder, the run folder and the file are each opened
relative to the folder above (``dir_fd``) with ``O_NOFOLLOW`` and checked after the open (``fstat``): a
folder, or a regular file with one link, owned by this user; anything else is :class:`Refused`. The writer
then keeps nothing (warned once; the sender counts those reports lost, with why), and :func:`spool_files`
names it for push to report and skips it. Only ``log_dir`` itself (or the state folder) is followed as
given: it is the user's own choice. POSIX only (``dir_fd`` and ``O_NOFOLLOW``).

Example usage::

    spool = Spool(undelivered_root(config.log.dir), run_id="r1", rank=0, incarnation="ab12")
    spool.keep([report])          # -> 1 (kept), on the sender's thread or at close
    spool.close()
    [f.path for f in spool_files([undelivered_root(None)])]   # what nanwatch push would send
"""

from __future__ import annotations

import errno
import os
import stat
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

from nanwatch.hooks.failsafe import WarnOnce
from nanwatch.readable import file_name
from nanwatch.wire import StepReport

try:
    import fcntl
except ImportError:  # Windows: no advisory lock; push may then read a file still being written
    fcntl = None

__all__ = ["MAX_FILES", "MAX_FILE_BYTES", "MAX_TOTAL_BYTES", "Refused", "Spool", "SpoolFile", "lock_for_push",
           "open_checked", "open_folder", "run_folder_name", "spool_files", "undelivered_root"]

#: one rank incarnation's file stops growing here
MAX_FILE_BYTES = 64 << 20
#: nothing more is kept once the undelivered folder (all runs) holds this many bytes ...
MAX_TOTAL_BYTES = 1 << 30
#: ... or this many files
MAX_FILES = 1024

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)  # getattr: importable on Windows
_AS_GIVEN = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)  # a folder the user named
_FOLDER = _AS_GIVEN | _NOFOLLOW
_warn = WarnOnce()


class Refused(OSError):
    """A folder or file the spool did not make: a symbolic link, not a folder or regular file, another user's,
    or a file with more than one link. Never followed, read nor written."""


class _Again(OSError):
    """The file could not be opened before: not tried again."""


def _check(fd: int, shown: str, *, folder: bool) -> None:
    """Raise :class:`Refused` unless ``fd`` is a folder (``folder``) or a regular file with one link, owned by
    this user (closing ``fd`` then)."""
    st = os.fstat(fd)
    why = None
    if not (stat.S_ISDIR if folder else stat.S_ISREG)(st.st_mode):
        why = "not a folder" if folder else "not a regular file"
    elif hasattr(os, "getuid") and st.st_uid != os.getuid():
        why = f"owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    elif not folder and st.st_nlink != 1:
        why = f"a file with {st.st_nlink} hard links"
    if why:
        os.close(fd)
        raise Refused(errno.EPERM, f"{shown} is {why}: refused, never followed nor written")


def _refused_link(e: OSError, shown: str) -> OSError:
    """``O_NOFOLLOW`` met a symbolic link (ELOOP; ENOTDIR with ``O_DIRECTORY``): say so."""
    if e.errno in (errno.ELOOP, errno.ENOTDIR):
        return Refused(e.errno, f"{shown} is a symbolic link or not a folder: refused, never followed")
    return e


def open_folder(name: str, *, at: int | None, shown: str, create: bool = False) -> int:
    """A descriptor of folder ``name`` inside the folder ``at`` (a descriptor; None: ``name`` is a path, its
    last part not followed), made ``0o700`` first when ``create``; :class:`Refused` for a link, or a folder
    not this user's."""
    if create:
        try:
            os.mkdir(name, 0o700, dir_fd=at)
        except FileExistsError:
            pass
    try:
        fd = os.open(name, _FOLDER, dir_fd=at)
    except OSError as e:
        raise _refused_link(e, shown) from None
    _check(fd, shown, folder=True)
    return fd


def open_checked(name: str, flags: int, *, at: int, shown: str, mode: int = 0o600) -> int:
    """A descriptor of file ``name`` in the folder ``at``, opened with ``flags`` and never through a link
    (``O_NONBLOCK`` too: a planted FIFO does not hang the open); :class:`Refused` unless it is a regular file
    of this user's with one link."""
    try:
        fd = os.open(name, flags | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0), mode, dir_fd=at)
    except OSError as e:
        raise _refused_link(e, shown) from None
    _check(fd, shown, folder=False)
    return fd


def _open_root(root: Path) -> int:
    """The undelivered folder (its parent made as the user configured it, followed as given; the folder
    itself never through a link)."""
    root.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    parent = os.open(root.parent, _AS_GIVEN)
    try:
        return open_folder(root.name, at=parent, shown=str(root), create=True)
    finally:
        os.close(parent)

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


def _usage(root_fd: int) -> tuple[int, int]:
    """(bytes, files) under the folder ``root_fd``, no link followed."""
    size = files = 0
    for _, _, names, dfd in os.fwalk(dir_fd=root_fd):
        for n in names:
            try:
                st = os.stat(n, dir_fd=dfd, follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                size += st.st_size
                files += 1
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
            except _Again:
                pass  # not opened before either: ``error`` says why
            except Refused as e:
                if self.error is None:  # said once, where it was refused; the sender counts what is lost
                    _warn(f"undelivered reports not kept: {e.strerror}")
                self.error = e.strerror
            except (OSError, ValueError, NotImplementedError) as e:  # NotImplementedError: no dir_fd (Windows)
                self.error = f"cannot write {self.path}: {e}"
            self.kept += n
        return n

    def _open(self) -> None:
        if self._file is not None:
            return
        if self.error is not None:
            raise _Again(self.error)
        root = _open_root(self.folder.parent)
        try:
            folder = open_folder(self.folder.name, at=root, shown=str(self.folder), create=True)
            try:
                size, files = _usage(root)
                fd = open_checked(self.path.name, os.O_WRONLY | os.O_APPEND | os.O_CREAT, at=folder,
                                  shown=str(self.path))
            finally:
                os.close(folder)
        finally:
            os.close(root)
        f = os.fdopen(fd, "ab")
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


class SpoolFile(NamedTuple):
    """A spool file found by :func:`spool_files`: its name in the folder ``at`` (a descriptor, open while the
    iteration is at it), the folder's name in ``parent`` (None: not removable), and the path to show."""

    at: int
    name: str
    path: Path
    parent: int | None
    folder: str


def spool_files(paths: Iterable[str | os.PathLike], *, refused: Callable[[str], object] = lambda why: None
                ) -> Iterator[SpoolFile]:
    """The spool files (``*.jsonl``) named by ``paths``: files as given, folders searched, in name order; each
    path's last part and everything under it never through a link. A link, or a folder not this user's, is
    skipped and told to ``refused`` (a file is checked when opened: :func:`open_checked`)."""
    for p in map(Path, paths):
        p = p.expanduser()
        if p.name in ("", ".", ".."):  # "/", "." or "..": nothing to stop following; the folder as given
            try:
                fd = os.open(p, _AS_GIVEN)
            except OSError as e:
                refused(f"{p}: {e.strerror or e}")
                continue
            yield from _walk(fd, p, None, "", refused)
            continue
        try:
            parent = os.open(p.parent, _AS_GIVEN)
        except OSError as e:
            refused(f"{p}: {e.strerror or e}")
            continue
        try:
            yield from _named(parent, p, refused)
        finally:
            os.close(parent)


def _named(parent: int, p: Path, refused: Callable[[str], object]) -> Iterator[SpoolFile]:
    """``p`` (in the folder ``parent``): a folder searched, else the file itself."""
    try:
        st = os.stat(p.name, dir_fd=parent, follow_symlinks=False)
    except OSError as e:
        refused(f"{p}: {e.strerror or e}")
        return
    if stat.S_ISLNK(st.st_mode):
        refused(f"{p} is a symbolic link: refused, never followed")
    elif stat.S_ISDIR(st.st_mode):
        try:
            fd = open_folder(p.name, at=parent, shown=str(p))
        except OSError as e:
            refused(e.strerror if isinstance(e, Refused) else f"{p}: {e.strerror or e}")
            return
        yield from _walk(fd, p, parent, p.name, refused)
    else:
        yield SpoolFile(parent, p.name, p, None, "")


def _walk(fd: int, shown: Path, parent: int | None, name: str, refused: Callable[[str], object]
          ) -> Iterator[SpoolFile]:
    """The ``*.jsonl`` files under the folder ``fd`` (closed after), in name order; links and folders not this
    user's are told to ``refused``, never entered."""
    try:
        with os.scandir(fd) as it:
            entries = sorted(it, key=lambda e: e.name)
        for e in entries:
            where = shown / e.name
            if e.is_symlink():
                refused(f"{where} is a symbolic link: refused, never followed")
            elif e.is_dir(follow_symlinks=False):
                try:
                    sub = open_folder(e.name, at=fd, shown=str(where))
                except OSError as err:
                    refused(err.strerror if isinstance(err, Refused) else f"{where}: {err.strerror or err}")
                    continue
                yield from _walk(sub, where, fd, e.name, refused)
            elif e.name.endswith(".jsonl"):
                yield SpoolFile(fd, e.name, where, parent, name)
    finally:
        os.close(fd)


def lock_for_push(f) -> bool:
    """Take ``f``'s advisory lock without waiting: False while a running sender still writes it."""
    if fcntl is None:
        return True
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return False
    return True
