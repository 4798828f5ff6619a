"""MoE routing measured, compared and replayed (#39) on a tiny ``Qwen3MoeForCausalLM`` built from a config: a
synced fp32 rollout reads no disagreement; a bf16 copy with large router logits reads, per router, exactly the
disagreement the test counts itself from the two models' routers; ``verify`` raises its event only when the
trainer does not replay; ``apply`` makes the experts' inputs the rollout's; a collapsed router shows its load; a
NaN born in a router is named there; bad routes are one warning."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import transformers
from support import MOE_EXPERTS as E
from support import MOE_LAYERS as L
from support import MOE_TOP_K as K
from support import MOE_VOCAB as VOCAB
from support import sample, scrape, step_reports, tiny_moe, wait_until

import nanwatch
from nanwatch.hooks import record_routes


def gates(model) -> list[torch.nn.Module]:
    return [layer.mlp.gate for layer in model.model.layers]


class Taken:
    """The test's own record of the routes each router returned (independent of nanwatch's hooks)."""

    def __init__(self, model) -> None:
        self.routes: list[torch.Tensor] = []
        self.handles = [g.register_forward_hook(lambda m, a, out, i=i: self._take(i, out[2]))
                        for i, g in enumerate(gates(model))]

    def _take(self, i: int, idx: torch.Tensor) -> None:
        self.routes.append(idx.detach().clone())

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def logprobs_of(out, ids: torch.Tensor) -> torch.Tensor:
    return out.logits[:, :-1].float().log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]


def one_step(model, ids, *, mask=None, rollout_routes=None, rollout_logprobs=None, routes=None, **options):
    reports: list = []
    with nanwatch.attach(model, run_id="moe-test", on_report=step_reports(reports), **options) as mon:
        with mon.step(0):
            if routes is not None:
                mon.routes(routes)
            out = model(input_ids=ids)
            lp = logprobs_of(out, ids)
            mon.rlhf(logprobs=lp, mask=mask, rollout_logprobs=rollout_logprobs, rollout_routes=rollout_routes)
            (lp * (mask if mask is not None else 1)).sum().backward()
    return reports[0]


def test_a_synced_fp32_rollout_reads_no_disagreement_in_any_router():
    model = tiny_moe(0)
    rollout = copy.deepcopy(model).eval()
    prompt = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), record_routes(rollout) as rec:
        seq = rollout.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=5, do_sample=False,
                               pad_token_id=0)
    R = rec.routes()
    assert R.shape == (2, 6 + 5 - 1, L, K)  # every position the rollout ran; the last token never did
    report = one_step(model, seq, rollout_routes=R)
    moe = report.moe
    assert moe is not None and moe.tokens_compared == 2 * 10 and moe.tokens_rerouted == 0
    assert [r.router for r in moe.routers] == [f"model.layers.{i}.mlp.gate" for i in range(L)]
    assert all(r.compared == 20 and r.differing == 0 and r.disagreement == 0.0 for r in moe.routers)
    assert moe.events == []


def test_a_bf16_copy_reads_the_per_router_disagreement_the_test_counts_itself():
    model = tiny_moe(0, router_scale=30.0)  # large router logits: bf16 rounding flips near-ties
    rollout = copy.deepcopy(model).to(torch.bfloat16).eval()
    ids = torch.randint(0, VOCAB, (4, 24), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(4, 23)
    mask[1, :5] = 0
    mask[3, 17:] = 0
    taken_rollout = Taken(rollout)
    with torch.no_grad(), record_routes(rollout) as rec:
        rollout_lp = logprobs_of(rollout(input_ids=ids), ids)
    taken_rollout.remove()
    taken = Taken(model)
    report = one_step(model, ids, mask=mask, rollout_routes=rec.routes(), rollout_logprobs=rollout_lp)
    taken.remove()
    with torch.no_grad():
        dlogp = (logprobs_of(model(input_ids=ids), ids).double() - rollout_lp.double()).abs()
    # ground truth: positions 0..22 produce logprobs[:, 0..22]; a token differs when its expert sets differ
    m = mask.bool()
    for i, r in enumerate(report.moe.routers):
        mine = taken.routes[i].view(4, 24, K)[:, :23]
        theirs = taken_rollout.routes[i].view(4, 24, K)[:, :23]
        differ = sum(1 for b in range(4) for t in range(23)
                     if m[b, t] and set(mine[b, t].tolist()) != set(theirs[b, t].tolist()))
        assert (r.compared, r.differing) == (int(m.sum()), differ), r.router
    per_router = [r.differing for r in report.moe.routers]
    assert any(per_router) and all(d < int(m.sum()) for d in per_router)  # the case is not trivial
    anyd = sum(1 for b in range(4) for t in range(23) if m[b, t] and any(
        set(taken.routes[i].view(4, 24, K)[b, t].tolist()) != set(taken_rollout.routes[i].view(4, 24, K)[b, t].tolist())
        for i in range(L)))
    assert (report.moe.tokens_compared, report.moe.tokens_rerouted) == (int(m.sum()), anyd)
    # the attribution's split: |Δlogp| over rerouted tokens and over the others
    rerouted = torch.zeros(4, 23, dtype=torch.bool)
    for i in range(L):
        mine, theirs = (x.routes[i].view(4, 24, K)[:, :23].sort(-1).values for x in (taken, taken_rollout))
        rerouted |= (mine != theirs).any(-1)
    moe = report.moe
    assert (moe.rerouted_scored, moe.agreeing_scored) == (int((rerouted & m).sum()), int((~rerouted & m).sum()))
    assert moe.rerouted_abs_dlogp == pytest.approx(float(dlogp[rerouted & m].sum()), rel=1e-6)
    assert moe.agreeing_abs_dlogp == pytest.approx(float(dlogp[~rerouted & m].sum()), rel=1e-6)
    assert moe.routing_explains is not None and 0.0 <= moe.routing_explains <= 1.0


def test_a_drift_says_how_much_of_the_mismatch_the_routing_explains():
    from nanwatch.hooks.moe.report import explained
    from nanwatch.wire import MoeStat, RolloutEvent
    # rerouted tokens: 10 at mean 0.05; agreeing: 90 at 0.01. At the agreeing mean the rerouted would carry 0.1 of
    # the 1.4 total; the excess 0.4 is 2/7 of the mismatch
    moe = MoeStat(tokens_compared=100, tokens_rerouted=10, rerouted_abs_dlogp=0.5, rerouted_scored=10,
                  agreeing_abs_dlogp=0.9, agreeing_scored=90)
    drift = RolloutEvent(cause="drift", step=3, figures={"abs_mean": 0.014}, evidence="symmetric mismatch")
    jump = RolloutEvent(cause="jump", step=3, evidence="a jump")
    out = explained([drift, jump], moe)
    assert out[0].figures["routing_explains"] == pytest.approx(2 / 7)
    assert "routing explains 29% of the mismatch (10 of 100 tokens rerouted)" in out[0].evidence
    assert out[1] == jump and explained([drift], None) == [drift]


def _user_replay(model, R: torch.Tensor) -> list:
    """A trainer's own R3: each router returns the rollout's experts (renormalised probabilities over them)."""
    def replayed(i, module, args, out):
        logits, weights, idx = out
        routes = R[:, :, i].reshape(-1, K)
        w = logits.float().softmax(-1).gather(1, routes)
        return logits, (w / w.sum(-1, keepdim=True)).to(weights.dtype), routes
    return [g.register_forward_hook(lambda m, a, o, i=i: replayed(i, m, a, o)) for i, g in enumerate(gates(model))]


def _random_routes(b: int, s: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(b * s * L)]).view(b, s, L, K)


def test_verify_raises_its_event_only_when_the_trainer_does_not_replay():
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    R = _random_routes(2, 12, seed=4)
    model = tiny_moe(0)
    handles = _user_replay(model, R)  # the trainer replays: the experts get R
    replayed = one_step(model, ids, routes=R, routing_replay="verify")
    for h in handles:
        h.remove()
    # routes(R) without a mask: every position is compared
    assert replayed.moe.tokens_compared == 2 * 12 and replayed.moe.tokens_rerouted == 0
    assert replayed.moe.events == []
    not_replayed = one_step(tiny_moe(0), ids, routes=R, routing_replay="verify")
    (event,) = not_replayed.moe.events
    assert event.kind == "routing_replay_not_applied" and event.fraction > 0.5
    assert set(event.routers) == {f"model.layers.{i}.mlp.gate" for i in range(L)}
    assert not_replayed.moe.routing_replay == "verify"


def test_apply_makes_the_experts_inputs_follow_the_rollouts_routes():
    model = tiny_moe(0)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(5))
    R = _random_routes(2, 12, seed=6)
    seen: list[torch.Tensor] = []
    handles = [layer.mlp.experts.register_forward_pre_hook(lambda m, args: seen.append(args[1].clone()))
               for layer in model.model.layers]
    report = one_step(model, ids, routes=R, routing_replay="apply")
    for h in handles:
        h.remove()
    assert [torch.equal(s.view(2, 12, K), R[:, :, i]) for i, s in enumerate(seen)] == [True] * L
    assert report.moe.tokens_rerouted == 0 and report.moe.events == [] and report.first_offender is None


def test_apply_reports_what_the_replay_corrected_through_to_the_collector(collector):
    """Under apply the experts' input is the rollout's, so tokens_rerouted reads 0 whatever the trainer's routers
    chose; what they chose is counted before the replay (#38: a report figure), exactly as the test counts it from
    the routers' own output, and a real collector exports it as a fraction."""
    model = tiny_moe(0)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(5))
    first = Taken(model)
    with torch.no_grad():
        model(input_ids=ids)
    first.remove()
    R = torch.stack([r.view(2, 12, K) for r in first.routes], dim=2)  # the trainer's own routes...
    R[:, ::2] = _random_routes(2, 12, seed=6)[:, ::2]  # ...but at every other position the rollout's are random
    own = Taken(model)  # registered before nanwatch's hooks: the routers' output before the replay
    reports: list = []
    run = "moe-own"
    with nanwatch.attach(model, run_id=run, routing_replay="apply", collector=collector.url, token=collector.token,
                         on_report=step_reports(reports)) as mon:
        with mon.step(0):
            mon.routes(R)
            lp = logprobs_of(model(input_ids=ids), ids)
            mon.rlhf(logprobs=lp)
            lp.sum().backward()
        wait_until(lambda: reports, "the step's report")
        got = {}
        wait_until(lambda: got.update(scrape(collector.url)) or sample(
            got, "nanwatch_moe_tokens_rerouted_before_replay", run_id=run) is not None, "the figure at the collector")
    own.remove()
    differs = torch.zeros(2, 12, dtype=torch.bool)
    for i in range(L):
        differs |= (own.routes[i].view(2, 12, K).sort(-1).values != R[:, :, i].sort(-1).values).any(-1)
    truth = int(differs.sum())
    assert 0 < truth < 24  # the case is not trivial
    moe = reports[0].moe
    assert (moe.tokens_compared, moe.tokens_rerouted, moe.tokens_own_rerouted) == (24, 0, truth)
    assert sample(got, "nanwatch_moe_tokens_rerouted_before_replay", run_id=run) == pytest.approx(truth / 24)
    assert sample(got, "nanwatch_moe_tokens_rerouted", run_id=run) == 0.0
    # without apply there is nothing before a replay to count: the figure is absent, not 0
    assert one_step(tiny_moe(0), ids, routes=R, routing_replay="verify").moe.tokens_own_rerouted is None


