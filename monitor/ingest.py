"""Folding a batch of step reports into the state and the store (the ledger calls this inside its
transaction): drop replays, update the per-rank views and counters (each scope feeds its own part:
``nanwatch.monitor.scopes``), let the rule engine record what the
reports show, and write the high-water marks and counter totals, so that a replay is never counted twice.
"""

from __future__ import annotations

import time
from typing import NamedTuple

from nanwatch.monitor.rules import RuleEngine, RuleWrites
from nanwatch.monitor.scopes import apply_report, is_new
from nanwatch.monitor.state import CollectorState
from nanwatch.monitor.store import Store
from nanwatch.wire import ReportBatch

__all__ = ["Ingested", "fold"]


class Ingested(NamedTuple):
    """What the collector did with a batch. Replays are acknowledged too: they are ``duplicates``."""

    accepted: int
    duplicates: int


def fold(batch: ReportBatch, *, state: CollectorState, store: Store, rule_engine: RuleEngine,
         into: RuleWrites) -> Ingested:
    """Fold the new reports into memory and write them (inside the caller's transaction)."""
    now, mono = time.time(), time.monotonic()
    accepted = dupes = 0
    hwm_rows: list[tuple[str, int, str, int, int]] = []
    counter_rows: dict[tuple[str, str, tuple], float] = {}
    for r in batch.reports:
        if not is_new(state, r):
            dupes += 1
            continue
        rank, previous_mode, changed = apply_report(state, r, received=now, seen=mono)
        for fam, labels, value in changed:
            counter_rows[(r.run_id, fam, labels)] = value
        if r.scope != "heartbeat":  # a heartbeat counts nothing: its replay is harmless, so no mark is kept
            hwm_rows.append((r.run_id, r.rank, r.incarnation, r.seq, r.step))
        rule_engine.observe(r, rank, previous_mode, now, into=into)
        accepted += 1
    store.put_hwm(hwm_rows)
    store.put_counters([(*k, v) for k, v in counter_rows.items()])
    store.touch({r.run_id for r in batch.reports}, now)
    return Ingested(accepted, dupes)
