"""A private PostgreSQL server for ``nanwatch bench collector --replicas`` when no ``--database-url`` is
given, and for the tests (their ``pg_cluster`` fixture): ``initdb`` in a temporary folder, a free loopback
port, trust authentication, stopped and deleted at the end. Durable by default (``fsync`` and
``synchronous_commit`` on, as a deployment runs it: a COMMIT the bench counts acknowledged waits for its WAL
flush, so the database's share is not flattered); the tests turn both off (``durable=False``) because they
kill collectors, never the server.

Debian installs the server binaries in ``/usr/lib/postgresql/<major>/bin``, off ``PATH``; they are
looked for there too. ``initdb`` and ``postgres`` refuse to run as root: as root, the folder is given to
``nobody`` and the server runs as that user (``setpriv``); the bench connects over TCP as ``postgres``.

Example usage::

    with PrivateServer.start() as pg:
        url = pg.url()                 # postgresql://postgres@127.0.0.1:PORT/postgres
        fresh = pg.create_database()   # postgresql://postgres@127.0.0.1:PORT/nanwatch_1f0c...
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Callable
from contextlib import ExitStack
from functools import partial
from pathlib import Path

from nanwatch.bench.serve import free_port

__all__ = ["PrivateServer", "databases", "server_binary"]


def server_binary(name: str) -> str | None:
    """Path of a PostgreSQL server binary: on PATH, else Debian's newest ``/usr/lib/postgresql/*/bin``."""
    found = shutil.which(name)
    if found is not None:
        return found
    debian = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"),
                    key=lambda p: int(Path(p).parts[4]) if Path(p).parts[4].isdigit() else 0)
    return debian[-1] if debian else None


class PrivateServer:
    """One running server; ``stop()`` (or leaving the ``with``) shuts it down and deletes its folder."""

    def __init__(self, root: Path, port: int, as_user: list[str]) -> None:
        self.root, self.port, self._as = root, port, as_user
        self.data, self.log = root / "data", root / "server.log"

    @classmethod
    def start(cls, *, durable: bool = True, max_connections: int = 200) -> PrivateServer:
        """Raises ``RuntimeError`` naming what is missing or what failed (the server's log included)."""
        initdb, pg_ctl = server_binary("initdb"), server_binary("pg_ctl")
        if initdb is None or pg_ctl is None:
            raise RuntimeError("PostgreSQL's server binaries (initdb, pg_ctl) are not installed (apt-get install "
                               "postgresql); give --database-url instead")
        root = Path(tempfile.mkdtemp(prefix="nanwatch-pg-"))  # under /tmp: every user can reach it
        as_user: list[str] = []
        if os.geteuid() == 0:  # initdb: "cannot be run as root"
            nobody = pwd.getpwnam("nobody")
            os.chown(root, nobody.pw_uid, nobody.pw_gid)
            as_user = ["setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}", "--clear-groups"]
        server = cls(root, free_port(), as_user)
        try:
            server._run([initdb, "-D", str(server.data), "-U", "postgres", "-A", "trust", "-E", "UTF8",
                         "--no-instructions", *([] if durable else ["--no-sync"])])
            opts = (f"-p {server.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories='{root}' "
                    f"-c max_connections={max_connections}")
            if not durable:
                opts += " -c fsync=off -c synchronous_commit=off -c full_page_writes=off"
            server._run([pg_ctl, "start", "-w", "-t", "60", "-D", str(server.data), "-l", str(server.log),
                         "-o", opts])
        except BaseException:
            shutil.rmtree(root, ignore_errors=True)
            raise
        return server

    def _run(self, cmd: list[str]) -> None:
        done = subprocess.run([*self._as, *cmd], capture_output=True, text=True, timeout=120, cwd=self.root)
        if done.returncode != 0:
            log = self.log.read_text() if self.log.exists() else ""
            raise RuntimeError(f"{Path(cmd[0]).name} failed ({done.returncode}): {done.stderr}{done.stdout}\n{log}")

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self, prefix: str = "nanwatch") -> str:
        """A fresh, empty database; returns its URL (each bench configuration or test its own)."""
        import psycopg

        name = f"{prefix}_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def stop(self) -> None:
        try:
            if (pg_ctl := server_binary("pg_ctl")) is not None:
                self._run([pg_ctl, "stop", "-w", "-m", "fast", "-D", str(self.data)])
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> PrivateServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def databases(stack: ExitStack, url: str | None) -> tuple[Callable[[], str], str]:
    """Where a bench's configurations keep their state: ``url`` for all of them, or (None) a fresh database
    each on a private server entered into ``stack``; returns the function giving the next configuration's
    URL, and a line saying which. Raises ``RuntimeError`` when no private server can be started."""
    if url:
        return (lambda: url), "the database at --database-url (one for every configuration)"
    server = stack.enter_context(PrivateServer.start())
    return partial(server.create_database, "bench"), "a private PostgreSQL on loopback (fsync on), a fresh database each configuration"
