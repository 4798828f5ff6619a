"""``nanwatch bench collector``: a load generator (a benchmark, not a test). N ranks x S sites, each rank
reporting once per second against one collector, measuring sustained reports/s, ingest latency,
/metrics render time and the collector's RSS.

Kept cheap so that it does not steal the collector's CPU: bodies are encoded once per rank (only the
sequence number changes), and each rank is a coroutine on its own raw HTTP/1.1 keep-alive connection.

With ``--attack``, ``--rounds`` pairs of measured windows of ``--duration`` each against the same
collector, alternating: the ranks alone, then the ranks beside a hostile client on loopback (a process of
its own); the windows of each kind are pooled, and the ratio of their p99 ingest latencies reported (goal:
within 2x). Alternating puts the machine's drift on both sides alike. ``scrape``: loops of back-to-back ``GET /metrics``; ``slow-headers``: connections that
send a request line and then one header byte a second (slowloris); ``slow-body``: ingest requests with
complete headers and ``Content-Length: 100000``, then one body byte a second; ``all``: the three at once.
Slow connections are reopened whenever the server ends them, and how it ended them is counted.

Example usage::

    nanwatch bench collector --ranks 1024 --sites 64 --duration 30
    nanwatch bench collector --url http://127.0.0.1:8000   # an already running collector
    nanwatch bench collector --ranks 256 --duration 10 --rounds 3 --attack slow-headers --attackers 1000
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing
import os
import statistics
import tempfile
import time
import urllib.parse

from nanwatch.bench.jobs import Sender, matrix_configs, priming, senders
from nanwatch.wire import LogitStat, SdpaCall, SiteStat, StepReport

__all__ = ["main", "synthetic_report"]

ATTACKS = ("scrape", "slow-headers", "slow-body")
DEFAULT_ATTACKERS = {"scrape": 4, "slow-headers": 1000, "slow-body": 256}
REQUEST_TIMEOUT_S = 30.0
"""A legitimate request unanswered this long counts as status ``timeout``."""
IDLE_REUSE_S = 4.0
"""A sender idle longer reconnects first, as HTTP clients do: uvicorn closes keep-alives idle for 5 s."""
SLOW_BODY_BYTES = 100_000
"""The Content-Length a slow-body attacker announces (and never sends)."""


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


async def _read_body(reader: asyncio.StreamReader, length: int, chunked: bool) -> bytes:
    """A response body: ``length`` bytes, or HTTP/1.1 chunks up to the empty one."""
    if not chunked:
        return await reader.readexactly(length) if length else b""
    parts = []
    while size := int((await reader.readline()).split(b";")[0], 16):
        parts.append(await reader.readexactly(size))
        await reader.readexactly(2)  # CRLF after each chunk
    while (await reader.readline()) not in (b"\r\n", b""):  # trailers
        pass
    return b"".join(parts)


async def _request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes,
                   body: bytes = b"") -> tuple[int, bytes, bool]:
    """One request on an open connection: (status, body, whether the server keeps the connection).
    A connection the server closed before answering raises ``ConnectionResetError``."""
    writer.write(head + body)
    status_line = await reader.readline()
    if not status_line:
        raise ConnectionResetError("the server closed the connection before answering")
    length, chunked, keep = 0, False, True
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.partition(b":")
        name, value = name.strip().lower(), value.strip().lower()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding":
            chunked = b"chunked" in value
        elif name == b"connection":
            keep = value != b"close"
    return int(status_line.split()[1]), await _read_body(reader, length, chunked), keep


def _auth(token: str | None) -> str:
    """The Authorization header line for ``token`` (empty without one)."""
    return f"Authorization: Bearer {token}\r\n" if token else ""


def _count(counter: dict, key: int | str) -> None:
    counter[key] = counter.get(key, 0) + 1


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
    auth = _auth(args.token)
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
                _count(phase["status"], status)
            n += 1
    finally:
        if conn is not None:
            conn[1].close()


async def _prime(host: str, port: int, args: argparse.Namespace) -> None:
    """Post ``nanwatch.bench.jobs.priming``'s bodies, one after another, before the clock starts."""
    conn = None
    for body in priming(args):
        head = (f"POST /v1/reports HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                f"{_auth(args.token)}Content-Length: {len(body)}\r\n\r\n").encode()
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
        status, _, keep = await asyncio.wait_for(_request(*conn, head, body), REQUEST_TIMEOUT_S)
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
    head = f"GET /metrics HTTP/1.1\r\nHost: {host}\r\n{_auth(token)}Connection: close\r\n\r\n".encode()
    await asyncio.sleep(every_s)
    while loop.time() < stop:
        t0 = loop.time()  # a fresh connection each time, as idle keep-alives are closed after 5 s
        status, body = await _scrape_once(host, port, head)
        if (phase := _phase_at(stats, t0)) is not None:
            if status == 200:
                phase["scrape"].append((loop.time() - t0, len(body), body.count(b"\n")))
            else:
                _count(phase["scrape_failed"], status)
        await asyncio.sleep(every_s)


async def _scrape_once(host: str, port: int, head: bytes) -> tuple[int | str, bytes]:
    """One ``/metrics`` request on a fresh connection: (status or ``timeout``/``conn-error``, body)."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), REQUEST_TIMEOUT_S)
        try:
            status, body, _ = await asyncio.wait_for(_request(reader, writer, head), REQUEST_TIMEOUT_S)
        finally:
            writer.close()
    except asyncio.TimeoutError:
        return "timeout", b""
    except (OSError, EOFError, ValueError, IndexError):
        return "conn-error", b""
    return status, body


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


# --- the hostile client --------------------------------------------------------------------------------

async def _scrape_flood(host: str, port: int, token: str | None, counts: dict) -> None:
    """One attacker loop: ``GET /metrics`` back to back, each on a fresh connection, until stopped."""
    loop = asyncio.get_running_loop()
    head = f"GET /metrics HTTP/1.1\r\nHost: {host}\r\n{_auth(token)}Connection: close\r\n\r\n".encode()
    while not counts["stopped"]:
        t0 = loop.time()
        status, _ = await _scrape_once(host, port, head)
        _count(counts["status"], status)
        counts["times"].append(loop.time() - t0)
        if status == "conn-error":
            await asyncio.sleep(0.05)  # a refused connect must not spin


async def _drip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, prefix: bytes, fill: bytes) -> bytes:
    """Send one byte a second (``prefix`` first, then ``fill`` forever) until the server answers or
    closes: its first bytes (``b""``: closed without a word)."""
    read = asyncio.ensure_future(reader.read(65536))
    try:
        i = 0
        while True:
            done, _ = await asyncio.wait({read}, timeout=1.0)
            if done:
                return read.result()
            writer.write(prefix[i:i + 1] if i < len(prefix) else fill)
            i += 1
    finally:
        read.cancel()


def _outcome(reply: bytes) -> int | str:
    """How the server ended a slow connection: the HTTP status it answered, or ``closed``."""
    if not reply:
        return "closed"
    parts = reply.split(b"\r\n", 1)[0].split()
    return int(parts[1]) if len(parts) > 1 and parts[0].startswith(b"HTTP/") and parts[1].isdigit() else "other"


async def _slow_conn(host: str, port: int, head: bytes, prefix: bytes, fill: bytes, counts: dict,
                     delay: float) -> None:
    """One slow attacker connection, reopened whenever the server ends it, until stopped: send
    ``head`` at once, then one byte a second (see ``_drip``); count how and when the server ended it."""
    loop = asyncio.get_running_loop()
    await asyncio.sleep(delay)
    while not counts["stopped"]:
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError:
            _count(counts["ended"], "connect failed")
            await asyncio.sleep(1.0)
            continue
        counts["opened"] += 1
        counts["open"] += 1
        t0 = loop.time()
        try:
            writer.write(head)
            outcome = _outcome(await _drip(reader, writer, prefix, fill))
        except OSError:
            outcome = "reset"
        finally:
            counts["open"] -= 1
            writer.close()
        _count(counts["ended"], outcome)
        counts["lifetimes"].append(loop.time() - t0)


def _attack_tasks(kind: str, n: int, host: str, port: int, token: str | None, counts: dict) -> list:
    """The coroutines of ``n`` attackers of one kind; slow connections open spread over one second."""
    if kind == "scrape":
        return [_scrape_flood(host, port, token, counts) for _ in range(n)]
    if kind == "slow-headers":  # a request line, then a header that never ends
        head = f"POST /v1/reports HTTP/1.1\r\nHost: {host}\r\n".encode()
        prefix, fill = b"X-Slowloris: ", b"a"
    else:  # complete headers, then a body that never arrives
        head = (f"POST /v1/reports HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n{_auth(token)}"
                f"Content-Length: {SLOW_BODY_BYTES}\r\n\r\n").encode()
        prefix, fill = b"[", b" "
    return [_slow_conn(host, port, head, prefix, fill, counts, i / n) for i in range(n)]


def _new_attack_counts(kind: str, n: int) -> dict:
    return {"kind": kind, "n": n, "status": {}, "times": [], "opened": 0, "open": 0, "ended": {},
            "lifetimes": [], "open_at_end": 0, "stopped": False}


def _plan_attack(args: argparse.Namespace, nofile: int) -> dict[str, int]:
    """Attackers per kind: ``--attackers`` or the kind's default, slow connections scaled down so that
    they, the ranks, the scrape loops and 64 spare descriptors fit in ``nofile``."""
    kinds = list(ATTACKS) if args.attack == "all" else [args.attack] if args.attack != "none" else []
    plan = {k: args.attackers if args.attackers is not None else DEFAULT_ATTACKERS[k] for k in kinds}
    slow = [k for k in plan if k != "scrape"]
    room = nofile - args.connections - 64 - plan.get("scrape", 0)
    wanted = sum(plan[k] for k in slow)
    if slow and wanted > room:
        for k in slow:
            plan[k] = max(1, plan[k] * max(room, 0) // wanted)
        print(f"note: {wanted} slow connections do not fit the open file limit {nofile} with {args.connections} "
              f"connections; capped to {', '.join(f'{k} {plan[k]}' for k in slow)}")
    return plan


async def _run(url: str, args: argparse.Namespace, plan: dict[str, int] | None = None,
               pid: int | None = None) -> dict:
    """Warmup, then the measured windows: one unloaded, or (with a ``plan``) ``args.rounds`` pairs of an
    unloaded and an attacked window, alternating so that drift on the machine falls on both alike."""
    u = urllib.parse.urlsplit(url)
    loop = asyncio.get_running_loop()
    await _prime(u.hostname, u.port, args)
    start = loop.time() + 0.5
    t = start + args.warmup
    phases = []
    for _ in range(args.rounds if plan else 1):
        for name in ("unloaded", "under attack") if plan else ("unloaded",):
            phases.append(_new_phase(name, t, t + args.duration))
            t += args.duration
    stop = phases[-1]["to"]
    stats: dict = {"phases": phases, "attacks": []}
    tasks = [_sender(u.hostname, u.port, s, args, stats, stop, start) for s in senders(args, synthetic_report)]
    tasks.append(_scraper(u.hostname, u.port, stats, stop, args.scrape_every, args.token))
    tasks.append(_loop_lag(stats, stop))
    if pid is not None:
        tasks.append(_sample_collector(pid, stats))
    windows = [(p["from"], p["to"]) for p in phases if p["name"] == "under attack"]
    attacker = _Attacker(u.hostname, u.port, args.token, plan, windows) if plan else None
    await asyncio.gather(*tasks)
    if attacker is not None:
        stats["attacks"], stats["attacker_cpu_s"] = await loop.run_in_executor(None, attacker.result)
    return stats


class _Attacker:
    """The hostile client in a process of its own, so that its work does not delay the bench's event loop
    and inflate the latency the ranks measure (loop times are ``time.monotonic``, shared by processes)."""

    def __init__(self, host: str, port: int, token: str | None, plan: dict[str, int],
                 windows: list[tuple[float, float]]) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._recv, send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_attack_main, args=(host, port, token, plan, windows, send),
                                 name="nanwatch-attacker", daemon=True)
        self._proc.start()
        send.close()

    def result(self) -> tuple[list[dict], float]:
        """The attackers' counts and the CPU seconds they used, once they have stopped (blocking)."""
        try:
            return self._recv.recv()
        finally:
            self._proc.join()


def _attack_main(host: str, port: int, token: str | None, plan: dict[str, int],
                 windows: list[tuple[float, float]], send) -> None:
    """The attacker process (it inherits the raised open file limit): run the plan in every window, send
    back the counts."""
    attacks = [_new_attack_counts(kind, n) for kind, n in plan.items()]
    cpu0 = time.process_time()
    for begin, stop in windows:
        asyncio.run(_attack(host, port, token, attacks, begin, stop))
    send.send((attacks, time.process_time() - cpu0))


async def _attack(host: str, port: int, token: str | None, attacks: list[dict], begin: float,
                  stop: float) -> None:
    """From ``begin`` to ``stop``: every attacker of ``attacks`` at once; then all stopped and cancelled (the
    flag too, as ``asyncio.wait_for`` on Python 3.11 can swallow a cancellation that races a result)."""
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, begin - loop.time()))
    running = []
    for counts in attacks:
        counts["stopped"] = False
        running += [asyncio.ensure_future(c)
                    for c in _attack_tasks(counts["kind"], counts["n"], host, port, token, counts)]
    await asyncio.sleep(max(0.0, stop - loop.time()))
    for counts in attacks:
        counts["open_at_end"], counts["stopped"] = counts["open"], True
    for task in running:
        task.cancel()
    await asyncio.gather(*running, return_exceptions=True)


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
    """What one kind of attacker did, and how the collector ended its connections."""
    kind, n = counts["kind"], counts["n"]
    if kind == "scrape":
        t = _quantiles(counts["times"])
        done = sum(counts["status"].values())
        timing = f", p50 {t[0] * 1e3:.0f} ms, max {t[2] * 1e3:.0f} ms" if t else ""
        return [f"{kind} x{n}: {done} scrapes ({done / duration:.1f}/s){timing}; statuses {counts['status']}"]
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


