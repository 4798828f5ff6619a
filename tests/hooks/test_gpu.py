"""No host sync in the hot path: proven on a CUDA device with torch.cuda.set_sync_debug_mode."""

from __future__ import annotations

import warnings

import pytest
import torch
from support import Mixer, tiny_qwen3

import nanwatch

pytestmark = pytest.mark.gpu
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


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

    def count_syncs(step):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return sum("synchroniz" in str(x.message) for x in w)

    def bare():
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()

    bare()
    baseline = count_syncs(bare)
    with nanwatch.attach(model, run_id="gpu-hf") as mon:
        with mon.step(0):
            bare()

        steps = iter(range(1, 10))

        def monitored():
            with mon.step(next(steps)):
                bare()

        monitored()
        added = count_syncs(monitored)
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
