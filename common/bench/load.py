"""``nanwatch bench collector``: a load generator (a benchmark, not a test). N ranks x S sites, each rank
reporting once per second against one collector, measuring sustained reports/s, ingest latency,
/metrics render time and the collector's RSS.

Kept cheap so that it does not steal the collector's CPU: bodies are encoded once per rank (only the
sequence number changes), and each rank is a coroutine on its own raw HTTP/1.1 keep-alive connection.

With ``--attack``, ``--rounds`` pairs of measured windows of ``--duration`` each against the same
collector, alternating: the ranks alone, then the ranks beside a hostile client on loopback (a process of
its own); the windows of each kind are pooled, and the ratio of their p99 ingest latencies reported (goal:
within 2x). Alternating puts the machine's drift on both sides alike. The kinds are
``nanwatch.bench.attacks``'s; ``all``: every kind at once; ``each``: every kind in turn and then all at once,
each against a fresh collector, and a table of the ratios.

Example usage::

    nanwatch bench collector --ranks 1024 --sites 64 --duration 30
    nanwatch bench collector --url http://127.0.0.1:8000   # an already running collector
    nanwatch bench collector --ranks 256 --duration 10 --rounds 3 --attack slow-headers --attackers 1000
    nanwatch bench collector --ranks 256 --sites 64 --duration 15 --rounds 3 --attack each
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import secrets
import statistics
import tempfile
import time
import urllib.parse

from nanwatch.bench.attacks import ATTACKS, DEFAULT_ATTACKERS, HELD, Attacker, Target, plan_attack, prime_runs
from nanwatch.bench.http1 import REQUEST_TIMEOUT_S, auth_line, count, get_once, request
from nanwatch.bench.jobs import Sender, matrix_configs, priming, senders
from nanwatch.wire import LogitStat, SdpaCall, SiteStat, StepReport

__all__ = ["main", "synthetic_report"]

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


def _new_phase(name: str, t_from: float, t_to: float) -> dict:
    return {"name": name, "from": t_from, "to": t_to, "lat": [], "status": {}, "scrape": [], "scrape_failed": {},
            "lag": [], "by_kind": {}, "reports": 0,
            "rss": None, "fds": None, "cpu_s": None}


async def _sender(host: str, port: int, sender: Sender, args: argparse.Namespace, stats: dict, stop: float,
                  start_at: float) -> None:
    """One stream of POSTs (a rank, a job's poster, or ranks' heartbeats; ``nanwatch.bench.jobs``) on a
    keep-alive connection, reopened (inside the timed request) when the server closes it. A stream that
    falls behind sends at once, so the sustained rate shows what the collector took. Latency is recorded
    for the phase in which the request was sent; a request unanswered after ``REQUEST_TIMEOUT_S`` counts as
    status ``timeout`` with its wait as latency."""
    auth = auth_line(args.token)
    conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
    loop = asyncio.get_running_loop()
    n, last = 0, -math.inf
    try:
        while True:
            await asyncio.sleep(max(0.0, start_at + sender.offset + n * sender.every - loop.time()))
            if loop.time() >= stop:
                return
            body = sender.body(n)
            head = (f"POST /v1/reports HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n{auth}"
                    f"Content-Length: {len(body)}\r\n\r\n").encode()
            t0 = loop.time()
            if conn is not None and t0 - last > IDLE_REUSE_S:  # the server closes idle keep-alives (5 s)
                conn[1].close()
                conn = None
            status, conn = await _send_report(host, port, conn, head, body)
            t1 = last = loop.time()
            if (phase := _phase_at(stats, t0)) is not None:
                phase["lat"].append(t1 - t0)
                phase["by_kind"].setdefault(sender.kind, []).append(t1 - t0)
                phase["reports"] += sender.reports if status == 200 else 0
                count(phase["status"], status)
            n += 1
    finally:
        if conn is not None:
            conn[1].close()


async def _prime(host: str, port: int, args: argparse.Namespace) -> None:
    """Post ``nanwatch.bench.jobs.priming``'s bodies, one after another, before the clock starts."""
    conn = None
    for body in priming(args):
        head = (f"POST /v1/reports HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                f"{auth_line(args.token)}Content-Length: {len(body)}\r\n\r\n").encode()
        status, conn = await _send_report(host, port, conn, head, body)
        if status != 200:
            raise SystemExit(f"nanwatch bench: priming the collector got {status}")
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


async def _run(url: str, args: argparse.Namespace, plan: dict[str, int] | None = None,
               pid: int | None = None) -> dict:
    """Warmup, then the measured windows: one unloaded, or (with a ``plan``) ``args.rounds`` pairs of an
    unloaded and an attacked window, alternating so that drift on the machine falls on both alike."""
    u = urllib.parse.urlsplit(url)
    loop = asyncio.get_running_loop()
    await _prime(u.hostname, u.port, args)
    target = Target(u.hostname, u.port, args.token, args.run_id)
    primed = await prime_runs(target) if plan and "runs-listing" in plan else None
    start = loop.time() + 0.5
    t = start + args.warmup
    phases = []
    for _ in range(args.rounds if plan else 1):
        for name in ("unloaded", "under attack") if plan else ("unloaded",):
            phases.append(_new_phase(name, t, t + args.duration))
            t += args.duration
        if plan:  # what an attack left behind (a request still being answered) is not the next window's
            t += args.settle
    stop = phases[-1]["to"]
    stats: dict = {"phases": phases, "attacks": [], "primed": primed}
    tasks = [_sender(u.hostname, u.port, s, args, stats, stop, start) for s in senders(args, synthetic_report)]
    tasks.append(_scraper(u.hostname, u.port, stats, stop, args.scrape_every, args.token))
    tasks.append(_loop_lag(stats, stop))
    if pid is not None:
        tasks.append(_sample_collector(pid, stats))
    windows = [(p["from"], p["to"]) for p in phases if p["name"] == "under attack"]
    attacker = Attacker(target, plan, windows) if plan else None
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


def _quantiles(values: list[float]) -> tuple[float, float, float] | None:
    """(p50, p99, max) of ``values``; None without samples."""
    if not values:
        return None
    v = sorted(values)
    if len(v) == 1:
        return v[0], v[0], v[0]
    q = statistics.quantiles(v, n=100, method="inclusive")
    return q[49], q[98], v[-1]


def _phase_lines(phase: dict, seconds: float, args: argparse.Namespace) -> list[str]:
    """Throughput, statuses, ingest latency and /metrics scrapes of one measured phase of ``seconds``."""
    lat = _quantiles(phase["lat"])
    lines = [
        f"sustained: {phase['reports'] / seconds:.0f} reports/s in {len(phase['lat']) / seconds:.0f} requests/s "
        f"over {seconds:.0f} s (target {_target(args):.0f} reports/s); statuses {phase['status']}",
        f"ingest latency: p50 {lat[0] * 1e3:.1f} ms, p99 {lat[1] * 1e3:.1f} ms, max {lat[2] * 1e3:.1f} ms"
        if lat else "ingest latency: no samples",
    ]
    if len(phase["by_kind"]) > 1:
        lines += [f"  {kind}: p50 {q[0] * 1e3:.1f} ms, p99 {q[1] * 1e3:.1f} ms ({len(v)} requests)"
                  for kind, v in phase["by_kind"].items() if (q := _quantiles(v))]
    if scrapes := phase["scrape"]:
        times = [t for t, _, _ in scrapes]
        lines.append(f"/metrics: {len(scrapes)} scrapes, median {statistics.median(times) * 1e3:.0f} ms, "
                     f"max {max(times) * 1e3:.0f} ms, {scrapes[-1][2]} lines, {scrapes[-1][1] / 1e6:.1f} MB")
    if phase["scrape_failed"]:
        lines.append(f"/metrics failed: {phase['scrape_failed']}")
    return lines


def _target(args: argparse.Namespace) -> float:
    """Reports a second the configuration sends when the collector keeps up."""
    if args.scope == "rank":
        return args.jobs * args.ranks * args.rate
    return args.jobs * ((1 + min(args.details, args.ranks - 1)) * args.rate + args.ranks / args.heartbeat_every)


def _attack_lines(counts: dict, duration: float) -> list[str]:
    """What one kind of attacker did: the statuses and times of its requests, or how the collector ended
    its held connections."""
    kind, n = counts["kind"], counts["n"]
    if kind not in HELD:
        t = _quantiles(counts["times"])
        done = sum(counts["status"].values())
        timing = f", p50 {t[0] * 1e3:.0f} ms, max {t[2] * 1e3:.0f} ms" if t else ""
        cut = f"; {counts['open_at_end']} unanswered when its window ended" if counts["open_at_end"] else ""
        return [f"{kind} x{n}: {done} requests ({done / duration:.1f}/s){timing}; statuses {counts['status']}{cut}"]
    ended = sum(v for k, v in counts["ended"].items() if k != "connect failed")
    life = statistics.median(counts["lifetimes"]) if counts["lifetimes"] else None
    after = f", median after {life:.1f} s" if life is not None else ""
    return [f"{kind} x{n}: {counts['opened']} connections opened, {counts['open_at_end']} still open at the end; "
            f"ended by the server: {ended}{after} {counts['ended'] or ''}".rstrip()]


def _merged(phases: list[dict], name: str) -> dict:
    """The windows called ``name`` as one phase: samples pooled, CPU summed, RSS and descriptors from the
    last."""
    mine = [p for p in phases if p["name"] == name]
    out = _new_phase(name, mine[0]["from"], mine[-1]["to"])
    for p in mine:
        for key in ("lat", "scrape", "lag"):
            out[key] += p[key]
        out["reports"] += p["reports"]
        for kind, lat in p["by_kind"].items():
            out["by_kind"].setdefault(kind, []).extend(lat)
        for key in ("status", "scrape_failed"):
            for k, v in p[key].items():
                out[key][k] = out[key].get(k, 0) + v
    out["rss"], out["fds"] = mine[-1]["rss"], mine[-1]["fds"]
    cpu = [p["cpu_s"] for p in mine]
    out["cpu_s"] = None if None in cpu else sum(cpu)
    return out


def _ratio(base: dict, hit: dict) -> tuple[float, float, float] | None:
    """(p99 unloaded, p99 under attack, their ratio) of the pooled phases; None without samples."""
    base, hit = _quantiles(base["lat"]), _quantiles(hit["lat"])
    if not base or not hit or base[1] <= 0:
        return None
    return base[1], hit[1], hit[1] / base[1]


def _failed(phase: dict) -> int:
    """The ranks' requests not answered 200 in the phase (refused, timed out, connection lost)."""
    return sum(n for k, n in phase["status"].items() if k != 200)


def _ratio_line(base: dict, hit: dict) -> str:
    r = _ratio(base, hit)
    failed = f"; ranks' requests not answered 200: {_failed(base)} unloaded, {_failed(hit)} under attack"
    if r is None:
        return "p99 under attack / p99 unloaded = n/a (no samples)" + failed
    return f"p99 under attack / p99 unloaded = {r[2]:.2f} (goal: within 2x)" + failed


def _load(args: argparse.Namespace) -> str:
    jobs = f"{args.jobs} jobs of " if args.jobs > 1 else ""
    if args.scope == "rank":
        return f"{jobs}{args.ranks} ranks x {args.sites} sites, per-rank reports at {args.rate}/s per rank"
    return (f"{jobs}{args.ranks} ranks x {args.sites} sites, job-level: a job report + {args.details} details at "
            f"{args.rate}/s, heartbeats every {args.heartbeat_every:g} s in batches of {args.heartbeat_batch}")


def _report(stats: dict, args: argparse.Namespace, rss: float | None) -> str:
    phases = stats["phases"]
    lines = [f"machine: {os.cpu_count()} CPUs; load: {_load(args)}"]
    if len(phases) == 1:
        lines += _phase_lines(phases[0], args.duration, args)
        if phases[0]["cpu_s"] is not None:
            lines.append(f"collector CPU: {100 * phases[0]['cpu_s'] / args.duration:.0f}% of one core")
    else:
        plan = ", ".join(f"{c['kind']} x{c['n']}" for c in stats["attacks"])
        lines.append(f"attack: {plan}; open file limit {stats.get('nofile')}"
                     + (f", collector's {stats['collector_nofile']}" if stats.get("collector_nofile") else ""))
        if stats.get("primed") is not None:
            lines.append(f"primed for runs-listing: {sum(stats['primed'].values())} requests of 256 runs, "
                         f"statuses {stats['primed']}")
        rounds = len(phases) // 2
        seconds = rounds * args.duration
        lines.append(f"{rounds} rounds of {args.duration:g} s unloaded, then {args.duration:g} s under attack "
                     f"and {args.settle:g} s unmeasured; each phase below pools its windows")
        merged = [_merged(phases, "unloaded"), _merged(phases, "under attack")]
        for i, phase in enumerate(merged, 1):
            title = phase["name"] + (f" ({plan})" if i > 1 else "")
            lines.append(f"phase {i}, {title}:")
            body = _phase_lines(phase, seconds, args)
            if i > 1:
                for counts in stats["attacks"]:
                    body += _attack_lines(counts, seconds)
                body.append(f"attacker process CPU: {100 * stats['attacker_cpu_s'] / seconds:.0f}% of one core "
                            "(on this machine, taken from the collector's CPUs)")
            if (lag := _quantiles(phase["lag"])) is not None:
                body.append(f"bench event loop lag: p99 {lag[1] * 1e3:.1f} ms, max {lag[2] * 1e3:.1f} ms")
            if phase["rss"] is not None:
                body.append(f"collector at phase end: RSS {phase['rss']:.0f} MiB, {phase['fds']} open descriptors")
            if phase["cpu_s"] is not None:
                body.append(f"collector CPU: {100 * phase['cpu_s'] / seconds:.0f}% of one core")
            lines += ["  " + line for line in body]
        lines.append(_ratio_line(*merged))
    if rss is not None:
        lines.append(f"collector RSS: {rss:.0f} MiB")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
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
                   help="bearer token for ingest and scrapes (default: $NANWATCH_TOKEN, else none; with --attack "
                        "and no --url, a fresh one that the bench's collector requires)")
    p.add_argument("--attack", choices=("none", *ATTACKS, "all", "each"), default="none",
                   help="a second phase with a hostile client beside the ranks (default: none, one phase); all: "
                        "every kind at once; each: every kind in turn, then all, and a table of the ratios")
    p.add_argument("--rounds", type=int, default=3,
                   help="with --attack: unloaded/attacked window pairs, alternating (default: 3)")
    p.add_argument("--settle", type=float, default=5.0,
                   help="with --attack: unmeasured seconds after each attacked window, so that what the attack "
                        "left the collector doing is not counted as unloaded (default: 5)")
    p.add_argument("--attackers", type=int, default=None,
                   help="attackers of each kind (default: " +
                        ", ".join(f"{k} {n}" for k, n in DEFAULT_ATTACKERS.items()) + ")")
    p.add_argument("--matrix", action="store_true",
                   help="each of --matrix-ranks per rank and per job at each of --matrix-scrapes, a fresh "
                        "collector each, then one table")
    p.add_argument("--matrix-ranks", type=lambda v: [int(x) for x in v.split(",")], default=[1024, 4096, 65536])
    p.add_argument("--matrix-scrapes", type=lambda v: [float(x) for x in v.split(",")], default=[5.0, 15.0])
    p.add_argument("--jobs-sweep", type=lambda v: [int(x) for x in v.split(",")], default=None,
                   help="job mode: these numbers of concurrent --ranks jobs in turn, then one table")
    return p