def _ratio_line(base: dict, hit: dict) -> str:
    base, hit = _quantiles(base["lat"]), _quantiles(hit["lat"])
    if not base or not hit or base[1] <= 0:
        return "p99 under attack / p99 unloaded = n/a (no samples)"
    return f"p99 under attack / p99 unloaded = {hit[1] / base[1]:.2f} (goal: within 2x)"


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
        rounds = len(phases) // 2
        seconds = rounds * args.duration
        lines.append(f"{rounds} rounds of {args.duration:g} s unloaded, then {args.duration:g} s under attack; "
                     "each phase below pools its windows")
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
                   help="bearer token for ingest and scrapes (default: $NANWATCH_TOKEN, else none)")
    p.add_argument("--attack", choices=("none", *ATTACKS, "all"), default="none",
                   help="a second phase with a hostile client beside the ranks (default: none, one phase)")
    p.add_argument("--rounds", type=int, default=3,
                   help="with --attack: unloaded/attacked window pairs, alternating (default: 3)")
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
    with tempfile.TemporaryDirectory() as tmp, CollectorProcess(db_path=os.path.join(tmp, "load.db")) as c:
        stats = asyncio.run(_run(c.url, args, plan, c.proc.pid))
        stats["nofile"], stats["collector_nofile"] = nofile, _nofile_of(c.proc.pid)
        print(_report(stats, args, _rss_mb(c.proc.pid)), flush=True)
    return stats


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from nanwatch.monitor.server import raise_fd_limit

    nofile = raise_fd_limit()  # before the collector starts, so that it inherits the raised limit
    plan = _plan_attack(args, nofile)
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
