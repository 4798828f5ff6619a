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

from nanwatch.wire import LogitStat, SdpaCall, SiteStat, StepReport

__all__ = ["CollectorProcess", "free_port", "require_tool", "scrape", "step_report"]


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


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    """``GET {url}/metrics`` parsed by prometheus_client: {(sample name, frozenset(labels)): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


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


def step_report(*, run_id: str = "run-1", rank: int = 0, seq: int = 0, step: int | None = None,
                incarnation: str = "inc0", layers: int = 4, dtype: str = "bfloat16", nan_at: str | None = None,
                nan: int = 0, inf: int = 0, backend: str = "flash", logit: float = 12.5,
                mode: str = "none", dropped: int = 0, time_s: float | None = None) -> StepReport:
    """A realistic report of one rank's step: per layer an attention site (forward) and its gradient,
    one SDPA signature per layer, the logits and logprob sites, and a logit bound per layer.
    ``nan_at`` names the site that holds ``nan``/``inf`` non-finite values (forward)."""
    step = seq if step is None else step
    sites, sdpa, logits = [], [], []
    for i in range(layers):
        name = f"model.layers.{i}.self_attn"
        bad = name == nan_at
        sites.append(SiteStat(site=name, kind="attention", phase="forward", dtype=dtype, numel=4096,
                              nan=nan if bad else 0, inf=inf if bad else 0, amax=3.5 + i,
                              headroom=(3.5 + i) / 3.39e38))
        sites.append(SiteStat(site=name, kind="attention", phase="backward", dtype=dtype, numel=4096,
                              nan=0, inf=0, amax=0.01, headroom=0.01 / 3.39e38))
        sdpa.append(SdpaCall(site=name, backend=backend, predicted=backend, confirmed=True, dtype=dtype,
                             shape="2x8x128x64", calls=1))
        logits.append(LogitStat(layer=name, bound=logit + i, source="lse"))
    sites.append(SiteStat(site="lm_head", kind="logits", phase="forward", dtype="float32", numel=32000,
                          nan=0, inf=0, amax=41.0, headroom=41.0 / 3.4e38))
    sites.append(SiteStat(site="logprobs", kind="logprob", phase="forward", dtype="float32", numel=256,
                          nan=0, inf=0, amax=18.0, headroom=18.0 / 3.4e38))
    return StepReport(run_id=run_id, rank=rank, incarnation=incarnation, seq=seq, step=step,
                      time=time.time() if time_s is None else time_s, sites=sites, sdpa=sdpa, logits=logits,
                      attention_mode=mode, dropped_reports=dropped,
                      first_offender=nan_at if (nan or inf) else None,
                      first_offender_phase="forward" if (nan or inf) else None)
