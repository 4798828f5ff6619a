"""``nanwatch bench collector --replicas 1,2,4``: the collector bench's load spread over N real ``nanwatch
serve`` replicas on one PostgreSQL (``--database-url``, or a private server the bench starts:
``nanwatch.bench.pg_server``), each replica scraped, per (replicas, jobs): reports a second acknowledged, p99,
503s, the CPU seconds a report costs the replicas and the database server (``nanwatch.bench.pg_probe``), the
wait for a run's row lock and the conflicts (rollbacks) per report.

What the machine limits and what the design limits are told apart from those figures, not from the
reports a second a small machine reaches (there the bench, every replica and the server share the same
cores, so more replicas cannot add throughput, only spread it):

* **the machine:** CPU seconds a report costs, replicas' plus server's (``c``). Were that work spread over
  K cores, they would carry about ``K / c`` reports a second: a projection, printed as one;
* **the design:** what no core count removes. A replica runs its database calls on its event loop, so one
  replica carries at most ``1 / (its CPU + its wait for the database)`` per report, whatever the cores;
  and a run's writes are serialised by its row lock (``docs/replicas.md``), one transaction at a time,
  at most ``1 / (time a request spends in the database)`` a second for one run, whatever the replicas.
  Conflicts per report (a replica finding the run written by another, re-reading it and applying again)
  are the price of spreading one run over replicas: ``--route both`` puts round-robin next to routing
  by run id, and ``--total-ranks`` holds the load fixed while fewer runs share it (one run: every write
  under one row lock).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
import uuid
from contextlib import ExitStack

from nanwatch.bench.load import describe_load, quantiles, run_load, target_rate
from nanwatch.bench.pg_probe import ServerProbe
from nanwatch.bench.pg_server import databases
from nanwatch.bench.serve import CollectorProcess

__all__ = ["configs", "main", "projection", "row"]

PROJECT_CORES = (2, 8, 16)
"""Core counts the projection is printed for."""


def configs(args: argparse.Namespace) -> list[dict]:
    """The (route, replicas, load) configurations, in the order they run: for each route, each replica
    count, each of ``--jobs-sweep`` (job scope, as without replicas) or ``--jobs``; with ``--total-ranks``,
    ``ranks = total / jobs`` (the load held fixed, ``--scope`` kept)."""
    routes = ("rr", "sticky") if args.route == "both" else (args.route,)
    loads = []
    for jobs in args.jobs_sweep or [args.jobs]:
        load = dict(jobs=jobs)
        if args.total_ranks:
            load["ranks"] = max(1, args.total_ranks // jobs)
        elif args.jobs_sweep:
            load["scope"] = "job"
        loads.append(load)
    return [dict(route=route, replicas=n, **load) for route in routes for n in args.replicas for load in loads]


def _per(value: float | None, count: float, scale: float = 1e3) -> float:
    return math.nan if value is None or not count else value / count * scale


def row(one: argparse.Namespace, stats: dict) -> dict:
    """One configuration's figures (per report: ms of CPU or of session time)."""
    phase, seconds = stats["phases"][0], one.duration
    db = phase.get("db") or {}
    reports = phase["reports"]
    lat = quantiles(phase["lat"]) or (math.nan,) * 3
    status = phase["status"]
    cr, cd = _per(db.get("replica_cpu_s"), reports), _per(db.get("server_cpu_s"), reports)
    return dict(
        replicas=one.replicas_n, route=one.route, jobs=one.jobs, ranks=one.ranks, scope=one.scope,
        target=stats["target"], reports=reports / seconds, requests=len(phase["lat"]) / seconds,
        p50=lat[0] * 1e3, p99=lat[1] * 1e3, s503=status.get(503, 0),
        other=sum(n for k, n in status.items() if k not in (200, 503)),
        replica_cpu=100 * (db.get("replica_cpu_s") or math.nan) / seconds, replica_ms=cr,
        db_cpu=100 * (db.get("server_cpu_s") if db.get("server_cpu_s") is not None else math.nan) / seconds,
        db_ms=cd, db_share=cd / (cr + cd) if cr + cd > 0 else math.nan,
        lock_ms=_per(db.get("lock_s"), reports), io_ms=_per(db.get("io_s"), reports),
        active_ms=_per(db.get("active_s"), reports), in_tx_ms=_per(db.get("in_tx_s"), reports),
        rollbacks_k=_per(db.get("rollbacks"), reports), deadlocks=db.get("deadlocks"),
        tx_ms_request=_per(sum(db.get(k) or 0.0 for k in ("active_s", "io_s", "in_tx_s")), len(phase["lat"])),
        reports_per_request=reports / max(1, status.get(200, 0)),
        metrics_ms=statistics.median(t for t, _, _ in phase["scrape"]) * 1e3 if phase["scrape"] else math.nan)


def projection(r: dict, cores: int) -> float:
    """Reports a second ``r``'s replicas would carry on ``cores`` cores were the CPU work parallel (not
    measured): the lesser of the cores over the CPU a report costs, and the replicas' own ceiling (each
    event loop carries its CPU and its wait for the database, per report)."""
    cpu = (r["replica_ms"] + r["db_ms"]) / 1e3
    loop = (r["replica_ms"] + r["active_ms"] + r["io_ms"] + r["lock_ms"]) / 1e3
    if not cpu > 0 or not loop > 0:
        return math.nan
    return min(cores / cpu, r["replicas"] / loop)


