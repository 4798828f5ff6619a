"""``nanwatch bench collector``: a load generator (a benchmark, not a test). N ranks x S sites, each rank
reporting once per second against one collector, measuring sustained reports/s, ingest latency,
/metrics render time and the collector's RSS.

Kept cheap so that it does not steal the collector's CPU: bodies are encoded once per rank (only the
sequence number changes), and each rank is a coroutine on its own raw HTTP/1.1 keep-alive connection.

Example usage::

    nanwatch bench collector --ranks 1024 --sites 64 --duration 30
    nanwatch bench collector --url http://127.0.0.1:8000   # an already running collector
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
import urllib.parse

from nanwatch.wire import LogitStat, ReportBatch, SdpaCall, SiteStat, StepReport

__all__ = ["main", "synthetic_report"]


def synthetic_report(*, run_id: str = "run-1", rank: int = 0, seq: int = 0, step: int | None = None,
                     incarnation: str = "inc0", layers: int = 4, dtype: str = "bfloat16",
                     nan_at: str | None = None, nan: int = 0, inf: int = 0, backend: str = "flash",
                     logit: float = 12.5, mode: str = "none", dropped: int = 0,
                     time_s: float | None = None) -> StepReport:
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


def _template(run_id: str, rank: int, sites: int) -> tuple[bytes, bytes]:
    """(prefix, suffix) around the seq/step values of one rank's pre-encoded report."""
    layers = max(1, (sites - 2) // 2)  # two sites per layer, plus logits and logprobs
    text = ReportBatch(reports=[synthetic_report(run_id=run_id, rank=rank, seq=0, step=0, layers=layers,
                                            time_s=1.7e9)]).model_dump_json()
    marker = '"seq":0,"step":0'
    head, tail = text.split(marker)
    return (head + '"seq":').encode(), tail.encode()


async def _request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes,
                   body: bytes = b"") -> tuple[int, bytes]:
    writer.write(head + body)
    status_line = await reader.readline()
    length = 0
    while (line := await reader.readline()) not in (b"\r\n", b""):
        if line[:15].lower() == b"content-length:":
            length = int(line[15:])
    data = await reader.readexactly(length) if length else b""
    return int(status_line.split()[1]), data


async def _rank(host: str, port: int, rank: int, args: argparse.Namespace, stats: dict, stop: float,
                start_at: float) -> None:
    prefix, suffix = _template(args.run_id, rank, args.sites)
    reader, writer = await asyncio.open_connection(host, port)
    loop = asyncio.get_running_loop()
    seq, next_at = 0, start_at + rank / args.ranks  # spread the ranks over the second
    try:
        while True:
            await asyncio.sleep(max(0.0, next_at - loop.time()))
            if loop.time() >= stop:
                return
            body = prefix + f'{seq},"step":{seq}'.encode() + suffix
            head = (f"POST /v1/reports HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n").encode()
            t0 = loop.time()
            status, _ = await _request(reader, writer, head, body)
            t1 = loop.time()
            if t0 >= stats["measure_from"]:
                stats["lat"].append(t1 - t0)
                stats["status"][status] = stats["status"].get(status, 0) + 1
            seq += 1
            next_at += 1.0 / args.rate
    finally:
        writer.close()


async def _scraper(host: str, port: int, stats: dict, stop: float, every_s: float) -> None:
    loop = asyncio.get_running_loop()
    head = f"GET /metrics HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode()
    await asyncio.sleep(every_s)
    while loop.time() < stop:
        t0 = loop.time()  # a fresh connection each time, as idle keep-alives are closed after 5 s
        reader, writer = await asyncio.open_connection(host, port)
        status, body = await _request(reader, writer, head)
        stats["scrape"].append((loop.time() - t0, len(body), body.count(b"\n")))
        writer.close()
        await asyncio.sleep(every_s)


def _rss_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


async def _run(url: str, args: argparse.Namespace) -> dict:
    u = urllib.parse.urlsplit(url)
    loop = asyncio.get_running_loop()
    start = loop.time() + 0.5
    stop = start + args.warmup + args.duration
    stats: dict = {"lat": [], "status": {}, "scrape": [], "measure_from": start + args.warmup}
    tasks = [_rank(u.hostname, u.port, r, args, stats, stop, start) for r in range(args.ranks)]
    tasks.append(_scraper(u.hostname, u.port, stats, stop, args.scrape_every))
    await asyncio.gather(*tasks)
    return stats


def _report(stats: dict, args: argparse.Namespace, rss: float | None) -> str:
    lat = sorted(stats["lat"])
    q = statistics.quantiles(lat, n=100, method="inclusive") if len(lat) > 1 else [float("nan")] * 99
    scrapes = stats["scrape"]
    lines = [
        f"machine: {os.cpu_count()} CPUs; load: {args.ranks} ranks x {args.sites} sites at {args.rate}/s per rank",
        f"sustained: {len(lat) / args.duration:.0f} reports/s over {args.duration:.0f} s "
        f"(target {args.ranks * args.rate:.0f}); statuses {stats['status']}",
        f"ingest latency: p50 {q[49] * 1e3:.1f} ms, p99 {q[98] * 1e3:.1f} ms, max {lat[-1] * 1e3:.1f} ms"
        if lat else "ingest latency: no samples",
    ]
    if scrapes:
        times = [t for t, _, _ in scrapes]
        lines.append(f"/metrics: {len(scrapes)} scrapes, median {statistics.median(times) * 1e3:.0f} ms, "
                     f"max {max(times) * 1e3:.0f} ms, {scrapes[-1][2]} lines, {scrapes[-1][1] / 1e6:.1f} MB")
    if rss is not None:
        lines.append(f"collector RSS: {rss:.0f} MiB")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="nanwatch bench collector", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", help="an already running collector (default: start one on a temp database)")
    p.add_argument("--ranks", type=int, default=1024)
    p.add_argument("--sites", type=int, default=64)
    p.add_argument("--rate", type=float, default=1.0, help="reports per second per rank")
    p.add_argument("--duration", type=float, default=20.0, help="measured seconds")
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--scrape-every", type=float, default=5.0)
    p.add_argument("--run-id", default="loadgen")
    args = p.parse_args(argv)
    if args.url:
        stats = asyncio.run(_run(args.url, args))
        print(_report(stats, args, None))
        return 0
    from nanwatch.monitor.server import CollectorProcess

    with tempfile.TemporaryDirectory() as tmp, CollectorProcess(db_path=os.path.join(tmp, "load.db")) as c:
        stats = asyncio.run(_run(c.url, args))
        print(_report(stats, args, _rss_mb(c.proc.pid)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
