"""A side's weight fingerprints of one weight version, applied through the ledger's transaction: a trainer set
bound to the run's incarnation, compared with the other side's (``nanwatch.monitor.data.weight_syncs``),
each new verdict counted (``nanwatch_weight_syncs_verified_total``, ``nanwatch_weight_sync_mismatches_total``,
``nanwatch_weight_syncs_unverifiable_total``) and a mismatch logged as a ``weight_sync_mismatch`` event naming
the version, the worker and the first differing tensors (``weight_sync_unverifiable`` for dtypes or shapes no
cast explains); then each worker's lag (``RunState.weight_lag``, a ``weight_sync_lag`` event at its onset)
and the versions dropped before a worker compared with them (``weight_sync_expired``). The sweeper runs the
same lag and expiry pass (``sweep_weights``): a worker that stops posting lags after ``wait_s`` with no
request. All or nothing, like every write: the versions' changed rows are written in the same transaction
(``nanwatch.monitor.data.weight_rows``), and a failed write leaves the counters, the events and the versions as
the store holds them (the ledger re-reads the run; the client's resend is applied once).
"""

from __future__ import annotations

import time
from typing import Any

from nanwatch.monitor.data.metric_table import (
    WEIGHT_SYNC_MISMATCHES,
    WEIGHT_SYNCS_UNVERIFIABLE,
    WEIGHT_SYNCS_VERIFIED,
    MetricSpec,
)
from nanwatch.monitor.data.refusal import CapReached
from nanwatch.monitor.data.state import RunState
from nanwatch.monitor.data.store import EventRow
from nanwatch.monitor.data.weight_rows import changes
from nanwatch.monitor.data.weight_syncs import RunSyncs
from nanwatch.monitor.data.weight_verdicts import SideSet, Verdict, side_set
from nanwatch.monitor.write.counting import admit
from nanwatch.monitor.write.ledger import Ledger
from nanwatch.monitor.write.lifetimes import ensure_run
from nanwatch.wire import WeightFingerprints

__all__ = ["apply_weights", "sweep_weights"]


def _count(ledger: Ledger, run: RunState, fam: MetricSpec, n: int) -> None:
    """Add ``n`` to the run's (label-less) counter ``fam``, born at 0 (inside the transaction)."""
    key = (fam.key, ())
    old = run.counters.get(key)
    if old is None:
        if not admit(run, (fam.key,), 1, ledger.state.series_cap):
            return
        run.newborn.add(key)  # the next render shows 0, then the value: increase() sees the first one
    run.counters[key] = value = (old or 0) + n
    ledger.store.put_counters([(run.run_id, fam.key, (), value)])


_COUNTED = {"verified": WEIGHT_SYNCS_VERIFIED, "mismatch": WEIGHT_SYNC_MISMATCHES,
            "unverifiable": WEIGHT_SYNCS_UNVERIFIABLE}


def _incarnations(run: RunState) -> set[str]:
    """The incarnations a trainer set binds to: of rank 0 and of the rank that posts the job reports."""
    views = (run.ranks.get(0), run.job, run.ended_views.get(0))
    return {st.incarnation for st in views if st is not None}


def _verdicts(ledger: Ledger, run: RunState, now: float, found: list[tuple[int, Verdict]]) -> None:
    for version, v in found:
        fam = _COUNTED[v.outcome]
        _count(ledger, run, fam, 1)
        if v.outcome != "verified":
            n = run.counters.get((fam.key, ()), 0)
            ledger.record_event(EventRow(run.run_id, now, f"weight_sync_{v.outcome}", f"weight_sync:{version}:{n}"
                                         if v.outcome == "mismatch" else f"weight_sync_{v.outcome}:{version}:{n}",
                                         detail=v.detail(version)))


def _after(ledger: Ledger, run: RunState, now: float) -> None:
    """Expiry and lag, inside the transaction: the events, and the lag the exporter shows."""
    syncs = ledger.weight_syncs
    for gone in syncs.expire(run.run_id, now):
        ledger.record_event(EventRow(run.run_id, now, "weight_sync_expired", f"weight_sync_expired:{gone.version}",
                                     detail={"version": gone.version, "workers": list(gone.workers[:50]),
                                             "workers_count": len(gone.workers), "published": gone.published}))
    lag, workers = syncs.lag(run.run_id, now), syncs.workers(run.run_id)
    published = syncs.summary(run.run_id) or {}
    for name, n in lag.items():
        w = workers[name]
        if n and not w.lagging:
            w.lagging = True
            ledger.record_event(EventRow(run.run_id, now, "weight_sync_lag", f"weight_sync_lag:{name}:{now:.6f}", detail={
                "worker": name, "behind": n, "latest_published": published.get("latest_published"),
                "latest_posted": w.latest_posted, "latest_verified": w.latest_verified,
                "wait_s": syncs.wait_s}))
        elif not n:
            w.lagging = False
    run.weight_lag = lag


