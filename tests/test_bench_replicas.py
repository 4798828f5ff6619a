"""``nanwatch bench collector --replicas`` and ``nanwatch bench durability`` (#40): the routing, the sweep's
configurations, the CPU reading of a server's process tree, the projection and the durability verdict as
units; then both against real replicas on the tests' private PostgreSQL. Counts and shapes, never times."""

import math
import os
import subprocess
import sys
from collections import Counter

import pytest
from support import wait_until

from nanwatch.bench import collector_replicas
from nanwatch.bench.durability import Tally, verdict
from nanwatch.bench.load import parser, target_of
from nanwatch.bench.pg_probe import cpu_s, server_cpu_s


def test_round_robin_spreads_each_sender_over_every_replica_and_sticky_keeps_a_run_on_one():
    rr = Counter(target_of("rr", 4, index=1, n=n, run_id="r") for n in range(40))
    assert rr == {0: 10, 1: 10, 2: 10, 3: 10}
    assert target_of("rr", 4, index=1, n=0, run_id="r") != target_of("rr", 4, index=2, n=0, run_id="r")
    for run_id in ("a", "job-7", "loadgen-12"):
        assert len({target_of("sticky", 4, index=i, n=n, run_id=run_id) for i in range(5) for n in range(9)}) == 1
    assert len({target_of("sticky", 4, index=0, n=0, run_id=f"run-{j}") for j in range(64)}) == 4
    assert {target_of(route, 1, index=3, n=5, run_id="x") for route in ("rr", "sticky")} == {0}


def _args(*argv: str):
    return parser().parse_args(["--replicas", "1,2", *argv])


def test_a_sweep_runs_every_route_replica_count_and_load_and_total_ranks_holds_the_load_fixed():
    plain = collector_replicas.configs(_args("--jobs-sweep", "4,8", "--route", "both"))
    assert [(c["route"], c["replicas"], c["jobs"], c["scope"]) for c in plain] == [
        ("rr", 1, 4, "job"), ("rr", 1, 8, "job"), ("rr", 2, 4, "job"), ("rr", 2, 8, "job"),
        ("sticky", 1, 4, "job"), ("sticky", 1, 8, "job"), ("sticky", 2, 4, "job"), ("sticky", 2, 8, "job")]
    fixed = collector_replicas.configs(_args("--jobs-sweep", "1,4,16", "--total-ranks", "64"))
    assert [(c["jobs"], c["ranks"]) for c in fixed if c["replicas"] == 1] == [(1, 64), (4, 16), (16, 4)]
    assert all("scope" not in c for c in fixed)  # --scope kept: per rank, a run's ranks post concurrently
    assert [c["jobs"] for c in collector_replicas.configs(_args("--jobs", "3"))] == [3, 3]


def test_the_servers_cpu_counts_its_children_but_the_excluded_one():
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass\ntime.sleep(30)"
    me = os.getpid()
    before = server_cpu_s(me)
    child = subprocess.Popen([sys.executable, "-c", burn])
    try:
        wait_until(lambda: cpu_s(child.pid) >= 0.4, "the child to burn its 0.4 s of CPU", timeout_s=60)
        counted, without = server_cpu_s(me), server_cpu_s(me, exclude=frozenset({child.pid}))
    finally:
        child.kill()
        child.wait()
    assert counted - before >= 0.4 - 1e-9  # (clock ticks summed, as floats)
    assert without - before < 0.4  # (this process's own time moved on a little meanwhile)
    assert server_cpu_s(2**22 + 12345) is None  # no such process: not measured, never 0


def _row(**kw):
    base = dict(replicas=2, replica_ms=0.5, db_ms=0.5, active_ms=0.2, io_ms=0.2, lock_ms=0.1)
    return {**base, **kw}


def test_the_projection_is_the_cores_over_the_cpu_until_the_replicas_own_loops_bound_it():
    r = _row()  # 1 ms of CPU a report; each replica's loop busy 1 ms a report (0.5 own + 0.5 waiting)
    assert collector_replicas.projection(r, 1) == pytest.approx(1000)
    assert collector_replicas.projection(r, 2) == pytest.approx(2000)
    assert collector_replicas.projection(r, 16) == pytest.approx(2000)  # two replicas: two loops
    assert collector_replicas.projection(_row(replicas=8), 16) == pytest.approx(8000)
    assert math.isnan(collector_replicas.projection(_row(replica_ms=math.nan), 4))


def test_the_durability_verdict_finds_a_lost_and_a_double_counted_report():
    ok = Tally(made=80, acknowledged=80, accepted=80)
    assert verdict(ok, database=80, metrics=80.0)[:2] == (0, 0)
    assert verdict(ok, database=79, metrics=80.0)[:2] == (1, 0)
    assert verdict(ok, database=80, metrics=81.0)[:2] == (0, 1)
    lines = verdict(ok, database=None, metrics=80.0)[2]
    assert "database not read" in lines[2]


@pytest.mark.parametrize("argv", [["collector", "--database-url", "postgresql://x/y"],
                                  ["collector", "--total-ranks", "64"],
                                  ["collector", "--replicas", "2", "--url", "http://127.0.0.1:1"],
                                  ["collector", "--replicas", "0"],
                                  ["durability", "--replicas", "1"]])
def test_options_that_do_not_go_together_exit_2(argv, capsys):
    from nanwatch.bench import main

    assert main(argv) == 2
    assert "nanwatch bench" in capsys.readouterr().out


def _table_rows(printed: str, first: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in printed.splitlines()
            if line.startswith(f"| {first}")]


@pytest.mark.slow
def test_replicas_bench_against_a_real_database_reports_each_configuration(pg_url, capsys):
    from nanwatch.bench import main

    assert main(["collector", "--replicas", "1,2", "--route", "both", "--database-url", pg_url, "--scope", "job",
                 "--ranks", "16", "--jobs", "2", "--sites", "8", "--duration", "1.5", "--warmup", "0.5",
                 "--scrape-every", "0.5", "--heartbeat-every", "2"]) == 0
    printed = capsys.readouterr().out
    rows = [r for r in _table_rows(printed, "") if r[0].isdigit() and len(r) == 13]
    assert [(r[0], r[1]) for r in rows] == [("1", "rr"), ("2", "rr"), ("1", "sticky"), ("2", "sticky")]
    for r in rows:
        assert float(r[3].split()[0]) > 0, r  # reports acknowledged
        assert r[5].split(" / ")[1] == "0", r  # nothing but 200 and 503
        assert r[7] != "nan (nan)", r  # the server is on this host: its CPU was read
    projected = [r for r in _table_rows(printed, "") if r[0].isdigit() and len(r) == 10]
    assert len(projected) == 4
    assert "1 -> 2 replicas (rr, 2 jobs)" in printed and "1 -> 2 replicas (sticky, 2 jobs)" in printed


@pytest.mark.slow
def test_durability_kill_9_of_replicas_in_turn_loses_nothing_and_counts_nothing_twice(pg_url, capsys):
    from nanwatch.bench import main

    assert main(["durability", "--database-url", pg_url, "--replicas", "2", "--cycles", "2", "--senders", "2",
                 "--up", "1", "--down", "0.5", "--rate", "5", "--batch", "4"]) == 0
    printed = capsys.readouterr().out
    assert printed.count("back after") == 2  # each replica killed and restarted once
    made = int(printed.split("reports made ", 1)[1].split(",")[0])
    assert made > 0 and f"acknowledged {made} " in printed
    assert f"counted: database {made}, summed /metrics over replicas {float(made)}" in printed
    assert "lost 0, double-counted 0" in printed