def _table(rows: list[dict]) -> str:
    head = ("replicas", "route", "jobs x ranks", "reports/s (target)", "p50 / p99 ms", "503 / other",
            "replicas CPU % (ms/report)", "PostgreSQL CPU % (ms/report)", "DB share", "lock wait ms/report",
            "commit I/O ms/report", "rollbacks /1k reports", "/metrics ms")
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        lines.append(" | ".join((
            str(r["replicas"]), r["route"], f"{r['jobs']} x {r['ranks']} {r['scope']}",
            f"{r['reports']:.0f} ({r['target']:.0f})", f"{r['p50']:.1f} / {r['p99']:.1f}", f"{r['s503']} / {r['other']}",
            f"{r['replica_cpu']:.0f} ({r['replica_ms']:.2f})", f"{r['db_cpu']:.0f} ({r['db_ms']:.2f})",
            f"{100 * r['db_share']:.0f}%", f"{r['lock_ms']:.3f}", f"{r['io_ms']:.3f}", f"{r['rollbacks_k']:.1f}",
            f"{r['metrics_ms']:.0f}")))
    return "\n".join(f"| {line} |" for line in lines)


def _projection_table(rows: list[dict]) -> str:
    head = ("replicas", "route", "jobs", "CPU ms/report (replicas + DB)", "per core reports/s",
            "replica-loop ceiling reports/s", *(f"projected, {k} cores" for k in PROJECT_CORES),
            "one run: ≤ requests/s")
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        cpu = r["replica_ms"] + r["db_ms"]
        loop = r["replica_ms"] + r["active_ms"] + r["io_ms"] + r["lock_ms"]
        lines.append(" | ".join((
            str(r["replicas"]), r["route"], str(r["jobs"]), f"{cpu:.2f}", f"{1e3 / cpu:.0f}" if cpu > 0 else "-",
            f"{r['replicas'] * 1e3 / loop:.0f}" if loop > 0 else "-",
            *(f"{projection(r, k):.0f}" for k in PROJECT_CORES),
            f"{1e3 / r['tx_ms_request']:.0f}" if r["tx_ms_request"] > 0 else "-")))
    return "\n".join(f"| {line} |" for line in lines)


def _one_more(rows: list[dict]) -> list[str]:
    """What one more replica added, measured and projected, between consecutive replica counts of one
    (route, load)."""
    out = []
    for r in rows:
        prev = [p for p in rows if (p["route"], p["jobs"], p["ranks"]) == (r["route"], r["jobs"], r["ranks"])
                and p["replicas"] < r["replicas"]]
        if prev:
            p = max(prev, key=lambda p: p["replicas"])
            k = r["replicas"] - p["replicas"]
            out.append(f"  {p['replicas']} -> {r['replicas']} replicas ({r['route']}, {r['jobs']} jobs): measured "
                       f"{(r['reports'] - p['reports']) / k:+.0f} reports/s a replica here, p99 "
                       f"{p['p99']:.0f} -> {r['p99']:.0f} ms; projected on {max(PROJECT_CORES)} cores "
                       f"{(projection(r, max(PROJECT_CORES)) - projection(p, max(PROJECT_CORES))) / k:+.0f} a replica")
    return out


def main(args: argparse.Namespace) -> int:
    if args.url or args.matrix:
        print("nanwatch bench collector: --replicas starts its own collectors; not with --url or --matrix")
        return 2
    if min(args.replicas) < 1:
        print("nanwatch bench collector: --replicas needs counts >= 1")
        return 2
    from nanwatch.monitor.server import raise_fd_limit

    raise_fd_limit()  # before the replicas start, so that they inherit the raised limit
    rows = []
    with ExitStack() as stack:
        try:
            database, where = databases(stack, args.database_url)
        except RuntimeError as e:
            print(f"nanwatch bench collector: {e}")
            return 2
        print(f"machine: {os.cpu_count()} CPUs (load generator, replicas and PostgreSQL share them); database: "
              f"{where}", flush=True)
        for config in configs(args):
            one = argparse.Namespace(**{**vars(args), **{k: v for k, v in config.items() if k != "replicas"}})
            one.replicas_n, one.run_id = config["replicas"], f"{args.run_id}-{uuid.uuid4().hex[:6]}"
            print(f"--- {one.replicas_n} replicas, {one.route}: {describe_load(one)}", flush=True)
            url = database()
            with ExitStack() as replicas:
                started = [replicas.enter_context(CollectorProcess(database_url=url)) for _ in range(one.replicas_n)]
                time.sleep(0.5)  # the replicas' first lease and follow rounds, before the clock starts
                probe = ServerProbe(url, replica_pids=[c.proc.pid for c in started])
                stats = run_load([c.url for c in started], one, probes=lambda stats, stop, probe=probe: [probe.run(stats)])
            stats["target"] = target_rate(one)
            rows.append(r := row(one, stats))
            each = (stats["phases"][0].get("db") or {}).get("replica_cpu_each") or []
            print(f"reports/s {r['reports']:.0f} (target {r['target']:.0f}), p99 {r['p99']:.1f} ms, statuses "
                  f"{stats['phases'][0]['status']}, replicas {r['replica_ms']:.2f} + PostgreSQL {r['db_ms']:.2f} "
                  f"CPU ms/report, rollbacks {r['rollbacks_k']:.1f}/1k reports; each replica's CPU "
                  f"{', '.join('-' if c is None else f'{100 * c / one.duration:.0f}%' for c in each)}", flush=True)
    print(f"\n{args.duration:g} s measured per configuration after {args.warmup:g} s warmup; {args.sites} sites a "
          "report; CPU from /proc (the bench's own sampling backend left out); waits sampled from "
          "pg_stat_activity every 20 ms; rollbacks from pg_stat_database")
    print(_table(rows))
    print("\nProjection (not measured: the CPU work above spread over more cores, each replica still one event "
          "loop that waits for its database calls; 'one run' is the row lock's limit on one run's writes):")
    print(_projection_table(rows))
    if more := _one_more(rows):
        print("\nWhat one more replica adds:")
        print("\n".join(more))
    return 0
