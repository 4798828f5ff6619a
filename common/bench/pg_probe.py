"""What ``nanwatch bench collector --replicas`` reads beside the load: the CPU seconds of the collector
replicas and of the PostgreSQL server (from ``/proc``), and what the database's sessions were doing (from
PostgreSQL's own views), per measured window.

* **The server's CPU:** the postmaster's own time, its reaped children's (``cutime``/``cstime``: backends
  that ended inside the window) and every live child's (backends, WAL writer, checkpointer...), less the
  bench's own sampling backend. Found from this session's backend pid (``pg_backend_pid()``), whose parent
  is the postmaster: only for a server on this host (None otherwise: the share is then not measured).
* **Where the time went inside it:** ``pg_stat_activity`` sampled every ``every_s`` (default 20 ms), the
  replicas' sessions counted by state: running a statement (``active``), waiting on a lock (``lock``: a
  run's row lock held by another replica's transaction), on I/O or a light-weight lock (``io``: above all
  the COMMIT's WAL flush), or holding a transaction open while the replica computes (``in_tx``). A count
  times the interval estimates session-seconds: a sample, not a trace.
* **Conflicts:** ``pg_stat_database.xact_rollback`` and ``deadlocks`` over the window. The replicas' pool
  runs in autocommit, so a rollback is a write transaction that failed: above all a replica finding the
  run written by another (``StaleRun``: re-read, applied again inside the request; a second one is a 503).
  PostgreSQL's own counter, so the collector needs none of its own for this bench.

Example usage::

    probe = ServerProbe(url, replica_pids=[c.proc.pid for c in replicas])
    stats = run_load(urls, args, probes=lambda stats, stop: [probe.run(stats)])
    stats["phases"][0]["db"]   # {"server_cpu_s": ..., "replica_cpu_s": ..., "replica_cpu_each": [...], "lock_s": ...}
"""

from __future__ import annotations

import asyncio
import os

__all__ = ["ServerProbe", "cpu_s", "server_cpu_s"]

_ACTIVITY = """
SELECT count(*) FILTER (WHERE wait_event_type = 'Lock'),
       count(*) FILTER (WHERE state = 'active' AND wait_event_type IN ('IO', 'LWLock', 'IPC')),
       count(*) FILTER (WHERE state = 'active' AND wait_event_type IS NULL),
       count(*) FILTER (WHERE state LIKE 'idle in transaction%')
FROM pg_stat_activity
WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend'"""
_XACT = "SELECT xact_rollback, deadlocks FROM pg_stat_database WHERE datname = current_database()"


def _stat(pid: int) -> list[str] | None:
    """``/proc/PID/stat`` after the command name: [state, ppid, ...] (field n of proc(5) at index n - 3)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def cpu_s(pid: int) -> float | None:
    """User plus system CPU seconds of process ``pid`` (its threads included)."""
    f = _stat(pid)
    return None if f is None else (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def server_cpu_s(postmaster: int, *, exclude: frozenset[int] = frozenset()) -> float | None:
    """CPU seconds of a PostgreSQL server so far: the postmaster's own and reaped children's, and each live
    child's but ``exclude``'s. Differences of two readings are the server's CPU between them."""
    f = _stat(postmaster)
    if f is None:
        return None
    ticks = sum(int(x) for x in f[11:15])  # utime, stime, cutime, cstime
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and int(entry.name) not in exclude:
            g = _stat(int(entry.name))
            if g is not None and int(g[1]) == postmaster:
                ticks += int(g[11]) + int(g[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def _postmaster_of(backend: int) -> int | None:
    """The postmaster of this host's backend ``backend`` (None: the server runs elsewhere)."""
    try:
        with open(f"/proc/{backend}/comm") as f:
            if not f.read().startswith("postgres"):
                return None
    except OSError:
        return None
    f = _stat(backend)
    return None if f is None else int(f[1])


class ServerProbe:
    """Samples one database and the replicas beside each measured window of a load (``run`` is the
    coroutine ``nanwatch.bench.load.run_load``'s ``probes`` runs); writes ``phase["db"]``."""

    def __init__(self, url: str, *, replica_pids: list[int], every_s: float = 0.02) -> None:
        self.url, self.replica_pids, self.every_s = url, replica_pids, every_s

    async def run(self, stats: dict) -> None:
        import psycopg

        loop = asyncio.get_running_loop()
        async with await psycopg.AsyncConnection.connect(self.url, autocommit=True) as conn:
            me = (await (await conn.execute("SELECT pg_backend_pid()")).fetchone())[0]
            postmaster = _postmaster_of(me)
            exclude = frozenset({me})

            def cpu() -> dict:
                pids = [cpu_s(p) for p in self.replica_pids]
                return {"server_cpu_s": None if postmaster is None else server_cpu_s(postmaster, exclude=exclude),
                        "replica_cpu_s": None if None in pids else sum(pids), "replica_cpu_each": pids}

            async def xact() -> dict:
                await conn.execute("SELECT pg_stat_clear_snapshot()")
                row = await (await conn.execute(_XACT)).fetchone()
                return {"rollbacks": row[0], "deadlocks": row[1]}

            for phase in stats["phases"]:
                await asyncio.sleep(max(0.0, phase["from"] - loop.time()))
                before = {**await xact(), **cpu()}
                counts, samples = [0, 0, 0, 0], 0
                while loop.time() < phase["to"] - 0.05:
                    row = await (await conn.execute(_ACTIVITY)).fetchone()
                    counts = [c + n for c, n in zip(counts, row, strict=True)]
                    samples += 1
                    await asyncio.sleep(self.every_s)
                after = cpu()
                # the window's last transactions report their counts when their sessions go idle (at most
                # a second later, PostgreSQL 15): wait for that before reading them (the next window's
                # first second may then count here too: windows are back to back only with --rounds)
                await asyncio.sleep(1.1)
                after.update(await xact())
                seconds = phase["to"] - phase["from"]
                db = {k: (None if before[k] is None or after[k] is None else after[k] - before[k])
                      for k in before if k != "replica_cpu_each"}
                db["replica_cpu_each"] = [None if a is None or b is None else b - a
                                          for a, b in zip(before["replica_cpu_each"], after["replica_cpu_each"],
                                                          strict=True)]
                # samples x interval would miss the queries' own time: scale the counts to the window
                per = seconds / max(1, samples)
                db.update(lock_s=counts[0] * per, io_s=counts[1] * per, active_s=counts[2] * per,
                          in_tx_s=counts[3] * per, samples=samples)
                phase["db"] = db
