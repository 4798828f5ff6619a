"""The Prometheus exporter: a custom ``Collector`` that builds fresh families from the state on every
scrape, so nothing is kept twice and an expired rank simply stops being yielded.

Per-layer and per-site series are aggregated over ranks here (max or sum): never a rank x layer series.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Iterable, Iterator

from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from nanwatch.monitor.directive_log import DirectiveLog
from nanwatch.monitor.metric_names import METRICS, family
from nanwatch.monitor.state import CollectorState

__all__ = ["StateCollector"]

_PASSES = (("forward", "nan"), ("forward", "inf"), ("backward", "nan"), ("backward", "inf"))
#: RLHF figures and how they combine over ranks (each rank's latest step)
_RLHF = {"ratio_max": max, "kl_k1_max": max, "kl_k3_max": max, "logprob_min": min,
         "clip_fraction": statistics.fmean, "kl_k1_mean": statistics.fmean, "kl_k3_mean": statistics.fmean,
         "kl_k3_ratio_mean": statistics.fmean, "advantage_std": statistics.fmean}


def _max(values: Iterable[float]) -> float:
    """Max that lets NaN win: a NaN bound is news, not something to hide behind a finite one."""
    best = -math.inf
    for v in values:
        if v != v:
            return math.nan
        if v > best:
            best = v
    return best


class StateCollector(Collector):
    def __init__(self, state: CollectorState, directives: DirectiveLog, *, logit_tau: float) -> None:
        self._state = state
        self._directives = directives
        self._tau = logit_tau

    def describe(self) -> Iterator[Metric]:
        # Families are dynamic; describing them empty keeps registration from calling collect().
        for name in METRICS:
            yield family(name)

    def collect(self) -> Iterator[Metric]:
        state, now = self._state, time.monotonic()
        f = {name: family(name) for name in METRICS}
        for run_id, run in state.runs.items():
            if run.series_dropped:
                f["nanwatch_collector_series_dropped_total"].add_metric([run_id], run.series_dropped)
            for kind, n in run.event_counts.items():
                f["nanwatch_events_total"].add_metric([run_id, kind], n)
            if not state.is_live(run, now):
                continue
            fo = run.first_offender
            if fo is not None:
                f["nanwatch_first_offender_info"].add_metric(
                    [run_id, fo.site or "", str(fo.detail.get("phase") or ""), str(fo.detail.get("stage") or "train"),
                     "" if fo.rank is None else str(fo.rank)], 1)
            live = state.live_ranks(run, now)
            f["nanwatch_live_ranks"].add_metric([run_id], len(live))
            d = self._directives.current(run_id)
            f["nanwatch_directive_info"].add_metric([run_id, d.mode, str(d.version)], 1)
            counters = run.counters
            layers: dict[str, list[float]] = {}
            kinds: dict[str, list[float]] = {}
            for st in live:
                rank = str(st.rank)
                for pass_, kind in _PASSES:
                    f["nanwatch_nonfinite_values_total"].add_metric(
                        [run_id, rank, pass_, kind], counters.get(("nonfinite", (rank, pass_, kind)), 0.0))
                f["nanwatch_attention_mode"].add_metric([run_id, rank, st.mode], 1)
                f["nanwatch_last_report_timestamp_seconds"].add_metric([run_id, rank], st.received)
                f["nanwatch_reports_dropped_total"].add_metric([run_id, rank], st.dropped)
                f["nanwatch_skipped_steps_total"].add_metric([run_id, rank], counters.get(("skipped", (rank,)), 0.0))
                for layer, bound in st.logits.items():
                    layers.setdefault(layer, []).append(bound)
                for kind, h in st.headroom.items():
                    kinds.setdefault(kind, []).append(h)
            for layer, bounds in layers.items():
                f["nanwatch_attention_logit_max"].add_metric([run_id, layer], _max(bounds))
            for kind, hs in kinds.items():
                f["nanwatch_tensor_headroom_ratio"].add_metric([run_id, kind], _max(hs))
            for stat, combine in _RLHF.items():
                values = [v for st in live if st.rlhf is not None and (v := getattr(st.rlhf, stat)) is not None]
                if values:
                    f["nanwatch_rlhf_stat"].add_metric([run_id, stat], combine(values))
            for (fam, labels), value in counters.items():
                if fam == "site":
                    f["nanwatch_site_nonfinite_values_total"].add_metric([run_id, *labels], value)
                elif fam == "sdpa":
                    f["nanwatch_sdpa_calls_total"].add_metric([run_id, *labels], value)
                elif fam == "unmeasured":
                    f["nanwatch_unmeasured_steps_total"].add_metric([run_id, *labels], value)
                elif fam == "incident":
                    f["nanwatch_incidents_total"].add_metric([run_id, *labels], value)
        f["nanwatch_collector_logit_tau"].add_metric([], self._tau)
        f["nanwatch_collector_reports_accepted_total"].add_metric([], state.accepted)
        f["nanwatch_collector_reports_duplicate_total"].add_metric([], state.duplicates)
        for reason, n in state.rejected.items():
            f["nanwatch_collector_requests_rejected_total"].add_metric([reason], n)
        yield from f.values()
