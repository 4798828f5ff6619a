"""``nanwatch bench durability``: kill -9 of collector replicas while reports flow through all of them, then
the count: every report acknowledged is in the database and in the replicas' summed ``/metrics`` once
(docs/replicas.md: a 200 is sent only after the COMMIT; a resend to another replica is a duplicate).

S senders (one run, a rank each, as a job's ranks behind a load balancer) post batches of reports, each
request round-robin to the next replica; a request that fails (the replica died under it: a reset, a
timeout, a 503) is sent again to the next one until a replica answers 200, as the trainer's sender
resends what it was not told was kept. Meanwhile C cycles: one replica (in turn) is killed with SIGKILL,
stays down ``--down`` seconds while the others take its share, and is started again on its port (its pod
replaced). Then the senders stop, and the reports are counted where they were kept:

* **acknowledged:** reports in batches answered 200 (each report is acknowledged once: its sender stops
  at the first 200); **duplicates:** reports the replicas answered as already kept (a batch whose replica
  committed it and died before its 200 got out, resent);
* **counted:** the run's non-finite call total in the database (``counters``), and summed over the
  replicas' ``/metrics`` (``sum by (run_id)``: the lease holder exports a run once), each report carrying
  one non-finite call;
* **lost** = acknowledged − counted (must be 0), **double-counted** = counted − reports made (must be 0).
  Exit 1 if either is not 0.

Example usage::

    nanwatch bench durability --replicas 2 --senders 4 --cycles 3        # a private PostgreSQL
    nanwatch bench durability --database-url postgresql://nanwatch@db/nanwatch --replicas 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import urllib.parse
import uuid
from contextlib import ExitStack
from dataclasses import dataclass, field

from nanwatch.bench.http1 import REQUEST_TIMEOUT_S, count, get_once, request
from nanwatch.bench.load import synthetic_report
from nanwatch.bench.serve import CollectorProcess
from nanwatch.wire import ReportBatch

__all__ = ["Tally", "main", "parser", "run", "verdict"]

SITE = "model.layers.0.self_attn"
METRIC = "nanwatch_site_nonfinite_calls_total"


@dataclass(slots=True)
class Tally:
    """What the senders did and what the replicas answered."""

    made: int = 0
    acknowledged: int = 0
    accepted: int = 0
    duplicates: int = 0
    failed: dict = field(default_factory=dict)
    """Requests not answered 200, by status (``conn-error``, ``timeout``, 503...): each was sent again."""
    kills: list = field(default_factory=list)
    """(replica, seconds it was down until ready again) per cycle."""


def verdict(tally: Tally, *, database: int | None, metrics: float | None) -> tuple[int, int, list[str]]:
    """(lost, double-counted, lines): lost is what was acknowledged and is missing from either count,
    double-counted what either count holds beyond the reports made."""
    counts = [c for c in (database, metrics) if c is not None]
    lost = max([tally.acknowledged - c for c in counts] + [0])
    double = max([c - tally.made for c in counts] + [0])
    lines = [f"reports made {tally.made}, acknowledged {tally.acknowledged} (answered 200; the collectors "
             f"counted {tally.accepted} accepted, {tally.duplicates} duplicates: resends of what a replica kept)",
             f"requests sent again after no 200: {sum(tally.failed.values())} {tally.failed}",
             f"counted: database {database if database is not None else 'not read'}, summed /metrics over "
             f"replicas {metrics if metrics is not None else 'not read'}",
             f"lost {int(lost)}, double-counted {int(double)}"]
    return int(lost), int(double), lines


def _target(url: str) -> tuple[str, int]:
    u = urllib.parse.urlsplit(url)
    return u.hostname, u.port


async def _post(target: tuple[str, int], conn: tuple | None, body: bytes) -> tuple[int | str, dict, tuple | None]:
    head = (f"POST /v1/reports HTTP/1.1\r\nHost: {target[0]}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    try:
        if conn is None:
            conn = await asyncio.wait_for(asyncio.open_connection(*target), REQUEST_TIMEOUT_S)
        status, answer, keep = await asyncio.wait_for(request(*conn, head, body), 5.0)
    except asyncio.TimeoutError:
        status, answer, keep = "timeout", b"", False
    except (OSError, EOFError, ValueError, IndexError):
        status, answer, keep = "conn-error", b"", False
    if not keep and conn is not None:
        conn[1].close()
        conn = None
    return status, json.loads(answer) if status == 200 else {}, conn


async def _sender(rank: int, run_id: str, targets: list[tuple[str, int]], args: argparse.Namespace,
                  tally: Tally, stop: asyncio.Event) -> None:
    conns: list[tuple | None] = [None] * len(targets)
    loop = asyncio.get_running_loop()
    seq, turn, start = 0, rank, loop.time()
    while not stop.is_set():
        body = ReportBatch(reports=[synthetic_report(run_id=run_id, rank=rank, seq=s, step=s, layers=2, nan_at=SITE,
                                                     nan=1, dtype="float32", time_s=time.time())
                                    for s in range(seq, seq + args.batch)]).model_dump_json().encode()
        tally.made += args.batch
        while True:  # until a replica answers 200, as the trainer's sender resends
            t = turn % len(targets)
            turn += 1
            status, answer, conns[t] = await _post(targets[t], conns[t], body)
            if status == 200:
                tally.acknowledged += args.batch
                tally.accepted += answer.get("accepted", 0)
                tally.duplicates += answer.get("duplicates", 0)
                break
            count(tally.failed, status)
            await asyncio.sleep(0.05)
        seq += args.batch
        await asyncio.sleep(max(0.0, start + seq / args.batch / args.rate - loop.time()))
    for conn in conns:
        if conn is not None:
            conn[1].close()


def _cycles(replicas: list[CollectorProcess], url: str, args: argparse.Namespace, tally: Tally) -> None:
    """The kills, on a thread of their own (a restart waits for /readyz)."""
    for cycle in range(args.cycles):
        time.sleep(args.up)
        i = cycle % len(replicas)
        victim = replicas[i]
        victim.kill()
        t0 = time.monotonic()
        time.sleep(args.down)
        replicas[i] = CollectorProcess(database_url=url, port=victim.port).start()
        tally.kills.append((i, time.monotonic() - t0))
    time.sleep(args.up)


def _summed_metric(targets: list[tuple[str, int]], run_id: str) -> float | None:
    """The run's non-finite calls summed over every replica's /metrics (None: a scrape failed)."""

    async def scrape_all() -> list[tuple[int | str, bytes]]:
        return await asyncio.gather(*(get_once(h, p, f"GET /metrics HTTP/1.1\r\nHost: {h}\r\nConnection: close\r\n\r\n"
                                                        .encode()) for h, p in targets))

    total = 0.0
    for status, body in asyncio.run(scrape_all()):
        if status != 200:
            return None
        for line in body.decode().splitlines():
            if line.startswith(METRIC + "{") and f'run_id="{run_id}"' in line:
                total += float(line.rsplit(" ", 1)[1])
    return total


def _database_count(url: str, run_id: str) -> int | None:
    """The run's per-site non-finite total as the database holds it (the ``counters`` rows of family
    ``site``, the store's name for what ``nanwatch_site_nonfinite_calls_total`` exports), None if none."""
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute("SELECT value FROM counters WHERE run_id = %s AND family = 'site'", (run_id,)).fetchall()
    return sum(int(v) for (v,) in rows) if rows else None


