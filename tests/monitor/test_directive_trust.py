"""Directives a single report cannot steer (issue #19, findings 9 and 10), against a real ``nanwatch serve``:
a lying rank that stays live must not push ``apply_at_step`` out of reach, and one forged rank-0 report must
not end a directive that allows auto-revert. The honest paths beside them still work."""

from __future__ import annotations

import httpx
import pytest
from support import ADMIN, JSON, TOKEN, CollectorProcess, step_report

from nanwatch.wire import MAX_INT, ReportBatch

ADMIN_H = {"Authorization": f"Bearer {ADMIN}", **JSON}
INGEST_H = {"Authorization": f"Bearer {TOKEN}", **JSON}
#: the honest job's agreement cadence (the trainer's default ``directive_check_every``)
EVERY = 4


def _post(url: str, *reports) -> None:
    resp = httpx.post(f"{url}/v1/reports", content=ReportBatch(reports=list(reports)).model_dump_json(),
                      headers=INGEST_H, timeout=30)
    assert resp.status_code == 200, resp.text


def _rank(run_id: str, rank: int, step: int, *, world: int = 1, seq: int | None = None, incarnation: str = "inc0",
          every: int | None = EVERY, mode: str = "none", version: int = 0, **kw):
    r = step_report(run_id=run_id, rank=rank, seq=step if seq is None else seq, step=step, incarnation=incarnation,
                    mode=mode, layers=1, **kw)
    return r.model_copy(update={"world_size": world, "agree_every": every, "directive_version": version})


