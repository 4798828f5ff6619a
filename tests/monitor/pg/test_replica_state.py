"""What two real ``nanwatch serve`` replicas on one PostgreSQL database share beyond reports and directives
(#40, docs/replicas.md): a weight version published through one is compared with a rollout set posted through
the other, both answer the same ``GET /v1/runs/{run_id}/weights``, the mismatch and the lag are counted and
logged once; a directive-version floor raised by forgetting a run through one holds on the other at once."""

import time

import httpx
import psycopg
import pytest
from support import JSON, CollectorProcess, scrape, step_report, wait_until

from nanwatch.weight_sync import WeightSyncRefused, post_weights
from nanwatch.wire import ReportBatch

pytestmark = pytest.mark.slow

A, B, C = "0123456789abcdef" * 2, "fedcba9876543210" * 2, "00112233445566778899aabbccddeeff"
TRAINER = {"model.embed.weight": A, "model.head.weight": B}
STALE = {"model.embed.weight": A, "model.head.weight": C}
MISMATCHES, LAG = "nanwatch_weight_sync_mismatches_total", "nanwatch_weight_sync_lag_versions"


@pytest.fixture
def replicas(pg_url, tmp_path):
    """Two replicas; a weight-sync wait of 2 s, so that each one's sweeper passes over the run's lag every
    half second (both at once: the lag must still be logged once)."""
    env = {"NANWATCH_DATABASE_URL": pg_url, "NANWATCH_DATABASE_REFRESH_S": "0.2", "NANWATCH_WEIGHT_SYNC_WAIT_S": "2"}
    with CollectorProcess(db_path=tmp_path / "a.db", env=env) as a, CollectorProcess(db_path=tmp_path / "b.db", env=env) as b:
        a.pg_url = pg_url
        yield a, b


def _retry(call):
    """``call()`` until it is not refused with a 503 (a replica that lost a race for the run twice in a
    row asks for the retry, which the trainer's and the rollout's senders make)."""
    for _ in range(200):
        try:
            return call()
        except WeightSyncRefused as e:
            if e.status != 503:
                raise
        time.sleep(0.02)
    raise AssertionError("still 503")


def _weights(url: str, run_id: str) -> dict | None:
    resp = httpx.get(f"{url}/v1/runs/{run_id}/weights")
    return resp.json() if resp.status_code == 200 else None


def _kinds(url: str, run_id: str, kind: str) -> int:
    return [e["kind"] for e in httpx.get(f"{url}/v1/runs/{run_id}").json()["events"]].count(kind)


def _series(urls, name: str, **labels) -> list[float]:
    """The sample on each replica that shows it."""
    key = (name, frozenset(labels.items()))
    return [m[key] for m in (scrape(u) for u in urls) if key in m]


def test_a_version_published_through_one_replica_is_compared_through_the_other(replicas):
    a, b = replicas
    run = "weights-shared"
    body = ReportBatch(reports=[step_report(run_id=run)]).model_dump_json()
    assert httpx.post(f"{a.url}/v1/reports", content=body, headers=JSON).status_code == 200  # rank 0 is on a
    published = _retry(lambda: post_weights(a.url, run, 1, TRAINER, side="trainer", incarnation="inc0"))
    assert published["bound"] and published["compared"] == []
    # b never received the trainer's set: it compares with it all the same, as the database holds it
    answer = _retry(lambda: post_weights(b.url, run, 1, STALE, worker="stale"))["compared"]
    assert [(v["worker"], v["outcome"], v["differing"]) for v in answer] == [("stale", "mismatch", ["model.head.weight"])]
    assert _retry(lambda: post_weights(b.url, run, 1, TRAINER, worker="good"))["compared"][0]["verified"]
    wait_until(lambda: _weights(a.url, run) == _weights(b.url, run) is not None
               and _weights(a.url, run)["workers"]["stale"]["outcome"] == "mismatch", "both replicas to agree")
    # the mismatch is counted once (one replica exports the run's total) and logged once, seen by both
    wait_until(lambda: _series((a.url, b.url), MISMATCHES, run_id=run) == [1.0], "one replica to export the 1")
    assert _kinds(a.url, run, "weight_sync_mismatch") == _kinds(b.url, run, "weight_sync_mismatch") == 1

    # two more versions through a: "good" (verified 1) is 2 behind, "stale" (never verified) 3; both replicas'
    # sweepers pass over the run every half second, and the lag is logged once per worker, exported once
    for version in (2, 3):
        _retry(lambda version=version: post_weights(a.url, run, version, TRAINER, side="trainer", incarnation="inc0"))
    wait_until(lambda: _series((a.url, b.url), LAG, run_id=run, worker="good") == [2.0]
               and _series((a.url, b.url), LAG, run_id=run, worker="stale") == [3.0], "the lag, on one replica")
    wait_until(lambda: _kinds(a.url, run, "weight_sync_lag") == _kinds(b.url, run, "weight_sync_lag") == 2,
               "both replicas to show the two lag events")
    with psycopg.connect(a.pg_url) as conn:
        rev = conn.execute("SELECT rev FROM runs WHERE run_id = %s", (run,)).fetchone()[0]
        time.sleep(3)  # six sweeps of each replica (not a timing assertion: the revision must not move at all)
        assert conn.execute("SELECT rev FROM runs WHERE run_id = %s", (run,)).fetchone()[0] == rev
    assert _kinds(a.url, run, "weight_sync_lag") == 2 and _weights(a.url, run) == _weights(b.url, run)


def _set(url: str, run_id: str, mode: str = "fp32") -> int:
    for _ in range(200):
        resp = httpx.put(f"{url}/v1/directives/{run_id}", json={"mode": mode})
        if resp.status_code != 503:
            assert resp.status_code == 200, resp.text
            return resp.json()["version"]
        time.sleep(0.02)
    raise AssertionError("still 503")


def _version(url: str, run_id: str) -> int:
    return httpx.get(f"{url}/v1/directives/{run_id}").json()["version"]


def test_a_directive_floor_raised_through_one_replica_holds_on_the_other_at_once(replicas):
    a, b = replicas
    for _ in range(5):
        _set(a.url, "old")
    wait_until(lambda: _version(b.url, "old") == 5, "b to serve version 5")
    assert httpx.delete(f"{a.url}/v1/runs/old").status_code == 204  # the floor is now 5
    # at once, before b's follower may have run: b reads the floor inside the transaction that issues
    assert _set(b.url, "fresh") == 6
    # and b drops the forgotten run's directive when it re-reads it: a poller there no longer sees version 5
    wait_until(lambda: _version(b.url, "old") == 0, "b to forget the deleted run's directive")
    assert _set(b.url, "old") == 6 and _set(a.url, "old") == 7  # above the floor, as any run