def run(url: str, args: argparse.Namespace) -> tuple[Tally, int | None, float | None]:
    """One durability run on database ``url``: (the tally, the database's count, the summed /metrics)."""
    run_id = f"durability-{uuid.uuid4().hex[:6]}"
    tally = Tally()
    with ExitStack() as stack:
        replicas = [CollectorProcess(database_url=url, env={"NANWATCH_DATABASE_REFRESH_S": "0.2"}).start()
                    for _ in range(args.replicas)]
        stack.callback(lambda: [c.stop() for c in replicas])
        targets = [_target(c.url) for c in replicas]

        async def flow() -> None:
            stop = asyncio.Event()
            senders = [asyncio.create_task(_sender(k, run_id, targets, args, tally, stop)) for k in range(args.senders)]
            await asyncio.get_running_loop().run_in_executor(None, _cycles, replicas, url, args, tally)
            stop.set()
            await asyncio.gather(*senders)

        asyncio.run(flow())
        deadline, metrics = time.monotonic() + args.settle, None
        while time.monotonic() < deadline:  # the lease holder's export, within a few refresh periods
            metrics = _summed_metric(targets, run_id)
            if metrics == tally.acknowledged:
                break
            time.sleep(0.2)
        return tally, _database_count(url, run_id), metrics


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nanwatch bench durability", description=__doc__.split("\n\n")[0])
    p.add_argument("--database-url", metavar="URL",
                   help="the PostgreSQL the replicas share (default: a private server the bench starts, initdb in a "
                        "temp dir on loopback; needs PostgreSQL's server binaries)")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--senders", type=int, default=4, help="concurrent senders (one run, a rank each)")
    p.add_argument("--cycles", type=int, default=3, help="kill -9 and restart cycles, one replica in turn")
    p.add_argument("--batch", type=int, default=8, help="reports a request")
    p.add_argument("--rate", type=float, default=10.0, help="requests a second per sender")
    p.add_argument("--up", type=float, default=2.0, help="seconds all replicas run between kills")
    p.add_argument("--down", type=float, default=1.0, help="seconds a killed replica stays down")
    p.add_argument("--settle", type=float, default=20.0,
                   help="seconds the summed /metrics may take to show every report (the lease's period)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.replicas < 2 or args.senders < 1 or args.cycles < 1 or args.batch < 1 or args.rate <= 0:
        print("nanwatch bench durability: need --replicas >= 2 (one must serve while another is down), "
              "--senders, --cycles, --batch >= 1, --rate > 0")
        return 2
    from nanwatch.bench.pg_server import databases

    with ExitStack() as stack:
        try:
            database, where = databases(stack, args.database_url)
        except RuntimeError as e:
            print(f"nanwatch bench durability: {e}")
            return 2
        print(f"durability: {args.replicas} replicas on {where}; {args.senders} senders (one run, a rank each), "
              f"batches of {args.batch} at {args.rate:g}/s each, round-robin per request; {args.cycles} kill -9 "
              f"cycles ({args.up:g} s up, {args.down:g} s down)", flush=True)
        tally, in_database, in_metrics = run(database(), args)
    lost, double, lines = verdict(tally, database=in_database, metrics=in_metrics)
    print(f"kills: {', '.join(f'replica {i} back after {s:.1f} s' for i, s in tally.kills)}")
    print("\n".join(lines))
    return 0 if lost == double == 0 and in_database is not None and in_metrics is not None else 1
