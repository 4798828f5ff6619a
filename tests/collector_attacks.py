"""The hostile client of ``tests/collector_attack_bench.py --attack KIND`` (and of the tests that run it): each
kind one attack of issues #11 and #19, run in a process of its own beside the ranks, counting what the
collector answered. Not shipped: users never run it; it reuses the bench's raw HTTP/1.1 client
(``nanwatch.bench.http1``).

Two shapes. *Request loops* send whole requests back to back and count the statuses and times:
``scrape`` (``GET /metrics``), ``accept-versions`` (``GET /metrics``, each asking for a new OpenMetrics
``version=``), ``error-bodies`` (a token's 233 KB bodies of empty site objects, every one an error),
``runs-listing`` (``GET /v1/runs`` on a collector primed with ``LISTED_RUNS`` runs), ``abandoned-polls``
(``GET /v1/directives/{run}?wait=60``, closed at once) and ``trailers`` (no token: a chunked body whose
trailer block runs to ``TRAILER_BYTES``). *Held connections* are reopened whenever the server ends them,
counting how and when it did: ``slow-headers`` (a header byte a second), ``slow-body`` (complete headers, a
body byte a second) and ``preauth-bodies`` (no token: ``PREAUTH_BODY_BYTES`` announced, all but the last
byte sent at once, then nothing).

Example usage::

    attacker = Attacker(Target("127.0.0.1", 8000, token, "loadgen"), {"trailers": 4}, windows)
    counts, cpu_s = attacker.result()
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import time
from collections.abc import Callable, Iterator
from typing import NamedTuple

from nanwatch.bench.http1 import REQUEST_TIMEOUT_S, auth_line, count, request
from nanwatch.wire import ReportBatch, StepReport

__all__ = ["ATTACKS", "DEFAULT_ATTACKERS", "HELD", "LISTED_RUNS", "Attacker", "Target", "plan_attack",
           "prime_runs"]

ATTACKS = ("scrape", "slow-headers", "slow-body", "trailers", "preauth-bodies", "error-bodies", "accept-versions",
           "abandoned-polls", "runs-listing")
#: attackers of each kind by default: the sizes of the findings in issues #11 and #19
DEFAULT_ATTACKERS = {"scrape": 4, "slow-headers": 1000, "slow-body": 256, "trailers": 4, "preauth-bodies": 16,
                     "error-bodies": 1, "accept-versions": 40, "abandoned-polls": 4, "runs-listing": 1}
#: the kinds that hold their connections open (scaled down to fit the open file limit)
HELD = frozenset({"slow-headers", "slow-body", "preauth-bodies"})
SLOW_BODY_BYTES = 100_000
"""The Content-Length a slow-body attacker announces (and never sends)."""
PREAUTH_BODY_BYTES = 8 << 20
"""The Content-Length an unauthenticated preauth-bodies attacker announces; it sends all but the last byte."""
TRAILER_BYTES = 16 << 20
"""Trailer bytes a trailers attacker sends after each chunked body (1 GiB took RSS to 1.2 GiB, #19)."""
ERROR_BODY_BYTES = 233_000
"""The size of an error-bodies body: a report whose sites are empty objects (3.1-3.5 s on the loop, #19)."""
LISTED_RUNS = 9_000
"""Runs a runs-listing attack primes the collector with (its default cap is 10,000): ``GET /v1/runs`` lists
them all."""
_BLOCK = 64 << 10


class Target(NamedTuple):
    """Where the attackers go, and as whom: ``token`` is the bench's, for the kinds that need one."""

    host: str
    port: int
    token: str | None
    run_id: str


def plan_attack(args: argparse.Namespace, nofile: int) -> dict[str, int]:
    """Attackers per kind: ``--attackers`` or the kind's default, held connections scaled down so that they,
    the ranks, the other attackers and 64 spare descriptors fit in ``nofile``."""
    kinds = list(ATTACKS) if args.attack in ("all", "each") else [args.attack] if args.attack != "none" else []
    plan = {k: args.attackers if args.attackers is not None else DEFAULT_ATTACKERS[k] for k in kinds}
    held = [k for k in plan if k in HELD]
    room = nofile - args.connections - 64 - sum(n for k, n in plan.items() if k not in HELD)
    wanted = sum(plan[k] for k in held)
    if held and wanted > room:
        for k in held:
            plan[k] = max(1, plan[k] * max(room, 0) // wanted)
        print(f"note: {wanted} held connections do not fit the open file limit {nofile} with {args.connections} "
              f"connections; capped to {', '.join(f'{k} {plan[k]}' for k in held)}")
    return plan


async def prime_runs(target: Target, n: int = LISTED_RUNS) -> dict:
    """Post one small report for each of ``n`` runs (256 to a request) before the clock starts, for the
    runs-listing attack: the statuses, counted (a collector may refuse runs past its caps)."""
    statuses: dict = {}
    reader, writer = await asyncio.open_connection(target.host, target.port)
    try:
        for a in range(0, n, 256):
            body = ReportBatch(reports=[_bare_report(f"listed-{i}")
                                        for i in range(a, min(a + 256, n))]).model_dump_json().encode()
            head = _post_head(target, "/v1/reports", len(body), token=target.token)
            status, _, keep = await asyncio.wait_for(request(reader, writer, head, body), REQUEST_TIMEOUT_S)
            count(statuses, status)
            if not keep:
                writer.close()
                reader, writer = await asyncio.open_connection(target.host, target.port)
    finally:
        writer.close()
    return statuses


def _bare_report(run_id: str) -> StepReport:
    """The smallest valid report: one rank's step 0, no measurements."""
    return StepReport(run_id=run_id, rank=0, world_size=1, incarnation="attacker", seq=0, step=0, time=time.time())


class Attacker:
    """The hostile client in a process of its own, so that its work does not delay the bench's event loop
    and inflate the latency the ranks measure (loop times are ``time.monotonic``, shared by processes)."""

    def __init__(self, target: Target, plan: dict[str, int], windows: list[tuple[float, float]]) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._recv, send = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_attack_main, args=(target, plan, windows, send),
                                 name="nanwatch-attacker", daemon=True)
        self._proc.start()
        send.close()

    def result(self) -> tuple[list[dict], float]:
        """The attackers' counts and the CPU seconds they used, once they have stopped (blocking)."""
        try:
            return self._recv.recv()
        finally:
            self._proc.join()


def _attack_main(target: Target, plan: dict[str, int], windows: list[tuple[float, float]], send) -> None:
    """The attacker process (it inherits the raised open file limit): run the plan in every window, send
    back the counts."""
    attacks = [_new_counts(kind, n) for kind, n in plan.items()]
    cpu0 = time.process_time()
    for begin, stop in windows:
        asyncio.run(_attack(target, attacks, begin, stop))
    send.send((attacks, time.process_time() - cpu0))


def _new_counts(kind: str, n: int) -> dict:
    return {"kind": kind, "n": n, "status": {}, "times": [], "opened": 0, "open": 0, "ended": {},
            "lifetimes": [], "open_at_end": 0, "stopped": False, "sent": 0}


async def _attack(target: Target, attacks: list[dict], begin: float, stop: float) -> None:
    """From ``begin`` to ``stop``: every attacker of ``attacks`` at once; then all stopped and cancelled (the
    flag too, as ``asyncio.wait_for`` on Python 3.11 can swallow a cancellation that races a result)."""
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, begin - loop.time()))
    running = []
    for counts in attacks:
        counts["stopped"] = False
        running += [asyncio.ensure_future(c) for c in _tasks(target, counts)]
    await asyncio.sleep(max(0.0, stop - loop.time()))
    for counts in attacks:
        counts["open_at_end"], counts["stopped"] = counts["open"], True
    for task in running:
        task.cancel()
    await asyncio.gather(*running, return_exceptions=True)


