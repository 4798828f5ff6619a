"""Weight syncs as people run them (#36), against a real ``nanwatch serve`` on loopback, with the README's two
lines unchanged: an fp32 trainer's ``mon.publish_weights(v)`` and a bf16 rollout copy's
``post_weights(url, run_id, v, nanwatch.fingerprint(copy))``. A right sync verifies, a stopped one mismatches,
an fp8 copy with no fp8 cast published is "dtype differs" (counted apart, never a failed sync); a rollout
worker cannot post ``side=trainer`` (the attack of #36); a worker that stops posting lags within five
publishes (gauge and event), and a worker lagging past eight publishes is still compared."""

from __future__ import annotations

import copy
import time

import pytest
import torch
from support import CollectorProcess, post_reports, run_view, sample, scrape, step_report, tiny_qwen3

import nanwatch
from nanwatch.cli.status_view import render_detail
from nanwatch.monitor.data.weight_syncs import WeightSyncs
from nanwatch.monitor.data.weight_verdicts import compare, side_set
from nanwatch.weight_sync import WeightSyncRefused, post_weights
from nanwatch.wire import WeightFingerprints

pytestmark = pytest.mark.slow

VERIFIED, MISMATCHES = "nanwatch_weight_syncs_verified_total", "nanwatch_weight_sync_mismatches_total"
UNVERIFIABLE, LAG = "nanwatch_weight_syncs_unverifiable_total", "nanwatch_weight_sync_lag_versions"


def _train_one_step(mon, model, opt, n: int) -> None:
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(n))
    with mon.step(n):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()


def _events(url: str, run_id: str, kind: str) -> list[dict]:
    return [e for e in run_view(url, run_id)["events"] if e["kind"] == kind]


def test_a_bf16_copy_verifies_a_stopped_one_mismatches_and_fp8_is_dtype_differs(collector):
    run_id, url, tok = "weights-bf16", collector.url, collector.token
    trainer = tiny_qwen3(seed=0)
    # the engines' copies, made before attach (an attached model's hooks hold locks: deepcopy refuses it)
    rollout, fp8 = copy.deepcopy(trainer).to(torch.bfloat16), copy.deepcopy(trainer).to(torch.float8_e4m3fn)
    opt = torch.optim.SGD(trainer.parameters(), lr=0.1)
    with nanwatch.attach(trainer, run_id=run_id, collector=url, token=tok, optimizer=opt) as mon:
        _train_one_step(mon, trainer, opt, 0)
        assert mon.last_report() is not None
        rollout.load_state_dict(trainer.state_dict())  # the weight sync of version 1, as a loader casts
        mon.publish_weights(1)
        (ok,) = post_weights(url, run_id, 1, nanwatch.fingerprint(rollout), worker="vllm-0", token=tok)["compared"]
        assert ok["verified"] and ok["outcome"] == "verified", ok
        # the trainer steps and publishes version 2; the rollout copy is not reloaded (a stopped sync)
        _train_one_step(mon, trainer, opt, 1)
        mon.publish_weights(2)
        (stale,) = post_weights(url, run_id, 2, nanwatch.fingerprint(rollout), worker="vllm-0", token=tok)["compared"]
        assert stale["outcome"] == "mismatch" and stale["differing_count"] > 5 and not stale["dtype_differs"]
        # an fp8 copy of the right weights, with no fp8 cast published: named, not a failed sync
        fp8.load_state_dict(trainer.state_dict())
        (odd,) = post_weights(url, run_id, 2, nanwatch.fingerprint(fp8), worker="fp8-0", token=tok)["compared"]
        assert odd["outcome"] == "unverifiable" and odd["differing_count"] == 0, odd
        assert odd["dtype_differs_count"] == len(trainer.state_dict())
        assert odd["dtype_differs"][0].endswith(": trainer float32, rollout float8_e4m3fn")
        # the same fp8 copy verifies once the trainer publishes an fp8 cast too
        mon.publish_weights(3, dtypes=("bfloat16", "float8_e4m3fn"))
        (fp8_ok,) = post_weights(url, run_id, 3, nanwatch.fingerprint(fp8), worker="fp8-0", token=tok)["compared"]
        assert fp8_ok["outcome"] == "verified", fp8_ok
        m = scrape(url)
        assert sample(m, VERIFIED, run_id=run_id) == 2
        assert sample(m, MISMATCHES, run_id=run_id) == 1 and sample(m, UNVERIFIABLE, run_id=run_id) == 1
        (unverifiable,) = _events(url, run_id, "weight_sync_unverifiable")
        assert unverifiable["detail"]["worker"] == "fp8-0" and unverifiable["detail"]["version"] == 2
        assert [e["detail"]["version"] for e in _events(url, run_id, "weight_sync_mismatch")] == [2]
        lines = "\n".join(render_detail(run_view(url, run_id)))
        assert "weight sync: latest published v3; 2 rollout workers" in lines, lines
        assert "worker vllm-0: mismatch, posted v2, verified v1" in lines, lines


