"""``nanwatch bench collector``: a load generator (a benchmark, not a test). N ranks x S sites, each rank
reporting once per second against one collector, measuring sustained reports/s, ingest latency,
/metrics render time and the collector's RSS.

Kept cheap so that it does not steal the collector's CPU: bodies are encoded once per rank (only the
sequence number changes), and each rank is a coroutine on its own raw HTTP/1.1 keep-alive connection.

The project's own hostile-client measurement (``tests/collector_attack_bench.py``, from a checkout: not
shipped) runs this load beside an attacker through one seam, :func:`against_collector`'s ``attacker``, and
renders with :func:`phase_lines`, :func:`quantiles`, :func:`new_phase`, :func:`describe_load` and
:func:`parser`: the internal seam the bench package's docstring lists.

Example usage::

    nanwatch bench collector --ranks 1024 --sites 64 --duration 30
    nanwatch bench collector --url http://127.0.0.1:8000   # an already running collector
    nanwatch bench collector --replicas 1,2,4 --scope job --ranks 1024 --jobs-sweep 8,32   # on PostgreSQL

With ``--replicas`` the collectors are replicas on one PostgreSQL (:mod:`nanwatch.bench.collector_replicas`, which
``nanwatch bench collector`` hands the parsed options to; this parser holds its options).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import statistics
import tempfile
import time
import urllib.parse
import zlib
from collections.abc import Awaitable, Callable
from typing import Protocol

from nanwatch.bench.http1 import REQUEST_TIMEOUT_S, auth_line, count, get_once, request
from nanwatch.bench.jobs import Sender, matrix_configs, priming, senders
from nanwatch.wire import LogitStat, SdpaCall, SiteStat, StepReport

__all__ = ["AttackerSeam", "against_collector", "describe_load", "main", "new_phase", "parser", "phase_lines", "quantiles",
           "run_load", "synthetic_report", "target_of", "target_rate"]

IDLE_REUSE_S = 4.0
"""A sender idle longer reconnects first, as HTTP clients do: uvicorn closes keep-alives idle for 5 s."""

def synthetic_report(*, run_id: str = "run-1", rank: int = 0, world_size: int | None = None, seq: int = 0,
                     step: int | None = None,
                     incarnation: str = "inc0", layers: int = 4, dtype: str = "bfloat16",
                     nan_at: str | None = None, nan: int = 0, inf: int = 0, backend: str = "flash",
                     logit: float = 12.5, mode: str = "none", dropped: int = 0,
                     time_s: float | None = None, skipped: bool | None = None) -> StepReport:
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
    return StepReport(run_id=run_id, rank=rank, world_size=world_size or rank + 1, incarnation=incarnation, seq=seq,
                      step=step,
                      time=time.time() if time_s is None else time_s, sites=sites, sdpa=sdpa, logits=logits,
                      attention_mode=mode, dropped_reports=dropped, step_skipped=skipped,
                      first_offender=nan_at if (nan or inf) else None,
                      first_offender_phase="forward" if (nan or inf) else None)


def _phase_at(stats: dict, t: float) -> dict | None:
    """The measured phase whose window holds loop time ``t`` (None: warmup, or between phases)."""
    for phase in stats["phases"]:
        if phase["from"] <= t < phase["to"]:
            return phase
    return None


def new_phase(name: str, t_from: float, t_to: float) -> dict:
    return {"name": name, "from": t_from, "to": t_to, "lat": [], "status": {}, "scrape": [], "scrape_failed": {},
            "lag": [], "by_kind": {}, "reports": 0,
            "rss": None, "fds": None, "cpu_s": None}


def target_of(route: str, replicas: int, index: int, n: int, run_id: str) -> int:
    """Which of ``replicas`` collectors behind one address gets body ``n`` of sender ``index``: ``rr``,
    round-robin per request (each sender starting at its own, as nginx's default spreads requests);
    ``sticky``, by the run id (CRC-32, as nginx's ``hash $arg_run_id`` keeps a run on one replica)."""
    if replicas == 1:
        return 0
    if route == "sticky":
        return zlib.crc32(run_id.encode()) % replicas
    return (index + n) % replicas


async def _sender(targets: list[tuple[str, int]], sender: Sender, index: int, args: argparse.Namespace, stats: dict,
                  stop: float, start_at: float) -> None:
    """One stream of POSTs (a rank, a job's poster, or ranks' heartbeats; ``nanwatch.bench.jobs``) on a
    keep-alive connection to each of ``targets`` (one collector, or replicas: ``target_of`` picks per
    request), reopened (inside the timed request) when the server closes it. A stream that falls behind
    sends at once, so the sustained rate shows what the collectors took. Latency is recorded for the phase
    in which the request was sent; a request unanswered after ``REQUEST_TIMEOUT_S`` counts as status
    ``timeout`` with its wait as latency. A 503 is counted, not retried (each is a retry the trainer's
    sender would make)."""
    auth = auth_line(args.token)
    conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter] | None] = [None] * len(targets)
    loop = asyncio.get_running_loop()
    n, last = 0, [-math.inf] * len(targets)
    route = getattr(args, "route", "rr")
    try:
        while True:
            await asyncio.sleep(max(0.0, start_at + sender.offset + n * sender.every - loop.time()))
            if loop.time() >= stop:
                return
            t = target_of(route, len(targets), index, n, sender.run(n))
            host, port = targets[t]
            body = sender.body(n)
            head = (f"POST /v1/reports HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n{auth}"
                    f"Content-Length: {len(body)}\r\n\r\n").encode()
            t0 = loop.time()
            if conns[t] is not None and t0 - last[t] > IDLE_REUSE_S:  # the server closes idle keep-alives (5 s)
                conns[t][1].close()
                conns[t] = None
            status, conns[t] = await _send_report(host, port, conns[t], head, body)
            t1 = last[t] = loop.time()
            if (phase := _phase_at(stats, t0)) is not None:
                phase["lat"].append(t1 - t0)
                phase["by_kind"].setdefault(sender.kind, []).append(t1 - t0)
                phase["reports"] += sender.reports if status == 200 else 0
                count(phase["status"], status)
            n += 1
    finally:
        for conn in conns:
            if conn is not None:
                conn[1].close()


