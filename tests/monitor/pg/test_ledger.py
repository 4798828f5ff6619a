"""The ledger over the PostgreSQL store, two of them on one database as two replicas are, without the
follower that keeps them fresh: a write from a memory the other replica has overtaken is re-read and applied
once more inside the request, so it is neither refused nor counted from the stale memory."""

import pytest
from support import step_report

from nanwatch.monitor.data.directive_log import DirectiveLog
from nanwatch.monitor.data.liveness import is_live
from nanwatch.monitor.data.long_poll import LongPoll
from nanwatch.monitor.data.refusal import Refused
from nanwatch.monitor.data.state import CollectorState
from nanwatch.monitor.pg import PgStore
from nanwatch.monitor.write.ledger import Ledger
from nanwatch.monitor.write.lifetimes import restore
from nanwatch.monitor.write.weight_compare import apply_weights
from nanwatch.wire import DirectiveSpec, ReportBatch, WeightFingerprints

SITE = "model.layers.0.self_attn"


def replica(url: str) -> Ledger:
    store = PgStore(url)
    loaded = store.load()
    state = CollectorState(ttl_s=60.0, series_cap=10_000)
    restore(state, loaded)
    return Ledger(store=store, state=state,
                  directive_log=DirectiveLog(polls=LongPoll(), current=loaded.directives,
                                             floor=loaded.directive_floor),
                  directive_rules=[], logit_tau=100.0, margin_steps=0)


def batch(*seqs: int) -> ReportBatch:
    return ReportBatch(reports=[step_report(run_id="r", rank=0, seq=s, step=s, nan_at=SITE, nan=1, dtype="float32")
                                for s in seqs])


def total(ledger: Ledger) -> int:
    return sum(v for (fam, _labels), v in ledger.state.runs["r"].counters.items() if fam == "site")


def test_a_stale_replica_rereads_and_applies_once_inside_the_request(pg_url):
    a, b = replica(pg_url), replica(pg_url)
    assert (a.ingest(batch(0, 1)).accepted, b.ingest(batch(2)).accepted) == (2, 1)  # b never saw 0 and 1
    assert total(b) == 3  # b re-read the run before applying seq 2: nothing of a's was overwritten
    done = a.ingest(batch(1, 2, 3))  # a is stale now: 1 is its own, 2 is b's, 3 is new
    assert (done.accepted, done.duplicates) == (1, 2) and total(a) == 4
    assert b.store.load({"r"}).counters == a.store.load({"r"}).counters
    # directives: one sequence across both, each ledger's next version above the other's
    assert a.set_directive("r", DirectiveSpec(mode="fp32"), actor="x").version == 1
    assert b.set_directive("r", DirectiveSpec(mode="fused"), actor="x").version == 2
    assert a.set_directive("r", DirectiveSpec(mode="none"), actor="x").version == 3
    assert b.directive_log.current("r").version == 2  # b learns of 3 through its follower (or its next write)
    b.sync.resync({"r"})
    assert b.directive_log.current("r").version == 3


def test_rereading_a_run_another_replica_wrote_keeps_this_replicas_rank_views(pg_url):
    a, b = replica(pg_url), replica(pg_url)
    one = ReportBatch(reports=[step_report(run_id="v", rank=1, seq=0, step=0, nan_at=SITE, nan=1, dtype="float32")])
    zero = ReportBatch(reports=[step_report(run_id="v", rank=0, seq=0, step=0, nan_at=SITE, nan=1, dtype="float32")])
    assert b.ingest(one).accepted == 1 and a.ingest(zero).accepted == 1
    assert set(b.state.runs["v"].ranks) == {1}
    b.sync.resync({"v"})  # as its follower does after a's commit
    run = b.state.runs["v"]
    assert set(run.ranks) == {1} and is_live(b.state, run, run.last_seen)  # still live here: rank 1's view
    assert sum(v for (fam, _), v in run.counters.items() if fam == "site") == 2  # and a's report counted


def test_a_stale_replicas_retry_checks_the_weight_set_against_the_run_as_reread(pg_url):
    """b never saw a's trainer set of version 1: its check before the transaction passes, its write finds the
    run moved, re-reads it, and must refuse a different trainer set of that version (409) on the retry, as a
    fresh replica would, rather than take it (a 200 and a second trainer set)."""

    def trainer(digest: str) -> WeightFingerprints:
        return WeightFingerprints(side="trainer", incarnation="inc0", fingerprints={"w": digest * 32})

    a, b = replica(pg_url), replica(pg_url)
    first = ReportBatch(reports=[step_report(run_id="w", rank=0, seq=0, step=0)])
    assert a.ingest(first).accepted == 1 and b.ingest(first).duplicates == 1  # both know rank 0's incarnation
    assert apply_weights(a, "w", 1, trainer("a"))["bound"]
    assert b.weight_syncs.runs.get("w") is None or 1 not in b.weight_syncs.runs["w"].versions  # b is stale
    with pytest.raises(Refused) as refused:
        apply_weights(b, "w", 1, trainer("b"))
    assert refused.value.status == 409
    assert apply_weights(b, "w", 1, trainer("a"))["bound"]  # the same set again: a resend, answered


def test_a_replica_follows_the_runs_it_serves_and_rereads_the_others_when_named(pg_url):
    """b takes none of run r's reports: another replica's writes of r are not re-read as they come (each
    would cost b a re-read of the run), but when a request names r (``catch_up``); once b is live on r, it
    follows every write at once."""
    a, b = replica(pg_url), replica(pg_url)
    assert a.ingest(batch(0)).accepted == 1
    b.sync.resync(b.store.changed_runs())
    assert "r" not in b.state.runs
    b.sync.catch_up({"r"})
    assert total(b) == 1
    assert b.ingest(batch(1)).accepted == 1  # b is live on r now
    assert a.ingest(batch(2)).accepted == 1  # (a re-read r inside the request: b wrote it)
    b.sync.resync(b.store.changed_runs())
    assert total(b) == 3 == total(a)
