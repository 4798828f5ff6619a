"""Which SDPA backend ran and why: predicted, confirmed from grad_fn, explained, and the saved lse.

CPU cases run real SDPA calls on torch's own selector; the CUDA rule port is checked on fake
metadata (meta tensors labelled cuda), and against a real GPU where there is one.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from nanwatch.hooks.measure.sdpa_backend import (
    cache_clear,
    confirmed_backend,
    explain,
    lse_of,
    predict,
)
from nanwatch.hooks.measure.sdpa_rules import (
    DeviceProfile,
    Flags,
    SdpaMeta,
    TensorMeta,
    cpu_flash_refusal,
    cudnn_refusal,
    efficient_refusal,
    flash_refusal,
)

B, H, S, D = 2, 4, 16, 8


def _qkv(*, d=D, s=S, heads_kv=H, dtype=torch.float32, grad=True):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, s, d, generator=g, dtype=dtype, requires_grad=grad)
    k = torch.randn(B, heads_kv, s, d, generator=g, dtype=dtype)
    v = torch.randn(B, heads_kv, s, d, generator=g, dtype=dtype)
    return q, k, v


@pytest.fixture(autouse=True)
def _fresh_cache():
    cache_clear()
    yield
    cache_clear()


# ---- CPU: predicted, and confirmed by the real call ------------------------------------------------


def test_cpu_fused_path_is_predicted_and_confirmed():
    q, k, v = _qkv()
    assert predict(q, k, v) == ("cpu_flash", None)
    out = F.scaled_dot_product_attention(q, k, v)
    assert confirmed_backend(out) == "cpu_flash"
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_forced_math_is_predicted_explained_and_confirmed():
    q, k, v = _qkv()
    with sdpa_kernel([SDPBackend.MATH]):
        backend, reason = predict(q, k, v)
        out = F.scaled_dot_product_attention(q, k, v)
    assert backend == "math"
    assert "disabled by sdpa_kernel" in reason
    assert confirmed_backend(out) == "math"


def test_no_grad_output_has_no_confirmation():
    q, k, v = _qkv()
    with torch.no_grad():
        out = F.scaled_dot_product_attention(q, k, v)
    assert confirmed_backend(out) is None
    assert lse_of(out) is None


def test_cache_does_not_go_stale_across_sdpa_kernel():
    q, k, v = _qkv()
    assert predict(q, k, v) == ("cpu_flash", None)
    with sdpa_kernel([SDPBackend.MATH]):
        assert predict(q, k, v)[0] == "math"
    assert predict(q, k, v) == ("cpu_flash", None)
    # The cached reason is keyed by the enable flags too: same call, different reasons.
    outside = predict(q, k, v, dropout_p=0.1)
    with sdpa_kernel([SDPBackend.MATH]):
        inside = predict(q, k, v, dropout_p=0.1)
    again = predict(q, k, v, dropout_p=0.1)
    assert outside == again == ("math", outside[1]) and "dropout" in outside[1]
    assert inside[0] == "math" and "disabled" in inside[1]


def test_no_viable_backend_is_unknown_not_an_exception():
    q, k, v = _qkv()
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):  # no such kernel on CPU, and math is off
        backend, reason = predict(q, k, v)
    assert backend == "unknown" and reason.startswith("no viable backend")


def _mask(*shape, **kw):
    return torch.zeros(*shape, **kw)


# Each case: (kwargs builder, substring the reason must name). Found by experiment on torch 2.13 CPU.
CPU_MATH_CASES = {
    "dropout": (lambda: dict(dropout_p=0.1), "dropout"),
    "3d_inputs": (lambda: dict(q=torch.randn(H, S, D), k=torch.randn(H, S, D), v=torch.randn(H, S, D)), "4-D"),
    "mask_3d": (lambda: dict(attn_mask=_mask(1, S, S)), "attn_mask shape"),
    "mask_requires_grad": (lambda: dict(attn_mask=_mask(S, S, requires_grad=True)), "attn_mask requires grad"),
    "v_head_dim": (lambda: dict(v=torch.randn(B, H, S, 2 * D)), "head_dim differs"),
    "mqa_without_gqa_flag": (lambda: dict(k=torch.randn(B, 1, S, D), v=torch.randn(B, 1, S, D)), "enable_gqa=False"),
    "last_dim_stride": (lambda: dict(q=torch.randn(B, H, D, S).transpose(-1, -2)), "last-dim stride"),
}


def _call(build):
    q, k, v = _qkv()
    args = dict(q=q, k=k, v=v)
    args.update(build())
    kw = {n: args.pop(n) for n in ("attn_mask", "dropout_p") if n in args}
    return args["q"], args["k"], args["v"], kw


@pytest.mark.parametrize("case", sorted(CPU_MATH_CASES))
def test_cpu_math_reasons_match_the_real_call(case):
    build, needle = CPU_MATH_CASES[case]
    q, k, v, kw = _call(build)
    backend, reason = predict(q, k, v, **kw)
    assert backend == "math"
    assert reason.startswith("cpu_flash: ") and needle in reason, reason
    out = F.scaled_dot_product_attention(q, k, v, **kw)
    assert confirmed_backend(out) in ("math", None)  # None: nothing required grad (e.g. 3-D case)


def test_cpu_dropout_refuses_fused_even_without_grad():
    q, k, v = _qkv()
    with torch.no_grad():
        assert predict(q, k, v, dropout_p=0.1)[0] == "math"


CPU_FUSED_CASES = {
    "fp16": lambda: dict(q=torch.randn(B, H, S, D).half(), k=torch.randn(B, H, S, D).half(),
                         v=torch.randn(B, H, S, D).half()),
    "bool_mask": lambda: dict(attn_mask=torch.ones(S, S, dtype=torch.bool)),
    "strided_mask": lambda: dict(attn_mask=_mask(S, S).t()),  # CPU no longer needs mask stride(-1)==1
    "broadcast_4d_mask": lambda: dict(attn_mask=_mask(1, H, S, S)),
    "head_dim_7": lambda: dict(q=torch.randn(B, H, S, 7), k=torch.randn(B, H, S, 7), v=torch.randn(B, H, S, 7)),
}


@pytest.mark.parametrize("case", sorted(CPU_FUSED_CASES))
def test_cpu_fused_near_misses_stay_fused(case):
    # Controls for the math cases: neighbours of each refusal that the CPU kernel still takes.
    q, k, v, kw = _call(CPU_FUSED_CASES[case])
    assert predict(q, k, v, **kw) == ("cpu_flash", None)


def test_gqa_with_flag_is_fused_on_cpu():
    q, k, v = _qkv(heads_kv=2)
    assert predict(q, k, v, enable_gqa=True) == ("cpu_flash", None)
    out = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert confirmed_backend(out) == "cpu_flash"


def test_cpu_rule_port_agrees_with_torch_on_a_grid():
    # The port is only worth its reasons if it accepts exactly what torch accepts.
    flags = Flags.current()
    cases = [_call(b) for b, _ in CPU_MATH_CASES.values()] + [_call(b) for b in CPU_FUSED_CASES.values()]
    cases.append((*_qkv(s=0), {}))
    cases.append((*_qkv()[:1], torch.randn(B, H, S, D, dtype=torch.float64), torch.randn(B, H, S, D), {}))
    cases.append((*_qkv(), {"attn_mask": _mask(B, 2, S, S)}))
    for q, k, v, kw in cases:
        choice = torch._fused_sdp_choice(q, k, v, kw.get("attn_mask"), kw.get("dropout_p", 0.0), False)
        port = cpu_flash_refusal(SdpaMeta.of(q, k, v, kw.get("attn_mask"), kw.get("dropout_p", 0.0)), flags)
        assert (port is None) == (choice == int(SDPBackend.FLASH_ATTENTION)), (q.shape, kw, port)


def test_predict_under_compile_returns_compiled_without_a_graph_break():
    q, k, v = _qkv(grad=False)

    def f(q, k, v):
        backend, _ = predict(q, k, v)
        return q * 2 if backend == "compiled" else q * 3

    out = torch.compile(f, backend="eager", fullgraph=True)(q, k, v)
    assert torch.equal(out, q * 2)


# ---- log-sum-exp ---------------------------------------------------------------------------------


def test_lse_brackets_the_exact_max_logit():
    g = torch.Generator().manual_seed(1)
    q = (3 * torch.randn(B, H, S, D, generator=g)).requires_grad_()
    k, v = 3 * torch.randn(B, H, S, D, generator=g), torch.randn(B, H, S, D, generator=g)
    out = F.scaled_dot_product_attention(q, k, v)
    lse = lse_of(out)
    assert lse is not None and lse.shape == (B, H, S)
    logits = (q @ k.transpose(-1, -2)) / math.sqrt(D)
    exact, bound = logits.amax().item(), lse.amax().item()
    assert exact - 1e-4 <= bound <= exact + math.log(S) + 1e-4
    # Row by row too: rowmax <= lse <= rowmax + log(S_k).
    rowmax = logits.amax(-1).detach()
    assert (rowmax - 1e-4 <= lse).all() and (lse <= rowmax + math.log(S) + 1e-4).all()


def test_lse_is_none_for_the_math_path():
    q, k, v = _qkv()
    with sdpa_kernel([SDPBackend.MATH]):
        out = F.scaled_dot_product_attention(q, k, v)
    assert lse_of(out) is None


def test_lse_under_non_reentrant_checkpoint_is_none_and_forces_no_recompute():
    q, k, v = _qkv()
    calls, seen = [0], {}

    def block(q, k, v):
        calls[0] += 1
        out = F.scaled_dot_product_attention(q, k, v)
        if calls[0] == 1:  # where the SDPA wrapper calls it: inside the checkpointed region
            seen["inside"] = lse_of(out)
        return out

    out = checkpoint(block, q, k, v, use_reentrant=False)
    assert calls[0] == 1 and seen["inside"] is None
    assert confirmed_backend(out) == "cpu_flash"
    assert lse_of(out) is None  # after the region: the saved tensor still carries the checkpoint hook
    assert calls[0] == 1
    # Control: reading the saved field directly does recompute, so the counter can see it.
    out.grad_fn._saved_logsumexp  # noqa: B018
    assert calls[0] == 2


# ---- CUDA rule port on fake metadata ----------------------------------------------------------------

SM90 = DeviceProfile(sm=(9, 0), cudnn_version=91002)


def _cuda(q=(B, H, S, 64), k=None, v=None, *, dtype=torch.float16, mask=None, training=False, offset=0, **kw):
    def meta(shape):
        return torch.empty(shape, dtype=dtype, device="meta")

    qt = meta(q)
    if offset:
        qt = torch.empty(q[0] * q[1] * q[2] * q[3] + offset, dtype=dtype, device="meta")[offset:].view(q)
    qm = TensorMeta.of(qt)
    if training:
        qm = TensorMeta(qm.shape, qm.stride, qm.dtype, True, False, qm.storage_offset)
    return SdpaMeta(qm, TensorMeta.of(meta(k or q)), TensorMeta.of(meta(v or k or q)),
                    None if mask is None else TensorMeta.of(torch.empty(mask, device="meta")),
                    device_type="cuda", **kw)


def _refusals(m, p=SM90, flags=None):
    flags = flags or Flags()
    return {"flash": flash_refusal(m, p, flags), "efficient": efficient_refusal(m, p, flags),
            "cudnn": cudnn_refusal(m, p, flags)}


def test_cuda_port_accepts_the_common_case():
    assert _refusals(_cuda()) == {"flash": None, "efficient": None, "cudnn": None}


def test_cuda_head_dim_7_is_refused_by_efficient_and_cudnn_not_flash():
    r = _refusals(_cuda((B, H, S, 7)))
    assert r["flash"] is None
    assert "not a multiple of 8" in r["efficient"] and "not a multiple of 8" in r["cudnn"]


def test_cuda_fp32_is_refused_by_flash_and_cudnn_but_not_efficient():
    r = _refusals(_cuda(dtype=torch.float32))
    assert "float32" in r["flash"] and "float32" in r["cudnn"] and r["efficient"] is None
    # fp32 alignment is 4 on sm80+: head_dim 4 passes, head_dim 6 does not.
    assert efficient_refusal(_cuda((B, H, S, 4), dtype=torch.float32), SM90, Flags()) is None
    assert "multiple of 4" in efficient_refusal(_cuda((B, H, S, 6), dtype=torch.float32), SM90, Flags())


def test_cuda_mask_refuses_flash_only():
    r = _refusals(_cuda(mask=(S, S)))
    assert "attn_mask" in r["flash"] and r["efficient"] is None and r["cudnn"] is None
    assert "attn_mask shape" in cudnn_refusal(_cuda(mask=(B, S, S)), SM90, Flags())


def test_cuda_dropout_resolution_matters_to_cudnn_only():
    r = _refusals(_cuda(dropout_p=0.1))
    assert r["flash"] is None and r["efficient"] is None and "1/16" in r["cudnn"]
    assert cudnn_refusal(_cuda(dropout_p=0.125), SM90, Flags()) is None
    assert "9.11-9.13" in cudnn_refusal(_cuda(dropout_p=0.125), DeviceProfile(cudnn_version=91200), Flags())


def test_cuda_old_gpus_and_dtypes():
    turing = DeviceProfile(sm=(7, 5))
    r = _refusals(_cuda(), turing)
    assert "sm80" in r["flash"] and "sm80" in r["cudnn"] and r["efficient"] is None
    assert "bfloat16" in efficient_refusal(_cuda(dtype=torch.bfloat16), turing, Flags())


def test_cuda_consumer_gpu_training_head_dim_limit():
    ada = DeviceProfile(sm=(8, 9))
    assert "training with head_dim 200" in flash_refusal(_cuda((B, H, S, 200), training=True), ada, Flags())
    assert flash_refusal(_cuda((B, H, S, 200)), ada, Flags()) is None  # inference is fine
    assert flash_refusal(_cuda((B, H, S, 200), training=True), SM90, Flags()) is None
    assert "<= 256" in flash_refusal(_cuda((B, H, S, 320)), SM90, Flags())


def test_cuda_causal_non_square_and_gqa():
    assert "is_causal" in flash_refusal(_cuda((B, H, 4, 64), (B, H, S, 64), is_causal=True), SM90, Flags())
    gqa = _cuda((B, 8, S, 64), (B, 2, S, 64), enable_gqa=True)
    assert _refusals(gqa) == {"flash": None, "efficient": None, "cudnn": None}
    r = _refusals(_cuda((B, 8, S, 64), (B, 2, S, 64)))
    assert all("enable_gqa=False" in x for x in r.values()), r


def test_cuda_unaligned_view_refuses_efficient():
    m = _cuda(offset=1)
    assert m.q.storage_offset == 1
    assert "storage offset" in efficient_refusal(m, SM90, Flags())
    assert flash_refusal(m, SM90, Flags()) is None


def test_cuda_cudnn_head_dim_limits_follow_version_and_backward():
    d256 = _cuda((B, H, S, 256))
    assert "> 128" in cudnn_refusal(d256, SM90, Flags())
    new = DeviceProfile(sm=(9, 0), cudnn_version=92300)
    assert cudnn_refusal(d256, new, Flags()) is None
    assert "backward" in cudnn_refusal(_cuda((B, H, S, 160), training=True), new, Flags())
    assert "sequence length 1" in cudnn_refusal(_cuda((B, H, S, 64), (B, H, 1, 64)), SM90, Flags())


def test_cuda_switches_and_builds():
    off = Flags(flash=False, efficient=False, cudnn=False)
    assert all(r.startswith("disabled") for r in _refusals(_cuda(), SM90, off).values())
    assert "deterministic" in cudnn_refusal(_cuda(), DeviceProfile(deterministic_strict=True), Flags())
    assert "without cuDNN" in cudnn_refusal(_cuda(), DeviceProfile(cudnn_version=None), Flags())
    assert "not cuda" in flash_refusal(SdpaMeta(*[_cuda().q] * 3, device_type="cpu"), SM90, Flags())


def test_explain_on_cpu_names_only_the_cpu_kernel():
    q, k, v = _qkv()
    assert explain(q, k, v) == {"cpu_flash": None}


# ---- a real GPU --------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_prediction_confirmation_and_port_agree():
    dev = "cuda"
    cases = {
        "bf16": dict(dtype=torch.bfloat16),
        "bf16_mask": dict(dtype=torch.bfloat16, mask=True),
        "fp32": dict(dtype=torch.float32),
        "fp16_hd7": dict(dtype=torch.float16, d=7),
        "fp32_hd7": dict(dtype=torch.float32, d=7),
    }
    order = {int(SDPBackend.FLASH_ATTENTION): "flash", int(SDPBackend.EFFICIENT_ATTENTION): "efficient",
             int(SDPBackend.CUDNN_ATTENTION): "cudnn"}
    for name, c in cases.items():
        d = c.get("d", 64)
        q, k, v = (torch.randn(B, H, 128, d, device=dev, dtype=c["dtype"], requires_grad=True) for _ in range(3))
        mask = torch.zeros(128, 128, device=dev, dtype=c["dtype"]) if c.get("mask") else None
        torch.cuda.set_sync_debug_mode("error")
        try:
            backend, reason = predict(q, k, v, attn_mask=mask)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            ran = confirmed_backend(out)
            lse = lse_of(out)
            bound = lse.amax() if lse is not None else None  # stays on the device
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert backend == ran, (name, backend, ran, reason)
        refusals = explain(q, k, v, attn_mask=mask)
        if backend == "math":
            assert all(refusals.values()), (name, refusals)
        else:
            assert reason is None and refusals[backend] is None, (name, refusals)
            earlier = []
            for b in torch._C._get_sdp_priority_order():
                if order.get(b) == backend:
                    break
                earlier.append(order.get(b))
            assert all(refusals[e] for e in earlier if e in refusals), (name, refusals)
            if bound is not None:
                exact = ((q @ k.transpose(-1, -2)) / math.sqrt(d)).float().amax()
                assert exact - 1e-2 <= bound.float() <= exact + math.log(128) + 1e-2


def test_saved_lse_is_normalised_to_heads_by_rows():
    from nanwatch.hooks.measure.sdpa_backend import normalize_lse

    out = torch.zeros(2, 4, 5, 8)  # [B, H, L, E]
    cudnn = torch.arange(40.0).view(2, 4, 5, 1)  # cuDNN's softmax stats: [B, H, L, 1]
    assert normalize_lse(cudnn, out).shape == (2, 4, 5)
    padded = torch.zeros(2, 4, 32)  # CUTLASS pads the query axis to a multiple of 32
    padded[..., 5:] = math.inf
    got = normalize_lse(padded, out)
    assert got.shape == (2, 4, 5) and torch.isfinite(got).all()
    flash = torch.zeros(2, 4, 5)
    assert normalize_lse(flash, out) is flash


@pytest.mark.parametrize("kernel", ["hides", "propagates"])
def test_a_nan_query_is_named_first_whatever_the_kernel_does_with_it(monkeypatch, kernel):
    """CPU flash returns a finite output for a NaN in q on a CPU with AVX-512 and a NaN one with AVX2 alone
    (torch 2.13): both behaviours are emulated around the real kernel, so the test holds on any CPU. The
    query is read before the output, so the first offender is the query either way."""
    pytest.importorskip("transformers")
    from support import tiny_qwen3, token_ids

    import nanwatch
    from nanwatch.hooks.instrument import patching

    real = patching.ORIGINAL_SDPA

    def kernel_that(query, key, value, *args, **kwargs):
        out = real(query, key, value, *args, **kwargs)
        if kernel == "hides":
            return torch.nan_to_num(out, nan=0.0)
        return out + query.amax() * 0  # a NaN anywhere in q reaches every output element

    monkeypatch.setattr(patching, "ORIGINAL_SDPA", kernel_that)
    model = tiny_qwen3("sdpa", vocab_size=64)
    model.model.layers[1].self_attn.q_norm.register_forward_hook(lambda m, a, out: out * math.nan)
    with nanwatch.attach(model, run_id="query-first") as mon:
        # no grad: an op after the kernel would replace its autograd node, and the backend would read as math
        with mon.step(0), torch.no_grad():
            model(input_ids=token_ids(2, 16, vocab=64))
        r = mon.last_report()
    out = next(s for s in r.sites if s.site == "model.layers.1.self_attn" and s.phase == "forward")
    assert (out.nan > 0) == (kernel == "propagates")  # the emulation did what it says
    assert {c.backend for c in r.sdpa} == {"cpu_flash"}, r.sdpa
    assert r.first_offender == "model.layers.1.self_attn.query", r.first_offender