async def _prime(targets: list[tuple[str, int]], args: argparse.Namespace) -> None:
    """Post ``nanwatch.bench.jobs.priming``'s bodies, one after another, before the clock starts (routed as
    the load is; a 503 from replicas catching up with each other is retried)."""
    conns: list[tuple | None] = [None] * len(targets)
    for n, (run_id, body) in enumerate(priming(args)):
        t = target_of(getattr(args, "route", "rr"), len(targets), 0, n, run_id)
        host, port = targets[t]
        head = (f"POST /v1/reports HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                f"{auth_line(args.token)}Content-Length: {len(body)}\r\n\r\n").encode()
        for _ in range(50):
            status, conns[t] = await _send_report(host, port, conns[t], head, body)
            if status != 503:
                break
            await asyncio.sleep(0.1)
        if status != 200:
            raise SystemExit(f"nanwatch bench: priming the collector got {status}")
    for conn in conns:
        if conn is not None:
            conn[1].close()


async def _send_report(host: str, port: int, conn: tuple | None, head: bytes,
                       body: bytes) -> tuple[int | str, tuple | None]:
    """POST one report, (re)connecting first if needed: (status or ``timeout``/``conn-error``, the
    connection to reuse or None)."""
    try:
        if conn is None:
            conn = await asyncio.wait_for(asyncio.open_connection(host, port), REQUEST_TIMEOUT_S)
        status, _, keep = await asyncio.wait_for(request(*conn, head, body), REQUEST_TIMEOUT_S)
    except asyncio.TimeoutError:
        status, keep = "timeout", False
    except (OSError, EOFError, ValueError, IndexError):
        status, keep = "conn-error", False
    if not keep and conn is not None:
        conn[1].close()
        conn = None
    return status, conn


async def _scraper(host: str, port: int, stats: dict, stop: float, every_s: float, token: str | None) -> None:
    """Prometheus: a ``/metrics`` scrape every ``every_s``, timed, on a fresh connection each time."""
    loop = asyncio.get_running_loop()
    head = f"GET /metrics HTTP/1.1\r\nHost: {host}\r\n{auth_line(token)}Connection: close\r\n\r\n".encode()
    await asyncio.sleep(every_s)
    while loop.time() < stop:
        t0 = loop.time()  # a fresh connection each time, as idle keep-alives are closed after 5 s
        status, body = await get_once(host, port, head)
        if (phase := _phase_at(stats, t0)) is not None:
            if status == 200:
                phase["scrape"].append((loop.time() - t0, len(body), body.count(b"\n")))
            else:
                count(phase["scrape_failed"], status)
        await asyncio.sleep(every_s)


async def _loop_lag(stats: dict, stop: float, every_s: float = 0.05) -> None:
    """How late this process's own event loop wakes up: a busy bench inflates the latency it measures."""
    loop = asyncio.get_running_loop()
    while loop.time() < stop:
        t0 = loop.time()
        await asyncio.sleep(every_s)
        if (phase := _phase_at(stats, t0)) is not None:
            phase["lag"].append(loop.time() - t0 - every_s)


async def _sample_collector(pid: int, stats: dict) -> None:
    """The collector's RSS and open descriptors at the end of each phase (attackers still connected), and
    the CPU seconds it spent during the phase."""
    loop = asyncio.get_running_loop()
    for phase in stats["phases"]:
        await asyncio.sleep(max(0.0, phase["from"] - loop.time()))
        cpu0 = _cpu_s(pid)
        await asyncio.sleep(max(0.0, phase["to"] - 0.05 - loop.time()))
        phase["rss"], phase["fds"] = _rss_mb(pid), _open_fds(pid)
        if cpu0 is not None and (cpu1 := _cpu_s(pid)) is not None:
            phase["cpu_s"] = cpu1 - cpu0


class AttackerSeam(Protocol):
    """What runs beside the ranks in the attacked windows (the seam ``tests/collector_attack_bench.py``'s hostile
    client plugs into): primed before the clock starts, started with the windows, its counts collected at the
    end (blocking: it runs in a process of its own)."""

    async def prime(self, host: str, port: int) -> dict | None: ...

    def start(self, host: str, port: int, windows: list[tuple[float, float]]) -> None: ...

    def result(self) -> tuple[list[dict], float]: ...


async def _run(url: str | list[str], args: argparse.Namespace, pid: int | None = None,
               attacker: AttackerSeam | None = None,
               probes: Callable[[dict, float], list[Awaitable]] | None = None) -> dict:
    """Warmup, then the measured windows: one unloaded, or (with an ``attacker``) ``args.rounds`` pairs of an
    unloaded and an attacked window, alternating so that drift on the machine falls on both alike, each pair
    followed by ``args.settle`` unmeasured seconds. ``url``: one collector, or replicas (the load spread
    over them, each scraped); ``probes(stats, stop)``: more samplers to run beside the load (the replicas
    bench's CPU and database samplers)."""
    targets = [(u.hostname, u.port) for u in map(urllib.parse.urlsplit, [url] if isinstance(url, str) else url)]
    loop = asyncio.get_running_loop()
    await _prime(targets, args)
    primed = await attacker.prime(*targets[0]) if attacker is not None else None
    start = loop.time() + 0.5
    t = start + args.warmup
    phases = []
    for _ in range(args.rounds if attacker else 1):
        for name in ("unloaded", "under attack") if attacker else ("unloaded",):
            phases.append(new_phase(name, t, t + args.duration))
            t += args.duration
        if attacker:  # what an attack left behind (a request still being answered) is not the next window's
            t += args.settle
    stop = phases[-1]["to"]
    stats: dict = {"phases": phases, "attacks": [], "primed": primed}
    tasks = [_sender(targets, s, i, args, stats, stop, start) for i, s in enumerate(senders(args, synthetic_report))]
    tasks += [_scraper(host, port, stats, stop, args.scrape_every, args.token) for host, port in targets]
    tasks.append(_loop_lag(stats, stop))
    if pid is not None:
        tasks.append(_sample_collector(pid, stats))
    if probes is not None:
        tasks += probes(stats, stop)
    if attacker is not None:
        attacker.start(*targets[0], [(p["from"], p["to"]) for p in phases if p["name"] == "under attack"])
    await asyncio.gather(*tasks)
    if attacker is not None:
        stats["attacks"], stats["attacker_cpu_s"] = await loop.run_in_executor(None, attacker.result)
    return stats


def _rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _cpu_s(pid: int) -> float | None:
    """User plus system CPU seconds process ``pid`` has used (its threads included)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def _open_fds(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def _nofile_of(pid: int) -> str | None:
    """The soft open file limit of process ``pid``, as /proc shows it."""
    try:
        with open(f"/proc/{pid}/limits") as f:
            for line in f:
                if line.startswith("Max open files"):
                    return line.split()[3]
    except OSError:
        return None
    return None


def quantiles(values: list[float]) -> tuple[float, float, float] | None:
    """(p50, p99, max) of ``values``; None without samples."""
    if not values:
        return None
    v = sorted(values)
    if len(v) == 1:
        return v[0], v[0], v[0]
    q = statistics.quantiles(v, n=100, method="inclusive")
    return q[49], q[98], v[-1]


def phase_lines(phase: dict, seconds: float, args: argparse.Namespace) -> list[str]:
    """Throughput, statuses, ingest latency and /metrics scrapes of one measured phase of ``seconds``."""
    lat = quantiles(phase["lat"])
    lines = [
        f"sustained: {phase['reports'] / seconds:.0f} reports/s in {len(phase['lat']) / seconds:.0f} requests/s "
        f"over {seconds:.0f} s (target {target_rate(args):.0f} reports/s); statuses {phase['status']}",
        f"ingest latency: p50 {lat[0] * 1e3:.1f} ms, p99 {lat[1] * 1e3:.1f} ms, max {lat[2] * 1e3:.1f} ms"
        if lat else "ingest latency: no samples",
    ]
    if len(phase["by_kind"]) > 1:
        lines += [f"  {kind}: p50 {q[0] * 1e3:.1f} ms, p99 {q[1] * 1e3:.1f} ms ({len(v)} requests)"
                  for kind, v in phase["by_kind"].items() if (q := quantiles(v))]
    if scrapes := phase["scrape"]:
        times = [t for t, _, _ in scrapes]
        lines.append(f"/metrics: {len(scrapes)} scrapes, median {statistics.median(times) * 1e3:.0f} ms, "
                     f"max {max(times) * 1e3:.0f} ms, {scrapes[-1][2]} lines, {scrapes[-1][1] / 1e6:.1f} MB")
    if phase["scrape_failed"]:
        lines.append(f"/metrics failed: {phase['scrape_failed']}")
    return lines


def target_rate(args: argparse.Namespace) -> float:
    """Reports a second the configuration sends when the collector keeps up."""
    if args.scope == "rank":
        return args.jobs * args.ranks * args.rate
    return args.jobs * ((1 + min(args.details, args.ranks - 1)) * args.rate + args.ranks / args.heartbeat_every)


def describe_load(args: argparse.Namespace) -> str:
    jobs = f"{args.jobs} jobs of " if args.jobs > 1 else ""
    if args.scope == "rank":
        return f"{jobs}{args.ranks} ranks x {args.sites} sites, per-rank reports at {args.rate}/s per rank"
    return (f"{jobs}{args.ranks} ranks x {args.sites} sites, job-level: a job report + {args.details} details at "
            f"{args.rate}/s, heartbeats every {args.heartbeat_every:g} s in batches of {args.heartbeat_batch}")


def _report(stats: dict, args: argparse.Namespace, rss: float | None) -> str:
    phase = stats["phases"][0]
    lines = [f"machine: {os.cpu_count()} CPUs; load: {describe_load(args)}", *phase_lines(phase, args.duration, args)]
    if phase["cpu_s"] is not None:
        lines.append(f"collector CPU: {100 * phase['cpu_s'] / args.duration:.0f}% of one core")
    if rss is not None:
        lines.append(f"collector RSS: {rss:.0f} MiB")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nanwatch bench collector", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="an already running collector (default: start one on a temp database)")
    p.add_argument("--ranks", type=int, default=1024, help="ranks of each job")
    p.add_argument("--sites", type=int, default=64)
    p.add_argument("--rate", type=float, default=1.0, help="steps per second (a report per rank, or per job)")
    p.add_argument("--scope", choices=("rank", "job"), default="rank",
                   help="rank: every rank posts its report (before wire 1.4); job: one job report a step, "
                        "detail reports, heartbeats")
    p.add_argument("--jobs", type=int, default=1, help="concurrent jobs (run ids)")
    p.add_argument("--details", type=int, default=2, help="job mode: detail reports a step (ranks that differ)")
    p.add_argument("--heartbeat-every", type=float, default=15.0, help="job mode: each rank's heartbeat interval")
    p.add_argument("--heartbeat-batch", type=int, default=8,
                   help="job mode: heartbeats a request (8: one request per node of 8 ranks)")
    p.add_argument("--connections", type=int, default=1024, help="keep-alive connections the senders share")
    p.add_argument("--duration", type=float, default=20.0, help="measured seconds (of each window)")
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--scrape-every", type=float, default=5.0)
    p.add_argument("--run-id", default="loadgen")
    p.add_argument("--token", default=os.environ.get("NANWATCH_TOKEN") or None,
                   help="bearer token for ingest and scrapes (default: $NANWATCH_TOKEN, else none)")
    p.add_argument("--matrix", action="store_true",
                   help="each of --matrix-ranks per rank and per job at each of --matrix-scrapes, a fresh "
                        "collector each, then one table")
    p.add_argument("--matrix-ranks", type=lambda v: [int(x) for x in v.split(",")], default=[1024, 4096, 65536])
    p.add_argument("--matrix-scrapes", type=lambda v: [float(x) for x in v.split(",")], default=[5.0, 15.0])
    p.add_argument("--jobs-sweep", type=lambda v: [int(x) for x in v.split(",")], default=None,
                   help="job mode: these numbers of concurrent --ranks jobs in turn, then one table")
    replicas = p.add_argument_group(
        "replicas", "nanwatch serve replicas on one PostgreSQL (docs/replicas.md): each count in turn, the load "
        "spread over them, each scraped; CPU of the replicas and the database server, lock waits and "
        "conflicts, and a projection to more cores")
    replicas.add_argument("--replicas", type=lambda v: [int(x) for x in v.split(",")], default=None,
                          metavar="N[,N...]", help="start N replicas (e.g. 1,2,4) for each configuration")
    replicas.add_argument("--database-url", metavar="URL",
                          help="the PostgreSQL the replicas share (default with --replicas: a private server the "
                               "bench starts, initdb in a temp dir on loopback, a fresh database each "
                               "configuration; needs PostgreSQL's server binaries)")
    replicas.add_argument("--route", choices=("rr", "sticky", "both"), default="rr",
                          help="spread the load round-robin per request (rr), by run id as nginx's hash "
                               "$arg_run_id (sticky), or each configuration both ways")
    replicas.add_argument("--total-ranks", type=int, default=None, metavar="N",
                          help="with --jobs-sweep: split N ranks over the sweep's jobs (ranks = N / jobs) and keep "
                               "--scope, so the load stays fixed while fewer runs share it (1 job: every write "
                               "under one run's row lock)")
    return p


def _row(args: argparse.Namespace, stats: dict) -> dict:
    """One configuration's figures for the side-by-side table."""
    phase, seconds = stats["phases"][0], args.duration
    lat = quantiles(phase["lat"]) or (math.nan,) * 3
    scrapes = phase["scrape"]
    return dict(ranks=args.ranks, jobs=args.jobs, scope=args.scope, scrape=args.scrape_every,
                target=target_rate(args), reports=phase["reports"] / seconds, requests=len(phase["lat"]) / seconds,
                p50=lat[0] * 1e3, p99=lat[1] * 1e3, cpu=100 * (phase["cpu_s"] or math.nan) / seconds,
                metrics_ms=statistics.median(t for t, _, _ in scrapes) * 1e3 if scrapes else math.nan,
                metrics_mb=scrapes[-1][1] / 1e6 if scrapes else math.nan,
                errors=sum(n for k, n in phase["status"].items() if k != 200),
                lag=(quantiles(phase["lag"]) or (math.nan,) * 3)[1] * 1e3)


def _table(rows: list[dict]) -> str:
    head = ("jobs x ranks", "scope", "scrape", "reports/s (target)", "req/s", "p50 ms", "p99 ms", "CPU %",
            "/metrics ms, MB", "not 200", "bench lag p99 ms")
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        lines.append(" | ".join((
            f"{r['jobs']} x {r['ranks']}", r["scope"], f"{r['scrape']:g} s", f"{r['reports']:.0f} ({r['target']:.0f})",
            f"{r['requests']:.0f}", f"{r['p50']:.1f}", f"{r['p99']:.1f}", f"{r['cpu']:.0f}",
            f"{r['metrics_ms']:.0f}, {r['metrics_mb']:.2f}", str(r["errors"]), f"{r['lag']:.0f}")))
    return "\n".join(f"| {line} |" for line in lines)


def run_load(urls: list[str], args: argparse.Namespace,
             probes: Callable[[dict, float], list[Awaitable]] | None = None) -> dict:
    """One configuration's load against ``urls`` (replicas behind one address: ``args.route`` spreads it),
    with ``probes`` beside it; its stats (``new_phase``'s, one measured window)."""
    return asyncio.run(_run(urls, args, probes=probes))


def against_collector(args: argparse.Namespace, *, attacker: AttackerSeam | None = None,
                      env: dict[str, str] | None = None) -> tuple[dict, float | None]:
    """One configuration against ``args.url``, or a fresh collector (a child process, ``env`` added to its
    environment): (its stats, the collector's RSS at the end in MiB or None with ``--url``). ``attacker``:
    the hostile client's seam (:class:`AttackerSeam`)."""
    from nanwatch.bench.serve import CollectorProcess

    if args.url:
        return asyncio.run(_run(args.url, args, attacker=attacker)), None
    with tempfile.TemporaryDirectory() as tmp, CollectorProcess(db_path=os.path.join(tmp, "load.db"),
                                                                env=env or {}) as c:
        stats = asyncio.run(_run(c.url, args, c.proc.pid, attacker))
        stats["collector_nofile"] = _nofile_of(c.proc.pid)
        return stats, _rss_mb(c.proc.pid)


def _one(args: argparse.Namespace) -> dict:
    """One configuration against a fresh collector (or ``--url``); prints its report, returns its stats."""
    stats, rss = against_collector(args)
    print(_report(stats, args, rss), flush=True)
    return stats


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from nanwatch.monitor.server import raise_fd_limit

    raise_fd_limit()  # before the collector starts, so that it inherits the raised limit
    if args.replicas or args.database_url or args.total_ranks:  # nanwatch.bench dispatches --replicas
        print("nanwatch bench collector: --database-url and --total-ranks go with --replicas")
        return 2
    if not args.matrix and not args.jobs_sweep:
        _one(args)
        return 0
    if args.matrix:
        configs = matrix_configs(args)
    else:
        configs = [dict(scope="job", jobs=n) for n in args.jobs_sweep]
    rows = []
    for config in configs:
        one = argparse.Namespace(**{**vars(args), **config})
        print(f"--- {describe_load(one)}, scrapes every {one.scrape_every:g} s", flush=True)
        rows.append(_row(one, _one(one)))
    print(f"machine: {os.cpu_count()} CPUs; {args.duration:g} s measured per configuration after "
          f"{args.warmup:g} s warmup; {args.sites} sites a report")
    print(_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
