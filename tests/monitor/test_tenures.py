"""Where a replica's counter series of a run start (``nanwatch.monitor.data.tenures``): the sum over
replicas of what Prometheus's ``increase()`` reads from each series is the run's true count across
handovers, re-takes and a restart, never less, never more."""

from nanwatch.monitor.data.tenures import Tenures

K = ("site", ("model.layers.1.self_attn", "forward"))
NEW = ("site", ("model.layers.2.self_attn", "forward"))


def _increase(samples: list[float]) -> float:
    """What increase() adds up over one series' samples (no extrapolation): each rise, and after a drop (a
    counter reset) the new value whole."""
    return sum(b - a if b >= a else b for a, b in zip(samples, samples[1:], strict=False))


def test_a_new_exporter_starts_where_the_last_export_stood_so_the_gap_is_its_first_increase():
    a, b = Tenures(), Tenures()
    a.begin("r", {})
    series_a = [a.show("r", {K: 0})[0][K], a.show("r", {K: 2})[0][K]]
    _, recorded, _ = a.show("r", {K: 2})  # a's last export (what a recorded) ...
    series_a.append(2)
    # ... then a NaN (total 3) before a dies unscraped: b's series starts at 2, the recorded total
    b.begin("r", recorded)
    series_b = [b.show("r", {K: 3})[0][K], b.show("r", {K: 3})[0][K], b.show("r", {K: 5})[0][K]]
    assert series_b == [2, 3, 5]
    assert _increase(series_a) + _increase(series_b) == 5  # every increment once


def test_a_re_take_continues_its_own_series_without_counting_the_other_holders_increments():
    a, b = Tenures(), Tenures()
    a.begin("r", {})
    seen_a = [a.show("r", {K: n})[0][K] for n in (0, 4)]
    _, rec, _ = a.show("r", {K: 4})
    seen_a.append(4)
    a.end("r")
    b.begin("r", rec)
    seen_b = [b.show("r", {K: n})[0][K] for n in (4, 9)]
    _, rec, _ = b.show("r", {K: 9})
    seen_b.append(9)
    b.end("r")
    a.begin("r", rec)  # a takes the run back: its series (same instance in Prometheus) continues from 4
    more_a = [a.show("r", {K: n})[0][K] for n in (9, 10)]
    assert more_a == [4, 5]  # never 9: b's five would be counted twice
    assert _increase(seen_a + more_a) + _increase(seen_b) == 10


def test_a_restarted_replica_starts_from_the_record_and_a_lagging_memory_shows_flat():
    b = Tenures()
    b.begin("r", {K: 7})
    assert [b.show("r", {K: n})[0][K] for n in (5, 6, 8)] == [7, 7, 8]  # never below 7: no counter reset
    fresh = Tenures()  # never exported anything: the run's first exporter shows its totals
    assert fresh.show("r", {K: 3})[0][K] == 3
    fresh.begin("r", {})
    assert [fresh.show("r", {K: 3})[0][K], fresh.show("r", {K: 4})[0][K]] == [0, 4]


def test_a_key_new_in_a_tenure_is_born_at_zero_and_each_start_below_its_figure_is_news():
    t = Tenures()
    t.begin("r", {K: 2})
    assert t.show("r", {K: 2}) == ({K: 2}, {K: 2}, False)  # the start is the figure: nothing to re-render
    assert t.show("r", {K: 3, NEW: 4}) == ({K: 3, NEW: 0}, {K: 3, NEW: 0}, True)  # NEW at 0 first
    assert t.show("r", {K: 3, NEW: 4})[0] == {K: 3, NEW: 4}
    b = Tenures()
    b.begin("r", {K: 3})
    assert b.show("r", {K: 5, NEW: 4})[2] is True  # starts at 3 and 0 under 5 and 4: the next render differs