def test_a_rollout_worker_cannot_post_the_trainer_side(collector):
    """#36's attack: a rollout-side token holder posts ``side=trainer`` first with the stale worker's weights,
    so that the stale worker verifies and the real trainer's set is refused. Now: without the run's
    incarnation it is a 403; with a made-up one it never binds; the real trainer's set is taken and the
    stale worker is a mismatch."""
    run_id, url, tok = "weights-attack", collector.url, collector.token
    post_reports(url, step_report(run_id=run_id, incarnation="trainer-inc"))  # the run's trainer reports
    fresh, stale = nanwatch.fingerprint(tiny_qwen3(seed=0)), nanwatch.fingerprint(tiny_qwen3(seed=1))
    with pytest.raises(WeightSyncRefused) as refused:
        post_weights(url, run_id, 5, stale, side="trainer", token=tok)
    assert refused.value.status == 403 and "incarnation" in str(refused.value)
    forged = post_weights(url, run_id, 5, stale, side="trainer", token=tok, incarnation="made-up")
    assert forged["bound"] is False and forged["compared"] == []
    assert post_weights(url, run_id, 5, stale, worker="stale-0", token=tok)["compared"] == []  # nothing to verify
    real = post_weights(url, run_id, 5, fresh, side="trainer", token=tok, incarnation="trainer-inc")
    assert real["bound"] is True
    (verdict,) = real["compared"]
    assert verdict["worker"] == "stale-0" and verdict["outcome"] == "mismatch"
    m = scrape(url)
    assert sample(m, VERIFIED, run_id=run_id) == 0 and sample(m, MISMATCHES, run_id=run_id) == 1


def test_a_trainer_set_posted_before_its_first_report_is_compared_once_the_report_arrives(collector):
    run_id, url, tok = "weights-early", collector.url, collector.token
    fps = nanwatch.fingerprint(tiny_qwen3(seed=0))
    assert post_weights(url, run_id, 0, fps, side="trainer", token=tok, incarnation="inc-early")["bound"] is False
    assert post_weights(url, run_id, 0, fps, worker="w", token=tok)["compared"] == []
    post_reports(url, step_report(run_id=run_id, incarnation="inc-early"))
    (verdict,) = post_weights(url, run_id, 0, fps, worker="w", token=tok)["compared"]  # the resend is answered
    assert verdict["verified"]
    assert sample(scrape(url), VERIFIED, run_id=run_id) == 1  # counted once


def _fps(version: int) -> dict[str, str]:
    return {"w": f"{version:032x}", "b": f"{version + (1 << 100):032x}"}


def test_a_worker_that_stops_posting_lags_within_five_publishes_and_a_lagging_worker_is_still_compared(tmp_path):
    run_id = "weights-lag"
    with CollectorProcess(db_path=tmp_path / "c.db", env={"NANWATCH_WEIGHT_SYNC_WAIT_S": "600"}) as c:
        url = c.url
        post_reports(url, step_report(run_id=run_id, incarnation="inc0"))
        lags = []
        for v in range(12):
            post_reports(url, step_report(run_id=run_id, incarnation="inc0", seq=v + 1))  # the run stays live
            post_weights(url, run_id, v, _fps(v), side="trainer", incarnation="inc0")
            post_weights(url, run_id, v, _fps(v), worker="keeps-up")
            if v < 7:
                post_weights(url, run_id, v, _fps(v), worker="stops")  # not reloaded and silent from 7 on
            m = scrape(url)
            lags.append((sample(m, LAG, run_id=run_id, worker="stops"), sample(m, LAG, run_id=run_id, worker="keeps-up")))
        # 7 published: one behind, within the wait (not yet lag); 8: two behind
        assert lags[6] == (0, 0) and lags[7] == (0, 0) and lags[8] == (2, 0) and lags[11] == (5, 0), lags
        (event,) = _events(url, run_id, "weight_sync_lag")
        assert event["detail"]["worker"] == "stops" and event["detail"]["latest_verified"] == 6
        assert event["detail"]["behind"] == 2 and event["detail"]["latest_published"] == 8
        # the worker comes back with version 8, posted eight publishes late: still compared (and verified)
        (late,) = post_weights(url, run_id, 8, _fps(8), worker="stops")["compared"]
        assert late["verified"]
        assert sample(scrape(url), LAG, run_id=run_id, worker="stops") == 3  # 9, 10 and 11 still to come
        view = run_view(url, run_id)["weight_sync"]
        assert view["latest_published"] == 11
        assert view["workers"]["stops"] == {"latest_posted": 8, "latest_verified": 8, "outcome": "verified", "lag": 3}


