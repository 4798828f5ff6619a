"""Wire 1.4 scopes against a real ``nanwatch serve``: the same steps sent as N rank reports, or as one job
report plus detail reports and heartbeats, give the same /metrics; heartbeats keep a rank live and nothing
else; a rank that falls silent in job mode is named, then counted missing; 1.3 senders still work."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from support import JSON, TOKEN, CollectorProcess, scrape, step_report

from nanwatch.bench.jobs import heartbeat, job_step
from nanwatch.wire import ReportBatch, StepReport

AUTH = {**JSON, "Authorization": f"Bearer {TOKEN}"}
WORLD, NAN_RANK, MATH_RANK, NAN_STEP = 8, 5, 3, 2
LAYER1 = "model.layers.1.self_attn"


def _post(url: str, reports: list[StepReport], *, status: int = 200) -> dict:
    r = httpx.post(f"{url}/v1/reports", content=ReportBatch(reports=reports).model_dump_json(), headers=AUTH)
    assert r.status_code == status, r.text
    return r.json()


def _step(run_id: str, step: int) -> list[StepReport]:
    """One step of an 8-rank job: rank 5 holds a NaN in layer 1 at step 2 (and the job skips that step),
    rank 3 runs the math backend."""
    return [step_report(run_id=run_id, rank=k, world_size=WORLD, seq=step, step=step, logit=10.0 + k,
                        backend="math" if k == MATH_RANK else "flash",
                        nan_at=LAYER1 if (k, step) == (NAN_RANK, NAN_STEP) else None,
                        nan=3 if (k, step) == (NAN_RANK, NAN_STEP) else 0, skipped=step == NAN_STEP)
            for k in range(WORLD)]


def _send_per_rank(url: str, run_id: str, steps: int) -> None:
    for step in range(steps):
        _post(url, _step(run_id, step))


def _send_job(url: str, run_id: str, steps: int) -> None:
    seq = {k: 0 for k in range(WORLD)}  # one sequence per (rank, incarnation), across job and detail reports
    _post(url, [heartbeat(run_id=run_id, rank=k, world_size=WORLD, seq=0, step=0) for k in range(WORLD)])
    for step in range(steps):
        job, details = job_step(_step(run_id, step))
        out = []
        for r in [job, *details]:
            out.append(r.model_copy(update={"seq": seq[r.rank]}))
            seq[r.rank] += 1
        _post(url, out)


#: families whose samples must be equal in both modes (run_id aside); zero-valued per-rank series of ranks
#: a job-mode collector does not export are not answers (every sum, max and increase() is the same)
_SAME = ("nanwatch_site_nonfinite_calls_total", "nanwatch_sdpa_calls_total", "nanwatch_attention_logit_max",
         "nanwatch_tensor_headroom_ratio", "nanwatch_first_offender_info", "nanwatch_run_nonfinite_calls_total",
         "nanwatch_nonfinite_calls_total", "nanwatch_live_ranks", "nanwatch_run_world_size",
         "nanwatch_incidents_total", "nanwatch_events_total")


def _of(samples: dict, run_id: str) -> dict:
    out = {}
    for (name, labels), value in samples.items():
        d = dict(labels)
        if d.pop("run_id", None) == run_id and name in _SAME and (value or "rank" not in d):
            out[(name, frozenset(d.items()))] = value
    return out


def _skipped(samples: dict, run_id: str) -> dict[str, float]:
    return {dict(labels)["rank"]: v for (name, labels), v in samples.items()
            if name == "nanwatch_skipped_steps_total" and dict(labels)["run_id"] == run_id}


def test_the_same_steps_per_rank_and_job_level_give_the_same_metrics(collector):
    _send_per_rank(collector.url, "eq-rank", 4)
    _send_job(collector.url, "eq-job", 4)
    s = scrape(collector.url)
    per_rank, job = _of(s, "eq-rank"), _of(s, "eq-job")
    assert per_rank == job
    # the figures the comparison is about are there, and right
    assert per_rank[("nanwatch_site_nonfinite_calls_total", frozenset({("site", LAYER1), ("pass", "forward")}))] == 3
    assert per_rank[("nanwatch_nonfinite_calls_total", frozenset(
        {("rank", str(NAN_RANK)), ("pass", "forward"), ("kind", "nan")}))] == 3
    assert per_rank[("nanwatch_first_offender_info", frozenset(
        {("site", LAYER1), ("pass", "forward"), ("stage", "train"), ("rank", str(NAN_RANK))}))] == 1
    assert per_rank[("nanwatch_sdpa_calls_total", frozenset(
        {("backend", "math"), ("dtype", "bfloat16"), ("stage", "train")}))] == 4 * 4  # 4 layers x 4 steps
    assert per_rank[("nanwatch_live_ranks", frozenset())] == WORLD == per_rank[("nanwatch_run_world_size", frozenset())]
    # skipped steps: every rank skipped step 2 (the guard's decision is collective); job mode exports the
    # ranks it has something to say about, each with the same count, so max and any rank agree
    rank_mode, job_mode = _skipped(s, "eq-rank"), _skipped(s, "eq-job")
    assert set(rank_mode.values()) == {1.0} and len(rank_mode) == WORLD
    assert set(job_mode) == {"0", str(MATH_RANK), str(NAN_RANK)} and set(job_mode.values()) == {1.0}


def test_detail_reports_add_no_run_level_count(collector):
    run = "detail-only"
    job, details = job_step(_step(run, NAN_STEP))
    _post(collector.url, [job, *details])
    _post(collector.url, [d.model_copy(update={"seq": d.seq + 1, "step": NAN_STEP + 1}) for d in details])
    s = scrape(collector.url)
    key = ("nanwatch_site_nonfinite_calls_total",
           frozenset({("run_id", run), ("site", LAYER1), ("pass", "forward")}))
    assert s[key] == 3  # the job's; the two detail reports of rank 5 (3 each) count per rank only
    assert s[("nanwatch_nonfinite_calls_total", frozenset(
        {("run_id", run), ("rank", str(NAN_RANK)), ("pass", "forward"), ("kind", "nan")}))] == 6


def test_heartbeats_keep_ranks_live_and_add_nothing_else(collector):
    run = "beats"
    beats = [heartbeat(run_id=run, rank=k, world_size=4, seq=0, step=7, mode="fp32" if k == 2 else "none",
                       dropped=5 if k == 3 else 0) for k in range(4)]
    assert _post(collector.url, beats) == {"accepted": 4, "duplicates": 0}
    assert _post(collector.url, beats[:1]) == {"accepted": 0, "duplicates": 1}  # a resent heartbeat
    s = scrape(collector.url)
    mine = {(name, frozenset(dict(labels).items())): v for (name, labels), v in s.items()
            if dict(labels).get("run_id") == run}
    by_name = {}
    for name, labels in mine:
        by_name.setdefault(name, []).append(dict(labels))
    assert mine[("nanwatch_live_ranks", frozenset({("run_id", run)}))] == 4
    assert mine[("nanwatch_run_world_size", frozenset({("run_id", run)}))] == 4
    # per rank, only what differs: rank 2's mode, rank 3's dropped reports; no counters, no timestamps
    assert [d["rank"] for d in by_name["nanwatch_attention_mode"]] == ["2"]
    assert [d["rank"] for d in by_name["nanwatch_reports_dropped_total"]] == ["3"]
    assert "nanwatch_last_report_timestamp_seconds" not in by_name
    assert "nanwatch_skipped_steps_total" not in by_name and "nanwatch_site_nonfinite_calls_total" not in by_name
    assert all(v == 0 for (name, _), v in mine.items() if name == "nanwatch_run_nonfinite_calls_total")
    ranks = httpx.get(f"{collector.url}/v1/runs/{run}", headers=AUTH).json()
    assert ranks["live_ranks"] == 4 and ranks["ranks"] == []  # none late yet


def test_a_heartbeat_with_measurements_is_refused_by_name(collector):
    body = json.loads(ReportBatch(reports=[step_report(run_id="hb-bad")]).model_dump_json())
    body["reports"][0]["scope"] = "heartbeat"
    r = httpx.post(f"{collector.url}/v1/reports", content=json.dumps(body), headers=AUTH)
    assert r.status_code == 422 and "heartbeat carries no measurements" in r.text
    assert httpx.get(f"{collector.url}/v1/runs/hb-bad", headers=AUTH).status_code == 404  # nothing kept


def test_a_1_3_report_is_a_rank_report(collector):
    body = json.loads(ReportBatch(reports=[step_report(run_id="old-13", rank=1, world_size=2, nan_at=LAYER1,
                                                       nan=2)]).model_dump_json())
    for field in ("scope", "first_offender_rank", "ranks_reporting", "nonfinite_rank"):
        body["reports"][0].pop(field)
    body["reports"][0]["v"] = "1.3"
    r = httpx.post(f"{collector.url}/v1/reports", content=json.dumps(body), headers=AUTH)
    assert r.status_code == 200 and r.json()["accepted"] == 1
    s = scrape(collector.url)
    assert s[("nanwatch_run_nonfinite_calls_total", frozenset(
        {("run_id", "old-13"), ("pass", "forward"), ("kind", "nan"), ("stage", "train")}))] == 2
    assert s[("nanwatch_nonfinite_calls_total", frozenset(
        {("run_id", "old-13"), ("rank", "1"), ("pass", "forward"), ("kind", "nan")}))] == 2
    assert s[("nanwatch_last_report_timestamp_seconds", frozenset({("run_id", "old-13"), ("rank", "1")}))] > 0


@pytest.mark.slow
def test_a_silent_rank_in_job_mode_is_named_then_counted_missing(tmp_path):
    """Documented: a heartbeat-only rank silent NANWATCH_RANK_LATE_S gets its last report time back (the
    stale-rank alert, age > 120 s, then names it); after NANWATCH_RANK_TTL_S it is no longer live, and
    nanwatch_live_ranks < nanwatch_run_world_size (the missing-ranks alert)."""
    env = {"NANWATCH_RANK_TTL_S": "3", "NANWATCH_RANK_LATE_S": "1"}
    run, world, silent = "stale-job", 4, 2
    with CollectorProcess(db_path=tmp_path / "s.db", env=env) as c:
        seq = 0

        def beat(ranks) -> None:
            _post(c.url, [heartbeat(run_id=run, rank=k, world_size=world, seq=seq, step=seq) for k in ranks])

        t0 = time.monotonic()  # before the first heartbeat: the collector hears it after t0
        beat(range(world))
        late_at = missing_at = None
        while missing_at is None and time.monotonic() - t0 < 60:  # a bound on the loop, not a speed assertion
            seq += 1
            beat([k for k in range(world) if k != silent])
            s = scrape(c.url)
            stamps = {dict(labels)["rank"] for (name, labels) in s
                      if name == "nanwatch_last_report_timestamp_seconds" and dict(labels)["run_id"] == run}
            if late_at is None and stamps:
                assert stamps == {str(silent)}  # only the silent one: the others are on time
                late_at = time.monotonic() - t0
            live = s[("nanwatch_live_ranks", frozenset({("run_id", run)}))]
            if live < world:
                assert live == world - 1 and s[("nanwatch_run_world_size", frozenset({("run_id", run)}))] == world
                missing_at = time.monotonic() - t0
            time.sleep(0.2)
        assert missing_at is not None, "the silent rank was never counted missing"
        assert late_at is not None and 1 <= late_at < missing_at and missing_at >= 3


def test_a_rank_heartbeating_slowly_is_held_for_its_own_interval(tmp_path):
    """A large job beats slowly (the trainer's default is ``world_size / 100`` s past 3,000 ranks): a rank is
    late after two of its announced intervals and gone after three, not after the collector's own
    NANWATCH_RANK_LATE_S and NANWATCH_RANK_TTL_S, which are shorter here (1 s and 2 s, against a 1.5 s
    interval: late at 3 s, missing at 4.5 s)."""
    env = {"NANWATCH_RANK_TTL_S": "2", "NANWATCH_RANK_LATE_S": "1"}
    run, world = "slow-beats", 2
    with CollectorProcess(db_path=tmp_path / "s.db", env=env) as c:
        t0, seq, seen = time.monotonic(), 0, []  # before the first heartbeat: the collector hears it after t0
        _post(c.url, [heartbeat(run_id=run, rank=k, world_size=world, seq=0, step=0, every_s=1.5) for k in range(world)])
        while time.monotonic() - t0 < 30:  # a bound on the loop, not a speed assertion: it ends once missing
            seq += 1  # rank 0 keeps beating; rank 1 fell silent after its first heartbeat
            _post(c.url, [heartbeat(run_id=run, rank=0, world_size=world, seq=seq, step=seq, every_s=1.5)])
            s = scrape(c.url)
            late = ("nanwatch_last_report_timestamp_seconds", frozenset({("run_id", run), ("rank", "1")})) in s
            seen.append((time.monotonic() - t0, late, s[("nanwatch_live_ranks", frozenset({("run_id", run)}))]))
            if seen[-1][2] < world:
                break
            time.sleep(0.2)
    held = [(t, late, live) for t, late, live in seen if t < 2.8]  # within two intervals, less slack
    assert held and all(not late and live == world for _, late, live in held), seen
    assert any(late for _, late, _ in seen), seen  # then named
    missing = [t for t, _, live in seen if live < world]
    assert missing and missing[0] >= 4.5 - 0.1, seen  # and counted missing after three intervals
