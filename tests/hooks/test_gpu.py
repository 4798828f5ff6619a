"""No host sync in the hot path: proven on a CUDA device with torch.cuda.set_sync_debug_mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from support import Mixer, free_port, tiny_qwen3

import nanwatch

pytestmark = pytest.mark.gpu
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _count_syncs(step) -> int:
    """The host synchronisations ``step()`` made, as CUDA's sync debug mode warns of them."""
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(x.message) for x in w)


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_monitored_step_makes_zero_host_syncs(dtype):
    torch.manual_seed(0)
    model = torch.nn.Sequential(Mixer(128), Mixer(128)).cuda().to(dtype)
    x = torch.randn(2, 64, 128, device="cuda", dtype=dtype, requires_grad=True)
    lp = -torch.rand(2, 64, device="cuda")
    mask = torch.rand(2, 64, device="cuda") > 0.2
    with nanwatch.attach(model, run_id="gpu", exact_logit_every=2,
                         is_attention=lambda n, m: isinstance(m, Mixer)) as mon:
        for n in range(3):  # step 0 allocates slots and host buffers; steps 1-2 are the steady state
            # Probes are guarded (a failure becomes a warning), so a sync error would surface as a
            # "probe failed" warning: make those errors here, so the test can fail.
            with warnings.catch_warnings():
                warnings.filterwarnings("error", message=".*probe failed.*")
                torch.cuda.set_sync_debug_mode("error")
                try:
                    with mon.step(n):
                        y = mon.watch("block.out", model(x))
                        mon.rlhf(logprobs=lp, old_logprobs=lp * 0.9, ref_logprobs=lp * 1.1, mask=mask,
                                 rollout_logprobs=lp * 1.05)  # the rollout comparison: device ops only too
                        y.float().square().mean().backward()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            r = mon.last_report()
            assert r.step == n and r.first_offender is None
    assert len(r.sdpa) == 2 and {c.backend for c in r.sdpa} <= {"flash", "efficient", "cudnn"}
    assert all(c.confirmed for c in r.sdpa)
    assert len(r.logits) == 2 and all(lg.source == "lse" and len(lg.per_head) == 4 for lg in r.logits)
    assert {(s.site, s.phase) for s in r.sites} >= {("0", "forward"), ("1", "backward"), ("block.out", "forward")}
    assert r.rlhf is not None and r.rlhf.tokens > 0 and r.rlhf.rollout.tokens == r.rlhf.tokens


@cuda
def test_hf_model_syncs_no_more_with_nanwatch_than_without():
    pytest.importorskip("transformers")
    model = tiny_qwen3("sdpa", vocab_size=256, hidden_size=128, intermediate_size=256, head_dim=32,
                       max_position_embeddings=4096).cuda().to(torch.bfloat16)
    ids = torch.randint(0, 256, (2, 64), device="cuda")

    def bare():
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()

    bare()
    baseline = _count_syncs(bare)
    with nanwatch.attach(model, run_id="gpu-hf") as mon:
        with mon.step(0):
            bare()

        steps = iter(range(1, 10))

        def monitored():
            with mon.step(next(steps)):
                bare()

        monitored()
        added = _count_syncs(monitored)
        assert mon.last_report().first_offender is None
    assert added == baseline, f"HF step synced {baseline}x bare, {added}x with nanwatch"


