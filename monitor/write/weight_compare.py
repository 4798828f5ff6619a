"""A side's weight fingerprints of one weight version, applied through the ledger's transaction: compared
with the other side's (``nanwatch.monitor.model.weight_syncs``), each new verdict counted
(``nanwatch_weight_syncs_verified_total`` or ``nanwatch_weight_sync_mismatches_total``) and a mismatch
logged as a ``weight_sync_mismatch`` event naming the version, the worker and the first differing tensors.
All or nothing, like every write: a failed write leaves the counters, the events and the versions as they
were (the client's resend is applied once).
"""

from __future__ import annotations

import time
from typing import Any

from nanwatch.monitor.model.counters import WEIGHT_SYNC_MISMATCHES, WEIGHT_SYNCS_VERIFIED, CounterFamily
from nanwatch.monitor.model.refusal import CapReached
from nanwatch.monitor.model.state import RunState
from nanwatch.monitor.model.store import EventRow
from nanwatch.monitor.write.ledger import Ledger
from nanwatch.wire import WeightFingerprints

__all__ = ["apply_weights"]


def _count(ledger: Ledger, run: RunState, fam: CounterFamily, n: int) -> None:
    """Add ``n`` to the run's (label-less) counter ``fam``, born at 0 (inside the transaction)."""
    key = (fam.key, ())
    old = run.counters.get(key)
    if old is None:
        if not run.admit((fam.key,), 1, ledger.state.series_cap):
            return
        run.newborn.add(key)  # the next render shows 0, then the value: increase() sees the first one
    run.counters[key] = value = (old or 0) + n
    ledger.store.put_counters([(run.run_id, fam.key, (), value)])


def apply_weights(ledger: Ledger, run_id: str, version: int, body: WeightFingerprints) -> dict[str, Any]:
    """Apply one side's set (``PUT /v1/runs/{run_id}/weights/{version}``) and return the answer: the new
    or resent verdicts. Raises ``CapReached`` (429: the run cap, the memory limit, a version's waiting
    sets), ``Refused`` (409: a second, different trainer set of a version) or ``StoreUnavailable`` (503)."""
    over = ledger.caps.over(ledger.state, set(), {run_id}, namespace_of=ledger.namespace_of)
    if over is not None:
        raise CapReached(over)
    if ledger.budget.over():
        ledger.state.caps_hit["memory"] += 1
        raise CapReached("the collector is above its memory limit (NANWATCH_MEMORY_LIMIT_MIB): no weight "
                         "fingerprints are kept until it is below", reason="memory")
    syncs = ledger.weight_syncs
    syncs.check(run_id, version, body.side, body.worker, body.fingerprints)

    def write() -> list[Any]:
        now = time.time()
        run = ledger.state.ensure_run(run_id)
        run.touched = time.monotonic()
        for fam in (WEIGHT_SYNCS_VERIFIED, WEIGHT_SYNC_MISMATCHES):  # both series exist from the first set on
            if (fam.key, ()) not in run.counters:
                _count(ledger, run, fam, 0)
        if body.side == "trainer":
            verdicts = counted = syncs.trainer(run_id, version, body.fingerprints)
        else:
            verdict, new = syncs.rollout(run_id, version, body.worker, body.fingerprints)
            verdicts = [verdict] if verdict is not None else []
            counted = verdicts if new else []
        for v in counted:
            _count(ledger, run, WEIGHT_SYNCS_VERIFIED if v.verified else WEIGHT_SYNC_MISMATCHES, 1)
            if not v.verified:
                n = run.counters.get((WEIGHT_SYNC_MISMATCHES.key, ()), 0)
                ledger.record_event(EventRow(run_id, now, "weight_sync_mismatch", f"weight_sync:{version}:{n}",
                                             detail=v.detail(version)))
        ledger.store.touch({run_id}, now)
        return verdicts

    saved = syncs.save(run_id)
    try:
        verdicts = ledger.atomically({run_id}, set(), write)
    except BaseException:
        syncs.restore(run_id, saved)
        raise
    return {"version": version, "side": body.side, "worker": body.worker,
            "compared": [v.answer() for v in verdicts]}
