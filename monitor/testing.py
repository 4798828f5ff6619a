"""Helpers for tests and the load generator: a real collector in a subprocess on loopback, and a guard for
external tools. Dev-only: nothing in the service imports this module.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

__all__ = ["CollectorProcess", "free_port", "require_tool"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def require_tool(name: str) -> str:
    """Path of an external tool; skip the test when it is missing, or fail if NANWATCH_REQUIRE_TOOLS=1."""
    import pytest

    path = shutil.which(name)
    if path is None:
        msg = f"{name} is not installed"
        if os.environ.get("NANWATCH_REQUIRE_TOOLS") == "1":
            pytest.fail(f"{msg} and NANWATCH_REQUIRE_TOOLS=1")
        pytest.skip(msg)
    return path


class CollectorProcess:
    """``nanwatch serve`` on 127.0.0.1 in a subprocess; settings through ``NANWATCH_*`` env.

    Example usage::

        with CollectorProcess(db_path=tmp_path / "c.db", env={"NANWATCH_RANK_TTL_S": "1"}) as c:
            urllib.request.urlopen(c.url + "/metrics")
    """

    def __init__(self, *, db_path: str | Path, port: int | None = None, env: dict[str, str] | None = None,
                 log_path: str | Path | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.db_path = str(db_path)
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("NANWATCH_")}
        self.env.update({"NANWATCH_LOG_LEVEL": "warning", **(env or {})})
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self, *, timeout_s: float = 30.0) -> CollectorProcess:
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "nanwatch.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
             "--db", self.db_path], env=self.env, stdout=out, stderr=out)
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