def test_apply_by_rlhf_after_the_old_logprob_pass_covers_the_logprob_positions():
    model = tiny_moe(0)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(7))
    R = _random_routes(2, 11, seed=8)  # aligned with logprobs: positions 0..10 of the forward
    seen: list[torch.Tensor] = []
    with nanwatch.attach(model, run_id="moe-apply", routing_replay="apply") as mon:
        with mon.step(0):
            with torch.no_grad():
                old = logprobs_of(model(input_ids=ids), ids)
            mon.rlhf(logprobs=old, rollout_routes=R)
            handles = [layer.mlp.experts.register_forward_pre_hook(lambda m, args: seen.append(args[1].clone()))
                       for layer in model.model.layers]
            logprobs_of(model(input_ids=ids), ids).sum().backward()
            for h in handles:
                h.remove()
        report = mon.last_report()
    for i, s in enumerate(seen):
        assert torch.equal(s.view(2, 12, K)[:, :11], R[:, :, i])
    assert report.moe.tokens_compared == 22 and report.moe.tokens_rerouted == 0


def test_a_collapsed_router_shows_its_load_and_idle_experts():
    model = tiny_moe(0)
    with torch.no_grad():
        model.model.layers[0].mlp.gate.weight.zero_()  # every logit ties: the same two experts take every token
    report = one_step(model, torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(9)))
    hot, other = report.moe.routers
    assert sorted(hot.load) == [0, 0, 0, 0, 0, 0, 20, 20] and hot.load_max == 4.0 and hot.experts_idle == 6
    assert hot.logit_max == 0.0
    assert sum(other.load) == 40 and other.load_max < 4.0


