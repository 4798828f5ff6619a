"""A private PostgreSQL cluster for the tests, started as they start Prometheus: ``initdb`` in a temporary
folder, a free loopback port, trust authentication, its unix socket in that folder, stopped at the end.

Debian installs the server binaries in ``/usr/lib/postgresql/<major>/bin``, off ``PATH``; they are looked
for there too. Without them the tests that need a cluster are skipped (failed under
``NANWATCH_REQUIRE_TOOLS=1``, as CI runs). ``initdb`` and ``postgres`` refuse to run as root (CI's
container is root, so is this machine): then the cluster's folder is given to ``nobody`` and the server
runs as that user (``setpriv``), while the tests connect over TCP as the ``postgres`` role.

Example usage::

    with PgCluster.start() as pg:
        url = pg.create_database("t1")        # postgresql://postgres@127.0.0.1:PORT/t1
"""

from __future__ import annotations

import glob
import itertools
import os
import pwd
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from nanwatch.bench.serve import free_port

__all__ = ["PgCluster", "pg_binary"]

_counter = itertools.count()


def pg_binary(name: str) -> str:
    """Path of a PostgreSQL server binary: on PATH, else Debian's newest ``/usr/lib/postgresql/*/bin``; skip
    the test when it is missing, or fail if NANWATCH_REQUIRE_TOOLS=1."""
    found = shutil.which(name)
    if found is None:
        debian = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"),
                        key=lambda p: int(Path(p).parts[4]) if Path(p).parts[4].isdigit() else 0)
        found = debian[-1] if debian else None
    if found is None:
        msg = f"PostgreSQL's {name} is not installed (apt-get install postgresql)"
        if os.environ.get("NANWATCH_REQUIRE_TOOLS") == "1":
            pytest.fail(f"{msg} and NANWATCH_REQUIRE_TOOLS=1")
        pytest.skip(msg)
    return found


class PgCluster:
    """One running cluster; ``stop()`` (or leaving the ``with``) shuts it down and deletes its folder."""

    def __init__(self, root: Path, port: int, as_user: list[str]) -> None:
        self.root, self.port, self._as = root, port, as_user
        self.data, self.log = root / "data", root / "server.log"

    @classmethod
    def start(cls) -> PgCluster:
        initdb, pg_ctl = pg_binary("initdb"), pg_binary("pg_ctl")
        root = Path(tempfile.mkdtemp(prefix="nanwatch-pg-"))  # under /tmp: every user can reach it
        as_user: list[str] = []
        if os.geteuid() == 0:  # initdb: "cannot be run as root"
            nobody = pwd.getpwnam("nobody")
            os.chown(root, nobody.pw_uid, nobody.pw_gid)
            as_user = ["setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}", "--clear-groups"]
        cluster = cls(root, free_port(), as_user)
        try:
            cluster._run([initdb, "-D", str(cluster.data), "-U", "postgres", "-A", "trust", "-E", "UTF8",
                          "--no-sync", "--no-instructions"])
            # fsync off: the tests kill collectors, never this server; a short checkpoint_timeout is not needed
            opts = (f"-p {cluster.port} -c listen_addresses=127.0.0.1 -c unix_socket_directories='{root}' "
                    "-c fsync=off -c synchronous_commit=off -c full_page_writes=off -c max_connections=200")
            cluster._run([pg_ctl, "start", "-w", "-t", "60", "-D", str(cluster.data), "-l", str(cluster.log),
                          "-o", opts])
        except BaseException:
            shutil.rmtree(root, ignore_errors=True)
            raise
        return cluster

    def _run(self, cmd: list[str]) -> None:
        done = subprocess.run([*self._as, *cmd], capture_output=True, text=True, timeout=120, cwd=self.root)
        if done.returncode != 0:
            log = self.log.read_text() if self.log.exists() else ""
            raise RuntimeError(f"{Path(cmd[0]).name} failed ({done.returncode}): {done.stderr}{done.stdout}\n{log}")

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def create_database(self, prefix: str = "t") -> str:
        """A fresh, empty database; returns its URL (each test its own, so none sees another's rows)."""
        import psycopg

        name = f"{prefix}_{os.getpid()}_{next(_counter)}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def stop(self) -> None:
        try:
            self._run([pg_binary("pg_ctl"), "stop", "-w", "-m", "fast", "-D", str(self.data)])
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> PgCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
