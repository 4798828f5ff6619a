"""Where a replica's counter series start when it begins exporting a run (replicas on a shared PostgreSQL
database, docs/replicas.md#metrics): so that ``sum by (run_id) (increase(...))`` over the replicas counts
every increment once, across any number of handovers, whatever happened between two scrapes.

A run's series are exported by one replica at a time (the lease holder). Each of its tenures must start
where the run's series last stood in Prometheus, or increments fall in the gap (a NaN committed between
the dead holder's last scrape and the new holder's first would never show in any ``increase()``) or are
counted twice. So every export records, per run, the totals it showed (``nanwatch.monitor.pg
.shared_metrics``), and a new tenure starts from the totals the previous holder's last export recorded
(``recorded``):

* a key this process never showed starts at the recorded total (0 if never exported): the new series'
  first sample is the old one's last, so the increments in the gap are its first increase;
* a key this process showed before (it held the run, lost it, takes it again) continues its own series,
  its last shown value, plus what happened since the recorded total: the increments the other holder's
  series counted meanwhile are not counted again.

The first render of a tenure shows where the series start, the next the current figures; so does a key
that appears later in the tenure (from 0 if no export showed it: born at zero, which the tenures do for
replicas in place of ``RunState.newborn``). A shown value never goes down (a replica whose memory lags the recorded total shows
its series flat until it catches up: never a counter reset, which ``increase()`` would count whole).

Example usage::

    tenures = Tenures()
    tenures.begin("run-1", recorded={("site", ("l1", "forward")): 3})   # the previous holder's last export
    shown, totals, news = tenures.show("run-1", {("site", ("l1", "forward")): 5})   # {...: 3}: the start
    shown, totals, news = tenures.show("run-1", {("site", ("l1", "forward")): 5})   # {...: 5}
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Key", "Tenures"]

#: a counter's key: (family, labels after run_id), as ``RunState.counters`` keeps them
Key = tuple[str, tuple]


@dataclass(slots=True)
class _Tenure:
    recorded: dict[Key, int]
    """The totals the run's previous export showed (its previous holder's, or this one's)."""
    base: dict[Key, int] = field(default_factory=dict)
    """Where this tenure's series of each key started (fixed at a key's first render in the tenure)."""
    started: bool = False
    """The tenure's first render was taken (it showed ``base``)."""


class Tenures:
    """This replica's tenures of the runs it exports, and the last value each of its series showed."""

    __slots__ = ("_last", "_runs")

    def __init__(self) -> None:
        self._runs: dict[str, _Tenure] = {}
        self._last: dict[str, dict[Key, int]] = {}

    def begin(self, run_id: str, recorded: dict[Key, int]) -> None:
        """This replica now exports ``run_id``; ``recorded``: the totals the run's last export showed."""
        self._runs[run_id] = _Tenure(dict(recorded))

    def end(self, run_id: str) -> None:
        """This replica no longer exports ``run_id`` (its series' last values are kept for its next tenure)."""
        self._runs.pop(run_id, None)

    def forget(self, run_id: str) -> None:
        """The run is gone from this replica's memory."""
        self._runs.pop(run_id, None)
        self._last.pop(run_id, None)

    def holds(self, run_id: str) -> bool:
        return run_id in self._runs

    def show(self, run_id: str, totals: dict[Key, int]) -> tuple[dict[Key, int], dict[Key, int], bool]:
        """(what this render shows for each key of ``totals``, the totals that corresponds to: what to
        record as this export's, and whether a key was shown at its start below its figure: the next render
        must not reuse this one). A run without a tenure (never begun) shows its totals."""
        tenure = self._runs.get(run_id)
        if tenure is None:
            return dict(totals), dict(totals), False
        last = self._last.setdefault(run_id, {})
        shown, equivalent, news = {}, {}, False
        for key, total in totals.items():
            new = key not in tenure.base
            if new:
                tenure.base[key] = last[key] if key in last else tenure.recorded.get(key, 0)
            base, from_ = tenure.base[key], tenure.recorded.get(key, 0)
            value = max(last.get(key, base), total - from_ + base)
            if new or not tenure.started:  # where its series starts, this once
                news = news or value != base
                value = base
            shown[key] = last[key] = value
            equivalent[key] = value - base + from_
        tenure.started = True
        return shown, equivalent, news