def _row(args: argparse.Namespace, stats: dict) -> dict:
    """One configuration's figures for the side-by-side table."""
    phase, seconds = stats["phases"][0], args.duration
    lat = _quantiles(phase["lat"]) or (math.nan,) * 3
    scrapes = phase["scrape"]
    return dict(ranks=args.ranks, jobs=args.jobs, scope=args.scope, scrape=args.scrape_every,
                target=_target(args), reports=phase["reports"] / seconds, requests=len(phase["lat"]) / seconds,
                p50=lat[0] * 1e3, p99=lat[1] * 1e3, cpu=100 * (phase["cpu_s"] or math.nan) / seconds,
                metrics_ms=statistics.median(t for t, _, _ in scrapes) * 1e3 if scrapes else math.nan,
                metrics_mb=scrapes[-1][1] / 1e6 if scrapes else math.nan,
                errors=sum(n for k, n in phase["status"].items() if k != 200),
                lag=(_quantiles(phase["lag"]) or (math.nan,) * 3)[1] * 1e3)


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


def _one(args: argparse.Namespace, plan: dict[str, int], nofile: int) -> dict:
    """One configuration against a fresh collector (or ``--url``); prints its report, returns its stats."""
    from nanwatch.bench.serve import CollectorProcess

    if args.url:
        stats = asyncio.run(_run(args.url, args, plan))
        stats["nofile"] = nofile
        print(_report(stats, args, None), flush=True)
        return stats
    env = {}
    if plan and not args.token:  # attacks without a token must meet a collector that wants one
        args = argparse.Namespace(**{**vars(args), "token": secrets.token_urlsafe(16)})
        env["NANWATCH_TOKEN"] = args.token
    with tempfile.TemporaryDirectory() as tmp, CollectorProcess(db_path=os.path.join(tmp, "load.db"), env=env) as c:
        stats = asyncio.run(_run(c.url, args, plan, c.proc.pid))
        stats["nofile"], stats["collector_nofile"] = nofile, _nofile_of(c.proc.pid)
        print(_report(stats, args, _rss_mb(c.proc.pid)), flush=True)
    return stats


