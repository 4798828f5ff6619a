"""Collector shards: the trainer picks one of several collectors by rendezvous hashing of its run id. Stable
(every rank, any list order), uniform enough, and adding an Nth shard moves only ~1/N of the runs."""

from __future__ import annotations

import pytest

from nanwatch.addresses import collector_urls, pick_collector
from nanwatch.hooks.config import MonitorConfig, resolve_config

SHARDS = [f"http://collector-{i}.nanwatch:9464" for i in range(4)]
RUNS = [f"run-{i}" for i in range(4000)]


def test_the_choice_is_stable_and_ignores_the_lists_order_and_a_trailing_slash():
    for run in RUNS[:200]:
        got = pick_collector(SHARDS, run)
        assert pick_collector(list(reversed(SHARDS)), run) == got
        assert pick_collector([u + "/" for u in SHARDS], run).rstrip("/") == got


def test_runs_spread_evenly_over_the_shards():
    counts = {u: 0 for u in SHARDS}
    for run in RUNS:
        counts[pick_collector(SHARDS, run)] += 1
    expected = len(RUNS) / len(SHARDS)
    assert all(abs(n - expected) < 0.1 * expected for n in counts.values()), counts  # 4000 runs: ~±3% is 2 sigma


def test_adding_a_shard_moves_only_about_one_run_in_n_and_only_onto_the_new_one():
    more = [*SHARDS, "http://collector-4.nanwatch:9464"]
    moved = [run for run in RUNS if pick_collector(SHARDS, run) != pick_collector(more, run)]
    assert all(pick_collector(more, run) == more[-1] for run in moved)
    assert abs(len(moved) / len(RUNS) - 1 / len(more)) < 0.03  # 1/5 = 20%


def test_a_config_with_several_collectors_holds_the_one_its_run_picks():
    given = MonitorConfig(run_id="run-7", collector=SHARDS)
    assert (given.collector, given.collectors) == (SHARDS, ())  # the shard is chosen by resolve_config
    listed = resolve_config(given)
    comma = resolve_config(MonitorConfig(run_id="run-7", collector=" , ".join(SHARDS)))
    assert listed.collector == comma.collector == pick_collector(SHARDS, "run-7")
    assert listed.collectors == comma.collectors == tuple(SHARDS)
    assert resolve_config(listed) is listed  # resolving twice changes nothing
    one = resolve_config(MonitorConfig(run_id="run-7", collector=SHARDS[0]))
    assert (one.collector, one.collectors) == (SHARDS[0], (SHARDS[0],))
    with pytest.raises(ValueError, match="collector must be"):  # a bad URL is refused at construction
        MonitorConfig(run_id="run-7", collector=[SHARDS[0], "ftp://b"])


@pytest.mark.parametrize("bad", ["", "http://a:1,,http://b:2", ["http://a:1", "ftp://b"], []])
def test_a_bad_collector_list_is_refused_with_what_is_expected(bad):
    with pytest.raises(ValueError, match="collector must be"):
        collector_urls(bad)


def test_report_options_are_checked_at_construction():
    for kw in ({"report_scope": "node"}, {"heartbeat_s": 0}, {"report_reduce_timeout_s": -1}):
        with pytest.raises(ValueError):
            MonitorConfig.from_options(run_id="r", **kw)



def test_a_large_jobs_heartbeats_slow_down_so_one_job_costs_a_collector_under_100_requests_a_second():
    from nanwatch.hooks.report.job import heartbeat, heartbeat_interval
    from nanwatch.wire import StepReport

    assert heartbeat_interval(None, 16) == heartbeat_interval(None, 3000) == 30.0
    assert heartbeat_interval(None, 65_536) == 655.36 and 65_536 / heartbeat_interval(None, 65_536) <= 100
    assert heartbeat_interval(5.0, 65_536) == 5.0  # the user's choice stands
    own = StepReport(run_id="r", rank=3, world_size=8, incarnation="i", seq=4, step=9, time=1.0)
    beat = heartbeat(own, 655.36)
    assert (beat.scope, beat.heartbeat_s, beat.rank, beat.seq) == ("heartbeat", 655.36, 3, 4)
