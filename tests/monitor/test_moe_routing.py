"""MoE routing at the collector (wire 1.15 ``StepReport.moe``, issue #39), against a real ``nanwatch serve`` on
loopback: two ranks' router figures merge exactly into ``nanwatch_moe_*{run_id, layer}`` (loads summed before
the share is taken, disagreement from summed counts, logit max the largest), a hot expert shows in the load gauge,
a replay claimed and not applied sets ``nanwatch_moe_replay_not_applied`` and its event lands in the run's log."""

from __future__ import annotations

import contextlib
import io

import pytest
from support import TOKEN, post_reports, sample, scrape, step_report

from nanwatch.cli import main
from nanwatch.wire import MoeStat, RouterStat, RoutingEvent

GATE0, GATE1 = "model.layers.0.mlp.gate", "model.layers.1.mlp.gate"


def _moe(*routers: RouterStat, routing_replay: str = "off", **figures) -> MoeStat:
    return MoeStat(routing_replay=routing_replay, routers=list(routers), **figures)


def test_two_ranks_merge_exactly_and_a_hot_expert_shows_in_the_load_gauge(collector):
    run = "moe-ranks"
    # rank 0: gate 0 balanced over 4 experts; rank 1: expert 2 takes every slot. Merged: 8+8+(8+32)+8 = 64 slots,
    # the largest 40: 40/64 * 4 = 2.5 (a max of the ranks' own figures would say 4, a mean 2.5 only by chance)
    r0 = _moe(RouterStat(router=GATE0, top_k=2, load=[8, 8, 8, 8], logit_max=3.0, compared=10, differing=1),
              RouterStat(router=GATE1, top_k=2, load=[16, 0, 16, 0], logit_max=7.5, compared=10, differing=0),
              tokens_compared=10, tokens_rerouted=1)
    r1 = _moe(RouterStat(router=GATE0, top_k=2, load=[0, 0, 32, 0], logit_max=9.0, compared=30, differing=9),
              RouterStat(router=GATE1, top_k=2, load=[8, 8, 8, 8], logit_max=2.0, compared=30, differing=3),
              tokens_compared=30, tokens_rerouted=11)
    batch = [step_report(run_id=run, rank=0, world_size=2, seq=0).model_copy(update={"moe": r0}),
             step_report(run_id=run, rank=1, world_size=2, seq=0).model_copy(update={"moe": r1})]
    assert post_reports(collector.url, *batch) == {"accepted": 2, "duplicates": 0}
    s = scrape(collector.url)
    assert sample(s, "nanwatch_moe_expert_load_max", run_id=run, layer=GATE0) == pytest.approx(2.5)
    assert sample(s, "nanwatch_moe_expert_load_max", run_id=run, layer=GATE1) == pytest.approx(24 / 64 * 4)
    assert sample(s, "nanwatch_moe_routing_disagreement", run_id=run, layer=GATE0) == pytest.approx(10 / 40)
    assert sample(s, "nanwatch_moe_routing_disagreement", run_id=run, layer=GATE1) == pytest.approx(3 / 40)
    assert sample(s, "nanwatch_moe_router_logit_max", run_id=run, layer=GATE0) == 9.0
    assert sample(s, "nanwatch_moe_tokens_rerouted", run_id=run) == pytest.approx(12 / 40)
    assert sample(s, "nanwatch_moe_replay_not_applied", run_id=run) is None  # no replay claimed


def test_a_replay_not_applied_sets_its_gauge_and_event(collector):
    run = "moe-r3"
    event = RoutingEvent(kind="routing_replay_not_applied", step=0, routers=[GATE1], fraction=0.25,
                         evidence="routing_replay=verify: 25.0% of 8 tokens reached experts other than the rollout's")
    bad = _moe(RouterStat(router=GATE1, top_k=2, load=[4, 4, 4, 4], compared=8, differing=2),
               routing_replay="verify",
               tokens_compared=8, tokens_rerouted=2, events=[event])
    assert post_reports(collector.url, step_report(run_id=run, seq=0).model_copy(update={"moe": bad}))["accepted"] == 1
    s = scrape(collector.url)
    assert sample(s, "nanwatch_moe_replay_not_applied", run_id=run) == 1.0
    assert sample(s, "nanwatch_events_total", run_id=run, kind="routing_replay_not_applied") == 1
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["status", run, "--url", collector.url, "--token", TOKEN]) == 0
    assert ("routing replay not applied at step 0 on rank 0: routing_replay=verify: 25.0% of 8 tokens reached "
            "experts other than the rollout's") in buf.getvalue()
    good = bad.model_copy(update={"routers": [bad.routers[0].model_copy(update={"differing": 0})],
                                  "tokens_rerouted": 0, "events": []})
    post_reports(collector.url, step_report(run_id=run, seq=1).model_copy(update={"moe": good}))
    assert sample(scrape(collector.url), "nanwatch_moe_replay_not_applied", run_id=run) == 0.0