def _each(args: argparse.Namespace, plan: dict[str, int], nofile: int) -> None:
    """``--attack each``: every kind alone, then all at once, each against a fresh collector; then a table of
    the p99 ratios."""
    rows = []
    for kind in (*plan, "all"):
        one = argparse.Namespace(**{**vars(args), "attack": kind})
        print(f"--- attack {kind}", flush=True)
        stats = _one(one, plan if kind == "all" else {kind: plan[kind]}, nofile)
        base, hit = _merged(stats["phases"], "unloaded"), _merged(stats["phases"], "under attack")
        rows.append((kind, _ratio(base, hit), _failed(base), _failed(hit)))
    print(f"machine: {os.cpu_count()} CPUs; load: {_load(args)}; {args.rounds} rounds of {args.duration:g} s each side")
    print("| attack | ingest p99 unloaded → attacked | × | ranks' requests not 200 (unloaded, attacked) |\n"
          "|---|---|---|---|")
    for kind, r, base_failed, hit_failed in rows:
        n = "all at once" if kind == "all" else f"`{kind}` ×{plan[kind]}"
        p99 = f"{r[0] * 1e3:.1f} → {r[1] * 1e3:.1f} ms | {r[2]:.2f}" if r else "n/a | n/a"
        print(f"| {n} | {p99} | {base_failed}, {hit_failed} |")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from nanwatch.monitor.server import raise_fd_limit

    nofile = raise_fd_limit()  # before the collector starts, so that it inherits the raised limit
    plan = plan_attack(args, nofile)
    if args.attack == "each":
        _each(args, plan, nofile)
        return 0
    if not args.matrix and not args.jobs_sweep:
        _one(args, plan, nofile)
        return 0
    if args.matrix:
        configs = matrix_configs(args)
    else:
        configs = [dict(scope="job", jobs=n) for n in args.jobs_sweep]
    rows = []
    for config in configs:
        one = argparse.Namespace(**{**vars(args), **config})
        print(f"--- {_load(one)}, scrapes every {one.scrape_every:g} s", flush=True)
        rows.append(_row(one, _one(one, {}, nofile)))
    print(f"machine: {os.cpu_count()} CPUs; {args.duration:g} s measured per configuration after "
          f"{args.warmup:g} s warmup; {args.sites} sites a report")
    print(_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