def _tasks(t: Target, counts: dict) -> list:
    """The coroutines of one kind's attackers; held connections open spread over one second."""
    kind, n = counts["kind"], counts["n"]
    if kind in HELD:
        talk = _held_talk(t, kind)
        return [_held_conn(t, talk, counts, i / n) for i in range(n)]
    if kind == "abandoned-polls":
        return [_abandon_polls(t, counts) for _ in range(n)]
    if kind == "trailers":
        return [_loop(t, counts, _trailers) for _ in range(n)]
    if kind == "error-bodies":
        make = _error_body(t)
    else:
        head = {"scrape": _get_head(t, "/metrics", close=True), "runs-listing": _get_head(t, "/v1/runs")}.get(kind)

        def make(i: int) -> tuple[bytes, bytes]:  # accept-versions: a new version each request
            return head or _get_head(t, "/metrics", close=True, accept=(
                f"application/openmetrics-text; version=1.0.{i}; charset=utf-8")), b""
    return [_loop(t, counts, _sent(make)) for _ in range(n)]


# ---- requests: heads and bodies -----------------------------------------------------------------------------

def _get_head(t: Target, path: str, *, close: bool = False, accept: str | None = None) -> bytes:
    extra = (f"Accept: {accept}\r\n" if accept else "") + ("Connection: close\r\n" if close else "")
    return f"GET {path} HTTP/1.1\r\nHost: {t.host}\r\n{auth_line(t.token)}{extra}\r\n".encode()