def test_one_version_unposted_past_the_wait_lags_without_another_request(tmp_path):
    run_id = "weights-wait"
    with CollectorProcess(db_path=tmp_path / "c.db", env={"NANWATCH_WEIGHT_SYNC_WAIT_S": "0.5"}) as c:
        url = c.url
        post_reports(url, step_report(run_id=run_id, incarnation="inc0"))
        post_weights(url, run_id, 0, _fps(0), side="trainer", incarnation="inc0")
        post_weights(url, run_id, 0, _fps(0), worker="w")
        post_weights(url, run_id, 1, _fps(1), side="trainer", incarnation="inc0")
        assert sample(scrape(url), LAG, run_id=run_id, worker="w") == 0
        deadline = time.monotonic() + 10
        while not _events(url, run_id, "weight_sync_lag") and time.monotonic() < deadline:
            time.sleep(0.2)
        (event,) = _events(url, run_id, "weight_sync_lag")
        assert event["detail"]["behind"] == 1
        post_reports(url, step_report(run_id=run_id, incarnation="inc0", seq=1))
        assert sample(scrape(url), LAG, run_id=run_id, worker="w") == 1


def _publish_twelve(syncs: WeightSyncs) -> list:
    """Twelve versions; "fast" compares each, "slow" only version 0. Returns what expired."""
    kept = {v: side_set(WeightFingerprints(side="trainer", fingerprints=_fps(v), incarnation="i")) for v in range(12)}
    expired = []
    for v in range(12):
        syncs.trainer("r", v, "i", kept[v], float(v))
        syncs.bind("r", {"i"}, float(v))
        for worker in ("fast", "slow") if v == 0 else ("fast",):
            syncs.rollout("r", v, worker, kept[v], float(v))
        expired += syncs.expire("r", float(v))
    return expired


def test_versions_are_kept_until_compared_and_expired_ones_are_named_once():
    syncs = WeightSyncs()
    assert _publish_twelve(syncs) == []
    kept = side_set(WeightFingerprints(side="rollout", fingerprints=_fps(2)))
    verdict, new = syncs.rollout("r", 2, "slow", kept, 12.0)  # ten publishes late (8 were kept before #36)
    assert new and verdict.verified
    assert syncs.lag("r", 12.0) == {"fast": 0, "slow": 9}
    # beyond max_versions, versions every worker is done with go first, then the oldest "slow" never compared
    # with: said once (until it posts again), naming it
    small = WeightSyncs(max_versions=4)
    expired = _publish_twelve(small)
    assert [(e.version, e.workers, e.published) for e in expired] == [(1, ("slow",), True)]
    assert list(small.runs["r"].versions) == [8, 9, 10, 11]


def test_dtype_and_shape_differences_are_named_not_counted_as_failed_syncs():
    t = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
    fps = nanwatch.fingerprint({"a": t, "b": t.clone()})
    trainer = side_set(WeightFingerprints(side="trainer", fingerprints=fps, dtypes=fps.dtypes, shapes=fps.shapes,
                                          incarnation="i"))
    odd = nanwatch.fingerprint({"a": t.reshape(6, 4), "b": t.to(torch.float16)})
    v = compare("w", trainer, side_set(WeightFingerprints(side="rollout", fingerprints=odd, dtypes=odd.dtypes,
                                                          shapes=odd.shapes)))
    assert v.outcome == "unverifiable" and v.differing_count == 0
    assert v.shape_differs == ("a: trainer [4, 6], rollout [6, 4]",)
    assert v.dtype_differs == ("b: trainer float32, rollout float16",)
    # a client that sends no dtypes (a plain dict): other bits are a mismatch, as before
    plain = compare("w", trainer, side_set(WeightFingerprints(side="rollout", fingerprints=dict(odd))))
    assert plain.outcome == "mismatch" and plain.differing_count == 2


def test_a_trainer_whose_rank_view_expired_still_binds_and_the_reporting_incarnation_wins():
    syncs = WeightSyncs()
    kept = {v: side_set(WeightFingerprints(side="trainer", fingerprints=_fps(v), incarnation="a")) for v in range(3)}
    syncs.trainer("r", 0, "a", kept[0], 0.0)
    assert syncs.bind("r", set(), 0.0) == [] and syncs.summary("r")["latest_published"] is None  # never reported
    syncs.bind("r", {"a"}, 0.0)
    syncs.trainer("r", 1, "a", kept[1], 1.0)  # a long rollout phase: rank 0's view expired meanwhile
    syncs.bind("r", set(), 1.0)
    assert syncs.summary("r")["latest_published"] == 1
    # a restart: the new incarnation's set is the one taken, not a set posted under the old one
    syncs.trainer("r", 2, "a", kept[1], 2.0)
    syncs.trainer("r", 2, "b", kept[2], 2.0)
    syncs.bind("r", {"b"}, 2.0)
    assert syncs.runs["r"].versions[2].trainer is kept[2]