def _put(url: str, run_id: str, **spec) -> dict:
    resp = httpx.put(f"{url}/v1/directives/{run_id}", json={"mode": "fp32", **spec}, headers=ADMIN_H, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _directive(url: str, run_id: str) -> dict:
    return httpx.get(f"{url}/v1/directives/{run_id}", params={"wait": 0}, headers=INGEST_H, timeout=30).json()


# ---- finding 9: apply_at_step from ranks the run can vouch for ---------------------------------------------

#: (liar's rank, its step, its agree_every, world size): each liar stays live beside honest ranks at step 5
LIARS = {
    "huge-step": (1, MAX_INT - 1, EVERY, 2),
    "huge-cadence": (1, 5, MAX_INT, 2),
    "lying-rank-0": (0, MAX_INT - 1, EVERY, 3),  # a new incarnation of rank 0; ranks 1 and 2 honest
}


@pytest.mark.parametrize("lie", sorted(LIARS))
def test_a_lying_live_rank_cannot_push_an_admin_directive_out_of_reach(collector, lie):
    rank, step, every, world = LIARS[lie]
    run_id = f"lie-{lie}"
    _post(collector.url, *(_rank(run_id, k, 5, world=world) for k in range(world)))
    _post(collector.url, _rank(run_id, rank, step, world=world, seq=0, incarnation="liar", every=every))
    d = _put(collector.url, run_id)
    assert d["apply_at_step"] == 8, d  # the honest ranks' next agreement step (they agree every 4 steps)


def test_a_lying_live_rank_cannot_push_the_rules_fp32_out_of_reach(collector):
    run_id = "lie-rule"
    _post(collector.url, _rank(run_id, 0, 5, world=2), _rank(run_id, 1, 5, world=2))
    _post(collector.url, _rank(run_id, 1, MAX_INT - 1, world=2, seq=0, incarnation="liar"))
    # rank 0's fp16 attention output turns NaN: the rule issues fp32, at a step the job can reach
    _post(collector.url, _rank(run_id, 0, 6, world=2, dtype="float16", nan_at="model.layers.0.self_attn", nan=3))
    d = _directive(collector.url, run_id)
    assert (d["mode"], d["set_by"], d["apply_at_step"]) == ("fp32", "rule:half_attention_nonfinite", 8), d


def test_a_rank_0_far_ahead_of_its_world_is_not_believed_but_a_near_one_is(collector):
    """Honest ranks report a few steps apart: rank 0 slightly ahead decides; the median rank otherwise."""
    _post(collector.url, _rank("near", 0, 10, world=2), _rank("near", 1, 7, world=2))
    assert _put(collector.url, "near")["apply_at_step"] == 12
    _post(collector.url, *(_rank("far", k, 5, world=3) for k in (1, 2)), _rank("far", 0, 500, world=3))
    assert _put(collector.url, "far")["apply_at_step"] == 8


# ---- finding 10: an auto-revert takes the incarnation that applied the mode, and its clean steps -------------

REVERT_AFTER = 50


def _revertible(url: str, run_id: str, *, world: int = 1) -> tuple[int, int]:
    """The run reports steps 0..2, gets fp32 with auto-revert, and applies it at its apply step:
    (the directive's version, its apply step)."""
    _post(url, *(_rank(run_id, k, s, world=world) for s in range(3) for k in range(world)))
    d = _put(url, run_id, revert_after_clean_steps=REVERT_AFTER)
    at = d["apply_at_step"]
    _post(url, *(_rank(run_id, k, at, world=world, mode="fp32", version=d["version"]) for k in range(world)))
    return d["version"], at


def test_one_forged_rank_0_report_cannot_end_an_auto_revert_directive(collector):
    url = collector.url
    version, at = _revertible(url, "forged")
    # a forger knows the run's incarnation and apply step (GET /v1/runs/{id}); it posts rank 0 "reverted"
    forged = [_rank("forged", 0, at + 1, seq=at + 1, mode="none", version=version),  # too early
              _rank("forged", 0, at + REVERT_AFTER, seq=at + 2, mode="none", version=version)]  # too far ahead
    for r in forged:
        _post(url, r)
        assert _directive(url, "forged")["version"] == version
    # nor a new incarnation of rank 0 that never applied the mode
    _post(url, _rank("forged", 0, at + REVERT_AFTER, seq=0, incarnation="other", mode="none", version=version))
    d = _directive(url, "forged")
    assert (d["version"], d["mode"]) == (version, "fp32"), d


def test_an_honest_auto_revert_is_recorded_after_its_clean_steps(collector):
    url = collector.url
    version, at = _revertible(url, "honest", world=2)
    clean = [_rank("honest", k, s, world=2, mode="fp32", version=version)
             for s in range(at + 1, at + REVERT_AFTER) for k in (0, 1)]
    _post(url, *clean)
    assert _directive(url, "honest")["version"] == version
    _post(url, _rank("honest", 0, at + REVERT_AFTER, world=2, version=version))  # reverted after clean steps
    d = _directive(url, "honest")
    assert (d["version"], d["mode"], d["set_by"]) == (version + 1, "none", "trainer:auto-revert"), d


def test_an_honest_revert_reported_after_a_gap_is_believed_at_the_next_report(collector):
    url = collector.url
    version, at = _revertible(url, "gap")
    _post(url, _rank("gap", 0, at + REVERT_AFTER + 20, version=version))  # reports were dropped meanwhile
    assert _directive(url, "gap")["version"] == version
    _post(url, _rank("gap", 0, at + REVERT_AFTER + 21, version=version))
    assert (_directive(url, "gap")["version"], _directive(url, "gap")["mode"]) == (version + 1, "none")


def test_a_revert_first_seen_after_a_collector_restart_is_believed_at_the_next_report(tmp_path):
    """The witness is kept in memory: after a restart the rank's next reports name it again."""
    env = {"NANWATCH_TOKEN": TOKEN, "NANWATCH_ADMIN_TOKENS": f'{{"alice": "{ADMIN}"}}'}
    with CollectorProcess(db_path=tmp_path / "c.db", env=env) as c:
        version, at = _revertible(c.url, "restart")
        c.stop()
        c.start()
        _post(c.url, _rank("restart", 0, at + REVERT_AFTER, version=version))
        assert _directive(c.url, "restart")["version"] == version
        _post(c.url, _rank("restart", 0, at + REVERT_AFTER + 1, version=version))
        d = _directive(c.url, "restart")
        assert (d["version"], d["mode"], d["set_by"]) == (version + 1, "none", "trainer:auto-revert"), d