@cuda
def test_the_weight_guard_adds_zero_host_syncs():
    """The guard hands fused AdamW nanwatch's flag as a device tensor (GradScaler's mechanism): a clean step
    and a NaN step both run under sync-debug "error", and the NaN step leaves the weights as they were."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(Mixer(128), Mixer(128)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    x = torch.randn(2, 64, 128, device="cuda")
    with nanwatch.attach(model, run_id="gpu-guard", optimizer=opt, rerun=False,
                         is_attention=lambda n, m: isinstance(m, Mixer)) as mon:
        for n, inputs in enumerate([x, x, x * float("nan")]):
            before = [p.detach().clone() for p in model.parameters()]
            with warnings.catch_warnings():
                warnings.filterwarnings("error", message=".*probe failed.*")
                torch.cuda.set_sync_debug_mode("error")
                try:
                    with mon.step(n):
                        model(inputs).float().square().mean().backward()
                        opt.step()
                        opt.zero_grad(set_to_none=True)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            r = mon.last_report()
            unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
            assert r.step_skipped is (n == 2) and unchanged is (n == 2), (n, r.step_skipped, unchanged)


@cuda
def test_the_rerun_at_defaults_adds_zero_host_syncs_and_classifies_a_step_later():
    """Rerun mode is on by default on a GPU (#35): the step's flag goes to the host by an async copy and an
    event, so the clean steps and the NaN step itself run under sync-debug "error"; the next step decides
    (its start: the flag has landed, or its optimizer pre-step), and its report carries the NaN step's
    incident, with that step's number."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(Mixer(128), Mixer(128)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    x = torch.randn(2, 64, 128, device="cuda")
    reports = []
    with nanwatch.attach(model, run_id="gpu-rerun", optimizer=opt, directive_source="off",
                         is_attention=lambda n, m: isinstance(m, Mixer)) as mon:
        for n, inputs in enumerate([x, x, x * float("nan"), x]):
            with warnings.catch_warnings():
                warnings.filterwarnings("error", message=".*probe failed.*")
                torch.cuda.set_sync_debug_mode("error" if n < 3 else "default")  # step 3: the incident's reads
                try:
                    with mon.step(n):
                        model(inputs).float().square().mean().backward()
                        opt.step()
                        opt.zero_grad(set_to_none=True)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            reports.append(mon.last_report())
    assert [r.step_skipped for r in reports] == [False, False, True, False]
    assert [r.incident is not None for r in reports] == [False, False, False, True]
    inc = reports[3].incident
    assert (inc.cls, inc.step) == ("data_mask", 2), inc


@cuda
def test_a_job_reported_guarded_step_with_the_capsule_idle_and_rlhf_makes_zero_host_syncs(tmp_path):
    """Two ranks on one GPU (gloo, torchrun): report_scope="job" (the reporter thread's reduction), the weight
    guard on a fused AdamW, the capsule on and idle, rlhf() with the rollout, every step under sync-debug
    "error" (gpu_job_worker.py says what this leaves to a two-GPU machine: the guard's flag reduction)."""
    worker = Path(__file__).with_name("gpu_job_worker.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "--master_addr=127.0.0.1", str(worker), str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=180)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for r in ranks:
        assert r["sync_debug_caught_item"], "set_sync_debug_mode('error') did not catch a deliberate .item()"
        assert r["errors"] == [], r["errors"]
        assert r["capsule_files"] == [], r["capsule_files"]  # clean steps: the capsule stays idle
        for n, rep in r["own"].items():
            assert rep["first_offender"] is None and rep["step_skipped"] is False, (r["rank"], n)
            assert rep["rlhf"]["tokens"] > 0 and rep["rlhf"]["rollout"]["tokens"] == rep["rlhf"]["tokens"]
    jobs = [p for p in ranks[0]["posts"] if p["scope"] == "job"]  # rank 0 posts the job's reports
    assert sorted({p["step"] for p in jobs}) == [0, 1, 2, 3] and all(p["ranks_reporting"] == 2 for p in jobs)
    pooled = sum(r["own"]["0"]["rlhf"]["tokens"] for r in ranks)
    assert next(p for p in jobs if p["step"] == 0)["rlhf"]["tokens"] == pooled  # both ranks' tokens, pooled


@cuda
def test_one_off_births_are_named_at_the_defaults_on_cuda():
    """Exact at the defaults on the device users train on: a one-off NaN born in layer 0's MLP (forward, step 2)
    and in the gradient into layer 1's MLP (backward, step 3) are named there, in their own step; the weight
    guard keeps both steps out of the weights."""
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = tiny_qwen3("sdpa", vocab_size=256, hidden_size=128, intermediate_size=256, head_dim=32).cuda()
    model = model.to(torch.bfloat16)
    arm = {"step": None}
    model.model.layers[0].mlp.register_forward_hook(
        lambda m, a, out: out * float("nan") if arm["step"] == 2 else None, prepend=True)

    def poison_grad(module, args, out) -> None:
        if arm["step"] == 3:
            out.register_hook(lambda g: g * float("nan"))

    model.model.layers[1].mlp.register_forward_hook(poison_grad)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(0, 256, (2, 64), device="cuda")
    reports = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.attach(model, run_id="gpu-exact", optimizer=opt, directive_source="off") as mon:
            for n in range(5):
                arm["step"] = n
                with mon.step(n):
                    model(input_ids=ids, labels=ids).loss.backward()
                    opt.step()
                    opt.zero_grad()
                reports.append(mon.last_report())
    named = {r.step: (r.first_offender, r.first_offender_phase) for r in reports if r.first_offender}
    assert named == {2: ("model.layers.0.mlp", "forward"), 3: ("model.layers.1.mlp", "backward")}, named
    assert [r.step for r in reports if r.step_skipped] == [2, 3]
    assert all(torch.isfinite(p).all() for p in model.parameters())


@cuda
def test_moe_routes_measured_compared_and_applied_sync_no_more_than_the_bare_model():
    """#39: the routers' load, the routes' comparison and the replay are device ops. HF's experts loop syncs on
    its own (``nonzero``), so the count is compared with the bare step's; the routes applied are the model's
    own (recorded first), so the experts loop runs the same experts either way."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(vocab_size=256, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                      num_experts=8, num_experts_per_tok=2, max_position_embeddings=512)
    model = transformers.Qwen3MoeForCausalLM(cfg).cuda()
    ids = torch.randint(0, 256, (2, 64), device="cuda")
    from nanwatch.hooks import record_routes

    with torch.no_grad(), record_routes(model) as rec:
        model(input_ids=ids, use_cache=False)
    R = rec.routes()

    def bare():
        out = model(input_ids=ids, use_cache=False)
        out.logits.float().log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None]).sum().backward()

    bare()
    baseline = _count_syncs(bare)
    with nanwatch.attach(model, run_id="gpu-moe", routing_replay="apply") as mon:
        for n in range(3):  # step 0 allocates the slots; steps 1-2 are the steady state
            mon.begin_step(n)
            mon.routes(R)

            def monitored():
                out = model(input_ids=ids, use_cache=False)
                lp = out.logits.float().log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
                mon.rlhf(logprobs=lp, rollout_logprobs=lp.detach(), rollout_routes=R)
                lp.sum().backward()

            syncs = _count_syncs(monitored) if n else (monitored() or 0)
            mon.end_step()
            r = mon.last_report()
            assert r.moe is not None and r.moe.tokens_compared == 2 * 63 and r.moe.tokens_rerouted == 0
            assert r.moe.tokens_own_rerouted == 0  # #38: the routers' own routes, before the replay, are R too
            if n:
                assert syncs <= baseline, (syncs, baseline)