def _persist(ledger: Ledger, run_id: str, before: RunSyncs | None) -> bool:
    """Write what the transaction changed of the run's weight syncs (``weight_rows.changes`` against
    ``before``, its copy from the transaction's start); True if anything was."""
    puts, gone = changes(run_id, before, ledger.weight_syncs.runs.get(run_id))
    ledger.store.put_weights(puts)
    ledger.store.delete_weights(gone)
    return bool(puts or gone)


def sweep_weights(ledger: Ledger, now: float) -> None:
    """The sweeper's pass over every run with weight versions: expiry and lag with no request (one
    transaction per run that changed; one that changed what the store holds bumps the run's revision, so
    that two replicas' sweeps never both log a worker's lag: the second re-reads and finds it logged)."""
    for run_id in list(ledger.weight_syncs.runs):
        run = ledger.state.runs.get(run_id)
        if run is None:
            continue
        if ledger.weight_syncs.lag(run_id, now) == run.weight_lag and not ledger.weight_syncs.due(run_id, now):
            continue  # nothing to say

        def write(run_id: str = run_id) -> None:
            run = ledger.state.runs.get(run_id)  # (a second try finds the run re-read: another object)
            if run is None:
                return
            before = ledger.weight_syncs.save(run_id)
            _after(ledger, run, now)
            if _persist(ledger, run_id, before):
                ledger.store.touch({run_id}, now)

        try:
            ledger.atomically({run_id}, set(), write)
        except Exception:  # the store refused (memory was re-read from it): the next sweep tries again
            pass


def _check(ledger: Ledger, run_id: str, version: int, body: WeightFingerprints, kept: SideSet) -> None:
    """Whether the run may take the set: ``Refused`` (409: a second, different trainer set of a version) or
    ``CapReached`` (429: a version's waiting sets, the namespace's sets), each refusal counted (#37)."""
    syncs = ledger.weight_syncs
    try:
        syncs.check(run_id, version, body.side, body.worker, body.incarnation, kept)
    except CapReached:
        ledger.state.caps_hit["weight_sync"] += 1  # every refusal is counted (#37)
        raise
    full = syncs.check_namespace(run_id, version, kept, ledger.namespace_of)
    if full is not None:  # one team's sets never fill the memory every team shares (#37 finding 3)
        ledger.state.caps_hit[full] += 1
        raise CapReached(f"the namespace {ledger.namespace_of(run_id)!r} holds as many weight-sync sets as it may "
                         f"({syncs.max_bytes_per_namespace >> 20} MiB, {syncs.max_versions_per_namespace} versions: "
                         "NANWATCH_MAX_WEIGHT_MIB_PER_NAMESPACE, NANWATCH_MAX_WEIGHT_VERSIONS_PER_NAMESPACE): "
                         "versions leave once compared or after NANWATCH_WEIGHT_SYNC_EXPIRE_S", reason="weight_sync")


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
    syncs, kept = ledger.weight_syncs, side_set(body)
    _check(ledger, run_id, version, body, kept)  # before the transaction: a refusal costs no store read
    tries = 0

    def write() -> list[Any]:
        nonlocal tries
        if tries:  # a replica's retry, on the run as re-read from the database: checked again
            _check(ledger, run_id, version, body, kept)
        tries += 1
        now = time.time()
        before = syncs.save(run_id)  # at each try: a second one starts from the run as re-read
        run = ensure_run(ledger.state, run_id)
        run.touched = time.monotonic()
        for fam in _COUNTED.values():  # the series exist from the first set on
            if (fam.key, ()) not in run.counters:
                _count(ledger, run, fam, 0)
        bound = syncs.bind(run_id, _incarnations(run), now)  # a trainer set that waited for its report
        if body.side == "trainer":
            syncs.trainer(run_id, version, body.incarnation, kept, now)
            bound += syncs.bind(run_id, _incarnations(run), now)
            answer, counted = [v for ver, v in bound if ver == version], bound
        else:
            verdict, new = syncs.rollout(run_id, version, body.worker, kept, now)
            answer = [verdict] if verdict is not None else []
            counted = bound + ([(version, verdict)] if new else [])
        _verdicts(ledger, run, now, counted)
        _after(ledger, run, now)
        _persist(ledger, run_id, before)
        ledger.store.touch({run_id}, now)
        return answer

    verdicts = ledger.atomically({run_id}, set(), write)  # a failed write re-reads the run's syncs from the store
    bound = syncs.runs[run_id].versions.get(version)
    return {"version": version, "side": body.side, "worker": body.worker,
            "bound": body.side != "trainer" or bound is None or bound.trainer is not None,
            "compared": [v.answer() for v in verdicts]}
