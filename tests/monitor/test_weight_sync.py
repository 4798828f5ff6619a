"""Every weight sync verified (#28.5), against a real ``nanwatch serve`` on loopback: the trainer publishes
a version's weight fingerprints from a tiny Qwen3, a rollout copy posts its own with the stdlib client;
equal sets are verified, a copy that missed an update is a mismatch (counter, event naming the version and
the first differing tensor); bad bodies get a 4xx, a token outside its namespace a 403."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from support import (
    AUTH,
    JSON,
    CollectorProcess,
    post_reports,
    run_view,
    sample,
    scrape,
    step_report,
    tiny_qwen3,
)

import nanwatch
from nanwatch.monitor.data.refusal import CapReached
from nanwatch.monitor.data.weight_syncs import WeightSyncs
from nanwatch.weight_sync import WeightSyncRefused, post_weights, weights_path
from nanwatch.wire import MAX_INT

pytestmark = pytest.mark.slow

VERIFIED, MISMATCHES = "nanwatch_weight_syncs_verified_total", "nanwatch_weight_sync_mismatches_total"


def _train_one_step(mon, model, opt, n: int) -> None:
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(n))
    with mon.step(n):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()


def test_a_synced_rollout_copy_is_verified_and_a_stale_one_is_named(collector):
    run_id, url = "weights-e2e", collector.url
    trainer, rollout = tiny_qwen3(seed=0), tiny_qwen3(seed=1)  # the rollout engine's own copy
    opt = torch.optim.SGD(trainer.parameters(), lr=0.1)
    with nanwatch.attach(trainer, run_id=run_id, collector=url, token=collector.token, optimizer=opt) as mon:
        _train_one_step(mon, trainer, opt, 0)
        assert mon.last_report() is not None  # the run is live: its series are exported
        rollout.load_state_dict(trainer.state_dict())  # the weight sync of version 3
        published = mon.publish_weights(3)
        answer = post_weights(url, run_id, 3, nanwatch.fingerprint(rollout), worker="vllm-0", token=collector.token)
        assert answer["compared"] == [{"worker": "vllm-0", "verified": True, "outcome": "verified", "differing": [],
                                       "differing_count": 0, "missing": [], "missing_count": 0, "extra": [],
                                       "extra_count": 0, "dtype_differs": [], "dtype_differs_count": 0,
                                       "shape_differs": [], "shape_differs_count": 0}]
        m = scrape(url)
        assert sample(m, VERIFIED, run_id=run_id) == 1 and sample(m, MISMATCHES, run_id=run_id) == 0
        # the trainer steps and publishes version 4; the rollout copy misses the update
        _train_one_step(mon, trainer, opt, 1)
        fresh = mon.publish_weights(4)
        assert fresh != published
        stale = post_weights(url, run_id, 4, nanwatch.fingerprint(rollout), worker="vllm-0", token=collector.token)
        (verdict,) = stale["compared"]
        changed = sorted(n for n in fresh if fresh[n] != published[n])
        assert not verdict["verified"] and verdict["differing_count"] == len(changed) > 5
        assert verdict["differing"] == changed[:5] and verdict["missing_count"] == verdict["extra_count"] == 0
        m = scrape(url)
        assert sample(m, VERIFIED, run_id=run_id) == 1 and sample(m, MISMATCHES, run_id=run_id) == 1
        (event,) = [e for e in run_view(url, run_id)["events"] if e["kind"] == "weight_sync_mismatch"]
        assert event["detail"]["version"] == 4 and event["detail"]["worker"] == "vllm-0"
        assert event["detail"]["differing"][0] == changed[0]
        # a resend of the same set is answered again, not counted again
        assert post_weights(url, run_id, 4, nanwatch.fingerprint(rollout), worker="vllm-0",
                            token=collector.token)["compared"] == [verdict]
        assert sample(scrape(url), MISMATCHES, run_id=run_id) == 1


def test_whichever_side_arrives_second_compares_and_names_missing_tensors(collector):
    run_id, url, tok = "weights-order", collector.url, collector.token
    post_reports(url, step_report(run_id=run_id))  # a live run (its series are exported while it is)
    fps = nanwatch.fingerprint(tiny_qwen3())
    partial = dict(list(fps.items())[1:])
    assert post_weights(url, run_id, 7, fps, worker="a", token=tok)["compared"] == []
    assert post_weights(url, run_id, 7, partial, worker="b", token=tok)["compared"] == []
    answer = post_weights(url, run_id, 7, fps, side="trainer", token=tok, incarnation="inc0")
    by_worker = {v["worker"]: v for v in answer["compared"]}
    assert by_worker["a"]["verified"] and not by_worker["b"]["verified"]
    assert by_worker["b"]["missing"] == [next(iter(fps))] and by_worker["b"]["missing_count"] == 1
    m = scrape(url)
    assert sample(m, VERIFIED, run_id=run_id) == 1 and sample(m, MISMATCHES, run_id=run_id) == 1
    # the trainer's set of a version is written once: the same again is a resend, another one a conflict
    assert post_weights(url, run_id, 7, fps, side="trainer", token=tok, incarnation="inc0")["compared"] == []
    with pytest.raises(WeightSyncRefused) as refused:
        post_weights(url, run_id, 7, partial, side="trainer", token=tok, incarnation="inc0")
    assert refused.value.status == 409


def _put(url: str, run_id: str, version, body, headers=AUTH) -> httpx.Response:
    raw = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.put(f"{url}/v1/runs/{run_id}/weights/{version}", content=raw, headers=headers)


GOOD = "0123456789abcdef" * 2


@pytest.mark.parametrize("body,status", [
    ({"side": "rollout", "fingerprints": {"w": "XYZ"}}, 422),                      # not a fingerprint
    ({"side": "rollout", "fingerprints": {"w": GOOD.upper()}}, 422),               # upper-case hex
    ({"side": "sampler", "fingerprints": {"w": GOOD}}, 422),                       # no such side
    ({"side": "rollout", "fingerprints": {"w": GOOD}, "extra": 1}, 422),           # unknown field
    ({"side": "rollout", "worker": "a/b", "fingerprints": {"w": GOOD}}, 422),      # a worker outside the alphabet
    ({"side": "rollout", "fingerprints": {"x" * 513: GOOD}}, 422),                 # a name too long
    ({"side": "rollout", "fingerprints": {"w\u202e": GOOD}}, 422),                 # an invisible character
    ({"side": "rollout", "fingerprints": []}, 422),                                # not a mapping
    (b"{not json", 400),
])
def test_bad_bodies_are_refused(collector, body, status):
    r = _put(collector.url, "weights-bad", 1, body)
    assert r.status_code == status, r.text


def test_bad_versions_media_types_and_tokens_are_refused(collector):
    url, body = collector.url, {"side": "rollout", "fingerprints": {"w": GOOD}}
    assert _put(url, "weights-bad", -1, body).status_code == 422
    assert _put(url, "weights-bad", MAX_INT + 1, body).status_code == 422
    assert _put(url, "weights-bad", 1, body, headers={"Authorization": AUTH["Authorization"],
                                                      "Content-Type": "text/plain"}).status_code == 415
    assert _put(url, "weights-bad", 1, body, headers=JSON).status_code == 401
    assert _put(url, "weights-bad", 1, body, headers={**JSON, "Authorization": f"Bearer {collector.admin_token}"}
                ).status_code == 403
    huge = {"side": "rollout", "fingerprints": {f"layer.{i}.weight": GOOD for i in range(8000)}}
    assert _put(url, "weights-bad", 1, body=huge).status_code == 413  # the fixture's 256 KiB body limit
    assert "weights-bad" not in scrape(url).__repr__()  # nothing was applied


def test_a_token_outside_its_namespace_is_refused(tmp_path):
    tokens = {"team-a": {"token": "team-a-secret", "runs": "team-a-*"}}
    env = {"NANWATCH_TOKENS": json.dumps(tokens), "NANWATCH_ADMIN_TOKENS": json.dumps({"alice": "admin-x"})}
    with CollectorProcess(db_path=tmp_path / "c.db", env=env) as c:
        fps = {"w": GOOD}
        assert post_weights(c.url, "team-a-1", 1, fps, token="team-a-secret")["compared"] == []
        with pytest.raises(WeightSyncRefused) as refused:
            post_weights(c.url, "team-b-1", 1, fps, token="team-a-secret")
        assert refused.value.status == 403
        with pytest.raises(WeightSyncRefused) as refused:
            post_weights(c.url, "team-a-1", 1, fps, token="wrong")
        assert refused.value.status == 401


def test_the_client_refuses_a_bad_run_id_or_version_before_sending():
    with pytest.raises(ValueError):
        post_weights("http://127.0.0.1:9", "a/../b", 1, {})
    with pytest.raises(ValueError):
        post_weights("http://127.0.0.1:9", "run", True, {})
    assert weights_path("run", 2) == "/v1/runs/run/weights/2"


def _kept(fps: dict[str, str]):
    from nanwatch.monitor.data.weight_verdicts import side_set
    from nanwatch.wire import WeightFingerprints

    return side_set(WeightFingerprints(side="rollout", fingerprints=fps))


def test_versions_and_waiting_sets_are_bounded():
    syncs = WeightSyncs(max_versions=3, max_waiting=2)
    fps = _kept({"w": GOOD})
    for version in range(5):
        syncs.trainer("r", version, "inc", fps, 0.0)
        syncs.bind("r", {"inc"}, 0.0)
        syncs.expire("r", 0.0)
    assert list(syncs.runs["r"].versions) == [2, 3, 4]  # the oldest dropped (no worker waits for them)
    assert syncs.rollout("r", 0, "w0", fps, 0.0) == (None, False)  # version 0 is gone: it waits (a new version)
    syncs.rollout("r", 9, "a", fps, 0.0)
    syncs.rollout("r", 9, "b", fps, 0.0)
    syncs.check("r", 9, "rollout", "a", None, fps)  # a worker already waiting may send again
    with pytest.raises(CapReached):
        syncs.check("r", 9, "rollout", "c", None, fps)