def test_a_nan_born_in_a_router_is_named_there():
    model = tiny_moe(0)
    with torch.no_grad():
        model.model.layers[1].mlp.gate.weight[3, 0] = math.nan
    report = one_step(model, torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(10)))
    assert report.first_offender == "model.layers.1.mlp.gate"
    assert report.moe.routers[1].logit_max is None and report.moe.routers[0].logit_max is not None


@pytest.mark.parametrize("routes, why", [
    (torch.zeros(2, 10, L + 1, K, dtype=torch.long), "routers of top_k"),
    (torch.full((2, 10, L, K), E, dtype=torch.long), "out of range"),
    (torch.zeros(2, 10, L, K), "integer tensor"),
])
def test_bad_routes_are_one_warning_never_an_exception(routes, why):
    model = tiny_moe(0)
    with pytest.warns(RuntimeWarning, match=why):
        report = one_step(model, torch.randint(0, VOCAB, (2, 10)), routes=routes, routing_replay="apply")
    assert report.moe.tokens_compared == 0


def test_routes_for_a_model_without_routers_are_a_warning():
    cfg = transformers.Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    model = transformers.Qwen3ForCausalLM(cfg)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = one_step(model, torch.randint(0, VOCAB, (2, 8)), routes=torch.zeros(2, 8, 1, 2, dtype=torch.long))
    assert any("no MoE router" in str(w.message) for w in caught) and report.moe is None