def _post_head(t: Target, path: str, length: int, *, token: str | None) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: {t.host}\r\nContent-Type: application/json\r\n{auth_line(token)}"
            f"Content-Length: {length}\r\n\r\n").encode()


def _error_body(t: Target) -> Callable[[int], tuple[bytes, bytes]]:
    """Reports whose ``sites`` are 4,096 ``{}`` objects each (the most a report holds), up to
    ``ERROR_BODY_BYTES``: every object several errors."""
    report = json.loads(_bare_report(t.run_id).model_dump_json())
    report["sites"] = [{}] * 4096
    one = len(json.dumps(report, separators=(",", ":")))
    body = json.dumps({"reports": [report] * max(1, ERROR_BODY_BYTES // one)}, separators=(",", ":")).encode()
    head = _post_head(t, "/v1/reports", len(body), token=t.token)
    return lambda i: (head, body)


def _sent(make: Callable[[int], tuple[bytes, bytes]]):
    """A request loop's step: send ``make(i)`` on the open connection, the answer's (status, keep)."""
    async def step(t: Target, conn: tuple, i: int) -> tuple[int | str, bool]:
        head, body = make(i)
        status, _, keep = await request(*conn, head, body)
        return status, keep
    return step


async def _trailers(t: Target, conn: tuple, i: int) -> tuple[int | str, bool]:
    """A chunked request without a token whose body is ``{}`` and whose trailer block is ``TRAILER_BYTES`` of
    4 KB header lines, sent as fast as the server takes it: (how the server ended it, False). To ``GET
    /healthz``, which needs no token and reads no body (a body route now refuses a tokenless request before
    its body, so only the HTTP layer itself can bound the trailers)."""
    head = (f"GET /healthz HTTP/1.1\r\nHost: {t.host}\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n").encode()
    line = b"X-Trailer: " + b"t" * 4081 + b"\r\n"  # 4 KB a line, within any header-line limit

    def blocks() -> Iterator[bytes]:
        per = _BLOCK // len(line)
        for _ in range(TRAILER_BYTES // (per * len(line))):
            yield line * per
        yield b"\r\n"

    reader, writer = conn
    try:  # every byte, answered or not: the server's early 200 does not end what the client sends
        writer.write(head)
        for block in blocks():
            writer.write(block)
            await writer.drain()
    except OSError:
        return "closed", False  # the server closed it mid-trailers: the bound held
    return _outcome(await reader.read(65536)), False


async def _loop(t: Target, counts: dict, step) -> None:
    """One attacker: ``step`` back to back on a keep-alive connection (reopened when the server ends it),
    counting statuses and times, until stopped; ``open`` counts its request in flight (one the window's end
    cut short is counted as open at the end, not as answered)."""
    loop = asyncio.get_running_loop()
    conn = None
    while not counts["stopped"]:
        t0 = loop.time()
        counts["sent"] += 1
        counts["open"] += 1
        try:
            if conn is None:
                conn = await asyncio.wait_for(asyncio.open_connection(t.host, t.port), REQUEST_TIMEOUT_S)
            status, keep = await asyncio.wait_for(step(t, conn, counts["sent"]), REQUEST_TIMEOUT_S)
        except asyncio.TimeoutError:
            status, keep = "timeout", False
        except (OSError, EOFError, ValueError, IndexError):
            status, keep = "conn-error", False
        finally:
            counts["open"] -= 1
        count(counts["status"], status)
        counts["times"].append(loop.time() - t0)
        if not keep and conn is not None:
            conn[1].close()
            conn = None
        if status == "conn-error":
            await asyncio.sleep(0.05)  # a refused connect must not spin


async def _abandon_polls(t: Target, counts: dict) -> None:
    """One attacker: ``GET /v1/directives/{run}?wait=60`` on a fresh connection, closed as soon as it is
    sent (a client that left), until stopped."""
    loop = asyncio.get_running_loop()
    head = _get_head(t, f"/v1/directives/{t.run_id}?wait=60")
    while not counts["stopped"]:
        t0 = loop.time()
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(t.host, t.port), REQUEST_TIMEOUT_S)
            writer.write(head)
            await writer.drain()
            await asyncio.sleep(0.01)  # the request is in, the poll begun: then the client leaves
            writer.close()
            status = "abandoned"
        except (OSError, asyncio.TimeoutError):
            status = "conn-error"
            await asyncio.sleep(0.05)
        count(counts["status"], status)
        counts["times"].append(loop.time() - t0)


# ---- held connections -----------------------------------------------------------------------------------------

def _held_talk(t: Target, kind: str):
    """What one held connection sends: a slow header, a slow body, or a body cut one byte short."""
    if kind == "preauth-bodies":  # no token: the collector must not buffer this
        head = _post_head(t, "/v1/reports", PREAUTH_BODY_BYTES, token=None)
        blocks = [b" " * _BLOCK] * (PREAUTH_BODY_BYTES // _BLOCK - 1) + [b" " * (_BLOCK - 1)]
        return lambda reader, writer: _stream(reader, writer, head, iter(blocks))
    if kind == "slow-headers":  # a request line, then a header that never ends
        head = f"POST /v1/reports HTTP/1.1\r\nHost: {t.host}\r\n".encode()
        prefix, fill = b"X-Slowloris: ", b"a"
    else:  # complete headers, then a body that never arrives
        head = _post_head(t, "/v1/reports", SLOW_BODY_BYTES, token=t.token)
        prefix, fill = b"[", b" "
    return lambda reader, writer: _drip(reader, writer, head, prefix, fill)


async def _held_conn(t: Target, talk, counts: dict, delay: float) -> None:
    """One held attacker connection, reopened whenever the server ends it, until stopped: ``talk`` until
    the server answers or closes; count how and when it ended."""
    loop = asyncio.get_running_loop()
    await asyncio.sleep(delay)
    while not counts["stopped"]:
        try:
            reader, writer = await asyncio.open_connection(t.host, t.port)
        except OSError:
            count(counts["ended"], "connect failed")
            await asyncio.sleep(1.0)
            continue
        counts["opened"] += 1
        counts["open"] += 1
        t0 = loop.time()
        try:
            outcome = _outcome(await talk(reader, writer))
        except OSError:
            outcome = "reset"
        finally:
            counts["open"] -= 1
            writer.close()
        count(counts["ended"], outcome)
        counts["lifetimes"].append(loop.time() - t0)


async def _drip(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes, prefix: bytes,
                fill: bytes) -> bytes:
    """Send ``head``, then one byte a second (``prefix`` first, then ``fill`` forever) until the server
    answers or closes: its first bytes (``b""``: closed without a word)."""
    writer.write(head)
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


async def _stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes,
                  blocks: Iterator[bytes]) -> bytes:
    """Send ``head`` and ``blocks`` as fast as the server takes them, then wait, until the server answers or
    closes: its first bytes (``b""``: closed without a word)."""
    read = asyncio.ensure_future(reader.read(65536))
    try:
        writer.write(head)
        for block in blocks:
            writer.write(block)
            drained = asyncio.ensure_future(writer.drain())
            await asyncio.wait({read, drained}, return_when=asyncio.FIRST_COMPLETED)
            if read.done():
                drained.cancel()
                return read.result()
            drained.result()  # a reset connection raises here
        return await read
    finally:
        read.cancel()


def _outcome(reply: bytes) -> int | str:
    """How the server ended a connection: the HTTP status it answered, or ``closed``."""
    if not reply:
        return "closed"
    parts = reply.split(b"\r\n", 1)[0].split()
    return int(parts[1]) if len(parts) > 1 and parts[0].startswith(b"HTTP/") and parts[1].isdigit() else "other"
