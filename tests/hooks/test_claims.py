"""What the popular write-up got wrong, measured on this torch: the facts the README states.

Claim: "3D position_ids force the SDPA math backend, whose BF16 softmax overflows". Measured:
position_ids never reach SDPA; the math backend upcasts half precision to fp32 and uses a safe softmax;
the real overflow is eager attention's fp16 QK matmul, and the real NaN source for masked rows is an
``-inf`` additive mask in eager attention.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import nanwatch

transformers = pytest.importorskip("transformers")


def _qkv(scale: float, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, 2, 8, 16, generator=g) * s for s in (scale, scale, 1.0)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_math_backend_upcasts_half_precision_and_stays_finite(dtype):
    q, k, v = _qkv(80.0)  # unscaled |q.k| ~ 1e5: beyond fp16's 65504
    assert (q @ k.transpose(-1, -2)).abs().max() > 65504
    with sdpa_kernel([SDPBackend.MATH]):
        out = F.scaled_dot_product_attention(q.to(dtype), k.to(dtype), v.to(dtype))
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double())
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=0.05, rtol=0.05)


def test_eager_fp16_qk_overflows_where_math_sdpa_does_not():
    q, k, v = (t.half() for t in _qkv(80.0))
    scores = torch.matmul(q, k.transpose(-1, -2)) * 0.25  # HF eager: matmul first, scale after
    assert torch.isinf(scores).any()
    assert torch.isnan(F.softmax(scores, dim=-1, dtype=torch.float32)).any()


def test_bf16_does_not_overflow_near_13():
    x = torch.full((4, 64), 13.0, dtype=torch.bfloat16)
    assert torch.isfinite(x.exp()).all() and torch.isfinite(F.softmax(x, -1)).all()
    assert float(torch.finfo(torch.bfloat16).max) > 1e38


def test_fully_masked_rows_sdpa_gives_zeros_eager_minus_inf_gives_nan():
    q, k, v = _qkv(1.0)
    keep = torch.ones(8, 8, dtype=torch.bool).tril()
    keep[3] = False
    additive = torch.zeros(8, 8).masked_fill(~keep, -math.inf)
    for backends in ([SDPBackend.MATH], [SDPBackend.FLASH_ATTENTION]):
        with sdpa_kernel(backends):
            for mask in (keep, additive):
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                assert torch.equal(out[0, :, 3], torch.zeros_like(out[0, :, 3]))
    eager = F.softmax(q @ k.transpose(-1, -2) / 4 + additive, dim=-1) @ v
    assert torch.isnan(eager[0, :, 3]).all() and torch.isfinite(eager[0, :, :3]).all()
    finfo_min = torch.zeros(8, 8).masked_fill(~keep, torch.finfo(torch.float32).min)
    eager_min = F.softmax(q @ k.transpose(-1, -2) / 4 + finfo_min, dim=-1) @ v
    torch.testing.assert_close(eager_min[0, :, 3], v[0].mean(dim=-2))  # silently the mean of V


def test_3d_mrope_position_ids_do_not_reach_sdpa_or_change_its_backend():
    torch.manual_seed(0)
    text = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]})
    cfg = transformers.Qwen2VLConfig(text_config=text, vision_config=dict(depth=1, embed_dim=16, hidden_size=32,
                                                                         num_heads=2),
                                     attn_implementation="sdpa", bos_token_id=None, eos_token_id=None)
    model = transformers.Qwen2VLForConditionalGeneration(cfg).to(torch.bfloat16)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    pos2d = torch.arange(16).expand(2, 16)
    pos3d = pos2d.unsqueeze(0).expand(3, 2, 16)
    seen = {}
    with nanwatch.attach(model, run_id="claims") as mon:
        for name, pos in (("2d", pos2d), ("3d", pos3d)):
            with mon.step(len(seen)):
                model(input_ids=ids, position_ids=pos, use_cache=False).logits.float().sum().backward()
            r = mon.last_report()
            seen[name] = ({(c.backend, c.dtype, c.shape) for c in r.sdpa}, r.fingerprints[0].position_ids)
    assert (seen["2d"][1], seen["3d"][1]) == ("2d", "3d_mrope")
    assert seen["2d"][0] == seen["3d"][0]  # same SDPA inputs, same backend: no math fallback
    assert {b for b, _, _ in seen["3d"][0]} == {"cpu_flash"}