def test_a_job_report_reduces_the_ranks_moe_figures_exactly():
    from nanwatch.hooks.report.job_stats import contribution, merge_tables, reduce_job
    from nanwatch.wire import MoeStat
    ranks = []
    for rank in (0, 1):  # two ranks' steps: other batches, one compares routes, one has a collapsed router
        model = tiny_moe(0)
        if rank:
            with torch.no_grad():
                model.model.layers[0].mlp.gate.weight.zero_()
        ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(20 + rank))
        R = _random_routes(2, 9, seed=30) if rank == 0 else None
        report = one_step(model, ids, rollout_routes=R)
        ranks.append(report.model_copy(update={"rank": rank, "world_size": 2}))
    parts = [contribution(r, None, rank=r.rank) for r in ranks]
    table = merge_tables([p.table for p in parts])
    (s0, m0), (s1, m1) = (p.vectors(table, world=2) for p in parts)
    job = reduce_job(ranks[0], table, [a + b for a, b in zip(s0, s1, strict=True)],
                     [max(a, b) for a, b in zip(m0, m1, strict=True)], world=2)
    want = MoeStat.merged([r.moe for r in ranks])
    assert job.report.moe.model_dump(exclude={"events"}) == want.model_dump(exclude={"events"})
    assert [r.load_max for r in job.report.moe.routers] == [r.load_max for r in want.routers]
    assert job.report.moe.routers[0].load[:] != ranks[0].moe.routers[0].load  # summed, not the poster's


_BASE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)
FAMILIES = {  # every MoE family transformers ships that a small config builds here: (config, model, options)
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=E,
                       num_experts_per_tok=K)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=E, num_experts_per_tok=K, head_dim=8)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=E, num_experts_per_tok=K)),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(moe_intermediate_size=16, n_routed_experts=E, num_experts_per_tok=K, n_group=2, topk_group=1,
                         first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
                         qk_nope_head_dim=8, v_head_dim=8, n_shared_experts=1, num_key_value_heads=4)),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", dict(num_local_experts=E, num_experts_per_tok=K, head_dim=8)),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_s_routers_are_found_measured_and_replayed(family):
    config_cls, model_cls, options = FAMILIES[family]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**{**_BASE, **options}))
    from nanwatch.hooks.moe.routers import find_routers
    routers = find_routers(model)
    dense = 1 if family == "deepseek_v3" else 0  # DeepSeek-V3's first layer is dense (first_k_dense_replace)
    assert len(routers) == 2 - dense and all(r.experts == E and r.top_k == K for r in routers)
    assert all(r.experts_module is not None for r in routers)
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(11))
    n = len(routers)
    R = torch.stack([torch.randperm(E, generator=torch.Generator().manual_seed(i))[:K]
                     for i in range(2 * 10 * n)]).view(2, 10, n, K)
    seen: list[torch.Tensor] = []
    handles = [r.experts_module.register_forward_pre_hook(lambda m, args: seen.append(args[1].clone()))
               for r in routers]
    report = one_step(model, ids, routes=R, routing_replay="apply")
    for h in handles:
        h.remove()
    assert [r.router for r in report.moe.routers] == [r.name for r in routers]
    assert all(sum(r.load) == 2 * 10 * K and r.logit_max is not None for r in report.moe.routers)
    assert all(torch.equal(s.view(2, 10, K).long(), R[:, :, i]) for i, s in enumerate(seen))
    assert report.moe.tokens_compared == 20 and report.moe.tokens_rerouted == 0
    assert report.first_offender is None


def test_routes_of_every_position_compare_only_the_logprobs_tokens():
    """R of the whole sequence (prompt included, as vLLM returns it) against logprobs of the completion only:
    the logprobs' columns are the tokens compared, the prompt's routes never are."""
    model = tiny_moe(0)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(12))
    rollout = copy.deepcopy(model)
    with torch.no_grad(), record_routes(rollout) as rec:
        rollout(input_ids=ids)
    R = rec.routes()
    R[:, :6] = (R[:, :6] + 1) % E  # the prompt's routes all differ: never counted
    reports: list = []
    with nanwatch.attach(model, run_id="moe-window", on_report=step_reports(reports)) as mon:
        with mon.step(0):
            lp = logprobs_of(model(input_ids=ids), ids)[:, -5:]  # the completion: tokens 7..11
            mon.rlhf(logprobs=lp, rollout_routes=R)
            lp.sum().backward()
    moe = reports[0].moe
    assert (moe.tokens_compared, moe.tokens_rerouted) == (2 * 5, 0)
