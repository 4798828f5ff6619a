"""``nanwatch serve`` as a child process on loopback (``CollectorProcess``), for the load benchmark
(``nanwatch bench collector``) and for tests that crash and restart the collector. Harness, not product:
the shipped collector (``nanwatch.monitor``) never imports it. Standard library only: it talks to the
child over HTTP.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

__all__ = ["CollectorProcess", "free_port"]


def free_port() -> int:
    """A loopback TCP port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class CollectorProcess:
    """``nanwatch serve`` on 127.0.0.1 in a child process; settings through ``NANWATCH_*`` env (the
    parent's ``NANWATCH_*`` variables are not inherited, so ``env`` says everything).

    Example usage::

        with CollectorProcess(db_path=tmp_path / "c.db", env={"NANWATCH_RANK_TTL_S": "1"}) as c:
            urllib.request.urlopen(c.url + "/metrics")
        CollectorProcess(database_url="postgresql://nanwatch@db/nanwatch")  # a replica (docs/replicas.md)
    """

    def __init__(self, *, db_path: str | Path | None = None, database_url: str | None = None, port: int | None = None,
                 env: dict[str, str] | None = None, log_path: str | Path | None = None) -> None:
        if (db_path is None) == (database_url is None):
            raise ValueError("CollectorProcess needs exactly one of db_path (SQLite) and database_url (PostgreSQL)")
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.db_path = None if db_path is None else str(db_path)
        self.database_url = database_url
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("NANWATCH_")}
        self.env.update({"NANWATCH_LOG_LEVEL": "warning", **(env or {})})
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self, *, timeout_s: float = 30.0) -> CollectorProcess:
        if self.database_url:
            store = ["--database-url", self.database_url]
        elif self.env.get("NANWATCH_DATABASE_URL") or self.env.get("NANWATCH_DATABASE_URL_FILE"):
            store = []  # the environment names the database: ``nanwatch serve`` refuses --db beside it
        else:
            store = ["--db", self.db_path]
        cmd = [sys.executable, "-m", "nanwatch.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port), *store]
        if self.log_path:
            with open(self.log_path, "ab") as out:  # the child keeps its own descriptor
                self.proc = subprocess.Popen(cmd, env=self.env, stdout=out, stderr=out)
        else:
            self.proc = subprocess.Popen(cmd, env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"collector exited with {self.proc.returncode} before it was ready")
            try:
                with urllib.request.urlopen(self.url + "/readyz", timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"collector not ready on {self.url} after {timeout_s}s")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL: no shutdown handlers, no flush -- a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def __enter__(self) -> CollectorProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
