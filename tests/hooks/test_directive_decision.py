"""The directive decision, pure: no torch.distributed, no threads, no model."""

from __future__ import annotations

from nanwatch.hooks.directives.decision import (
    Candidate,
    Decision,
    InForce,
    decide,
    local_candidate,
    newest,
    still_pending,
)
from nanwatch.wire import MODES, Directive

NONE = InForce("none", 0, None)
FP32 = MODES.index("fp32")


def _d(version: int, mode: str = "fp32", at: int = 0, revert: int | None = None) -> Directive:
    return Directive(run_id="r", version=version, mode=mode, apply_at_step=at, revert_after_clean_steps=revert)


def test_newest_prefers_the_higher_version_and_the_offer_on_a_tie():
    offered, polled = _d(2), _d(3, "fused")
    assert newest(offered, polled) is polled
    assert newest(polled, offered) is polled
    assert newest(offered, _d(2, "fused")) is offered
    assert newest(None, None) is None and newest(None, offered) is offered


def test_a_newer_directive_applies_from_its_apply_step_not_before():
    cand = local_candidate(NONE, _d(1, at=3), clean_streak=0, decides_revert=True)
    assert cand == Candidate(1, FP32, 3, 0)
    assert decide(NONE, cand, step=2) == Decision("stay", "none", 0)
    assert decide(NONE, cand, step=3) == Decision("apply", "fp32", 1)


def test_an_old_directive_changes_nothing():
    now = InForce("fp32", 2, None)
    cand = local_candidate(now, _d(1, "fused"), clean_streak=0, decides_revert=True)
    assert cand == Candidate(2, FP32, 0, 0) and decide(now, cand, step=9).action == "stay"


def test_revert_after_the_clean_streak_on_the_deciding_rank_only():
    now = InForce("fp32", 1, 3)
    assert local_candidate(now, None, clean_streak=2, decides_revert=True).revert == 0
    cand = local_candidate(now, None, clean_streak=3, decides_revert=True)
    assert cand.revert == 1 and decide(now, cand, step=5) == Decision("revert", "none", 1)
    assert local_candidate(now, None, clean_streak=99, decides_revert=False).revert == 0
    assert local_candidate(InForce("fp32", 1, None), None, clean_streak=99, decides_revert=True).revert == 0


def test_max_of_candidates_is_the_agreement():
    """What the all-reduce computes, element-wise: a newer version wins; any rank's revert reverts."""
    rank0 = Candidate(1, FP32, 0, 1)
    rank1 = Candidate(2, MODES.index("fused"), 7, 0)
    agreed = Candidate(*map(max, rank0, rank1))
    now = InForce("fp32", 1, 3)
    assert decide(now, agreed, step=6) == Decision("revert", "none", 1)  # v2 not yet due: rank 0's revert
    assert decide(now, agreed, step=7) == Decision("apply", "fused", 2)


def test_an_agreed_candidate_is_held_while_it_is_still_due():
    assert still_pending(Candidate(2, FP32, 9, 0), version_after=1)
    assert not still_pending(Candidate(2, FP32, 9, 0), version_after=2)
    assert still_pending(Candidate(2, FP32, 0, 1), version_after=2)
