"""Weight syncs kept in the store (#40): a run's versions, sets, verdicts and workers as rows
(``nanwatch.monitor.data.weight_rows``), written as a write changes them and read back whole, so that a
collector restarted on its SQLite file still compares a version published before the restart, and answers a
resend as it did; a run re-read from the store keeps its weight-lag view (``lifetimes._VIEWS``), and a run the
store no longer holds loses it with the rest."""

from __future__ import annotations

import httpx
import pytest
from support import AUTH, CollectorProcess, post_reports, sample, scrape, step_report

from nanwatch.monitor.data.state import CollectorState
from nanwatch.monitor.data.store import Loaded
from nanwatch.monitor.data.weight_rows import changes, decode
from nanwatch.monitor.data.weight_syncs import WeightSyncs
from nanwatch.monitor.data.weight_verdicts import side_set
from nanwatch.monitor.write.lifetimes import ensure_run, reload
from nanwatch.weight_sync import post_weights
from nanwatch.wire import WeightFingerprints

A, B, C = "0123456789abcdef" * 2, "fedcba9876543210" * 2, "00112233445566778899aabbccddeeff"
TRAINER = {"model.embed.weight": A, "model.head.weight": B}
STALE = {"model.embed.weight": A, "model.head.weight": C}
VERIFIED, MISMATCHES = "nanwatch_weight_syncs_verified_total", "nanwatch_weight_sync_mismatches_total"


def _kept(fps: dict[str, str], **kw):
    return side_set(WeightFingerprints(side="rollout", fingerprints=fps, **kw))


def _rows(syncs: WeightSyncs, run_id: str, before=None) -> list[tuple[str, str, str]]:
    puts, gone = changes(run_id, before, syncs.runs.get(run_id))
    assert gone == []
    return [(kind, key, body) for _, kind, key, body in puts]


def test_a_runs_syncs_read_back_from_their_rows_answer_as_before():
    syncs = WeightSyncs()
    casts = {"bfloat16": {"model.head.weight": C}}
    syncs.trainer("r", 1, "inc0", _kept(TRAINER, casts=casts), 10.0)
    syncs.bind("r", {"inc0"}, 11.0)
    syncs.rollout("r", 1, "good", _kept(TRAINER), 12.0)
    syncs.rollout("r", 1, "bf16", _kept(STALE, dtypes={"model.head.weight": "bfloat16"}), 12.5)
    syncs.rollout("r", 1, "stale", _kept({"model.embed.weight": B}), 13.0)
    syncs.rollout("r", 2, "early", _kept(TRAINER), 14.0)  # waits for the trainer's set of version 2
    syncs.trainer("r", 2, "other-inc", _kept(TRAINER), 15.0)  # a candidate: not the run's incarnation
    back = WeightSyncs()
    back.replace({"r": decode(_rows(syncs, "r"))})
    assert back.summary("r") == syncs.summary("r")
    assert back.lag("r", 500.0) == syncs.lag("r", 500.0) != {}
    mine, theirs = syncs.runs["r"], back.runs["r"]
    assert list(theirs.versions) == [1, 2] and theirs.published == mine.published and theirs.trainer == "inc0"
    assert theirs.versions[1].verdicts == mine.versions[1].verdicts  # digests and verdicts, exactly
    assert theirs.versions[1].trainer == mine.versions[1].trainer  # casts included
    assert theirs.versions[2].waiting == mine.versions[2].waiting
    assert theirs.versions[2].candidates == mine.versions[2].candidates
    # and it goes on as the original does: a resend is answered, not counted; the waiting worker is compared
    assert back.rollout("r", 1, "stale", _kept({"model.embed.weight": B}), 16.0)[1] is False
    assert back.trainer("r", 2, "inc0", _kept(TRAINER), 17.0) is None
    assert [(v, x.worker, x.verified) for v, x in back.bind("r", {"inc0"}, 17.0)] == [(2, "early", True)]


def test_a_write_changes_only_the_rows_it_touched():
    syncs = WeightSyncs()
    syncs.trainer("r", 1, "inc0", _kept(TRAINER), 10.0)
    syncs.bind("r", {"inc0"}, 11.0)
    before = syncs.save("r")
    syncs.rollout("r", 1, "w", _kept(STALE), 12.0)
    assert sorted((kind, key) for kind, key, _ in _rows(syncs, "r", before)) == [("verdict", "1:w"), ("worker", "w")]
    before = syncs.save("r")
    syncs.runs["r"].versions.pop(1)  # dropped (expiry): its rows go, the set's too
    puts, gone = changes("r", before, syncs.runs["r"])
    assert puts == [] and sorted(k for _, _, k in gone) == ["1", "1:trainer:", "1:w"]


def test_a_reread_run_keeps_its_weight_lag_and_a_forgotten_one_loses_it():
    """``reload(keep_views=True)`` (another replica wrote the run) keeps what this collector decided from its
    memory, the weight lag included; a run the store no longer holds (forgotten) is gone, lag and all."""
    state = CollectorState(ttl_s=60.0, series_cap=100)
    for run_id in ("kept", "gone"):
        ensure_run(state, run_id).weight_lag = {"w": 3}
    loaded = Loaded({}, {}, [], {}, {}, {}, {}, {"kept": 0.0})
    reload(state, loaded, touched={"kept", "gone"}, keep_views=True)
    assert state.runs["kept"].weight_lag == {"w": 3} and "gone" not in state.runs


def _weights(url: str, run_id: str) -> dict:
    resp = httpx.get(f"{url}/v1/runs/{run_id}/weights", headers=AUTH)
    assert resp.status_code == 200, resp.text
    return resp.json()


@pytest.mark.slow
def test_a_restarted_collector_still_compares_a_version_published_before_it(tmp_path):
    db, run_id = tmp_path / "w.db", "durable"
    with CollectorProcess(db_path=db) as c:
        post_reports(c.url, step_report(run_id=run_id))  # rank 0 of incarnation inc0: the trainer's sets bind
        assert post_weights(c.url, run_id, 1, TRAINER, side="trainer", incarnation="inc0")["compared"] == []
        assert post_weights(c.url, run_id, 1, TRAINER, worker="good")["compared"][0]["verified"]
        assert not post_weights(c.url, run_id, 1, STALE, worker="stale")["compared"][0]["verified"]
        assert post_weights(c.url, run_id, 2, TRAINER, worker="early")["compared"] == []  # waits for version 2
        before = _weights(c.url, run_id)
    with CollectorProcess(db_path=db) as c:  # the same file, a new process
        assert _weights(c.url, run_id) == before
        assert before["latest_published"] == 1 and before["workers"]["stale"]["outcome"] == "mismatch"
        # version 1's trainer set came back: a new worker is compared at once, a resend answered, not counted
        assert post_weights(c.url, run_id, 1, TRAINER, worker="late")["compared"][0]["verified"]
        again = post_weights(c.url, run_id, 1, STALE, worker="stale")["compared"]
        assert [v["outcome"] for v in again] == ["mismatch"]
        # the rollout set that waited for version 2 is compared when the trainer publishes it
        post_reports(c.url, step_report(run_id=run_id, seq=1))
        answer = post_weights(c.url, run_id, 2, TRAINER, side="trainer", incarnation="inc0")
        assert [(v["worker"], v["verified"]) for v in answer["compared"]] == [("early", True)]
        m = scrape(c.url)
        assert sample(m, VERIFIED, run_id=run_id) == 3 and sample(m, MISMATCHES, run_id=run_id) == 1
