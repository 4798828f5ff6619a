"""nanwatch on real HF models built from tiny configs (no downloads): Qwen3, Qwen3.5 (hybrid Gated
DeltaNet + full attention), Qwen2-VL's text path with mRoPE, Llama, and a plain module calling SDPA.

Each model runs one forward+backward step under ``attach(exact_logit_every=1)``; the tests read the
StepReport: exact site FQNs in execution order, zero non-finite values, the SDPA backend that ran, the
attention-logit figure, and the input fingerprint. Models are module-scoped fixtures (built once).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn as nn
from support import SMALL, Mixer, TinyNet, tiny_causal_lm, token_ids

import nanwatch

transformers = pytest.importorskip("transformers")

B, S, V = 2, 16, 128
_TINY = dict(vocab_size=V, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, **SMALL)
LAYERS = ("model.layers.0.self_attn", "model.layers.1.self_attn")


def _ids(seed: int = 0) -> torch.Tensor:
    return token_ids(B, S, seed=seed, vocab=V)


def _step(model: nn.Module, loss=None, **inputs):
    """One monitored forward+backward; returns (report, nanwatch warnings)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nanwatch.attach(model, run_id="t", exact_logit_every=1, coarse=False) as mon:
            with mon.step(0):
                out = model(**inputs)
                (out.loss if loss is None else loss(out)).backward()
            report = mon.last_report()
    model.zero_grad(set_to_none=True)
    return report, [str(w.message) for w in caught if "nanwatch" in str(w.message)]


def _order(report) -> list[tuple[str, str]]:
    return [(s.site, s.phase) for s in report.sites]


def _expected_order(attn_sites, head="lm_head", fused=()) -> list[tuple[str, str]]:
    """Forward in execution order, then backward in reverse (autograd runs it back to front). A fused
    SDPA site's query is read too, right before its output (forward only): a call's input comes first."""
    fwd = [(s, "forward") for s in attn_sites] + [(head, "forward")]
    queries = [(s + ".query", "forward") for s in attn_sites if s in fused]
    order = [x for site in fwd for x in [q for q in queries if q[0] == site[0] + ".query"] + [site]]
    return order + [(s, "backward") for s, _ in reversed(fwd)]


def _assert_all_finite(report) -> None:
    assert report.sites, "no site was measured"
    assert [(s.site, s.phase, s.nan, s.inf) for s in report.sites if s.nan or s.inf] == []
    assert report.nonfinite_total == 0
    assert report.first_offender is None and report.first_offender_phase is None
    for s in report.sites:
        assert s.numel > 0 and math.isfinite(s.amax) and s.amax > 0, s
        assert 0 < s.headroom < 1e-6, s  # fp32 activations of a fresh model are far from finfo.max


def _assert_cpu_flash(report, sites) -> None:
    by_site = {c.site: c for c in report.sdpa}
    assert sorted(by_site) == sorted(sites)
    for site in sites:
        c = by_site[site]
        assert (c.backend, c.predicted, c.confirmed, c.dtype, c.calls) == ("cpu_flash", "cpu_flash", True,
                                                                           "float32", 1), c
        assert c.reason is None
        assert c.shape.startswith(f"q[{B}, ") and c.shape.endswith(" causal"), c.shape


def _logit_bound_brackets_exact(stat, n_keys: int = S) -> None:
    # rowmax <= lse <= rowmax + log(n_valid): the saved-lse bound brackets the exact maximum.
    assert stat.source == "lse" and stat.exact is not None
    assert stat.exact - 1e-4 <= stat.bound <= stat.exact + math.log(n_keys) + 1e-4, stat
    assert stat.per_head is not None and len(stat.per_head) == _TINY["num_attention_heads"]


def _fingerprint(report, position_ids: str):
    assert len(report.fingerprints) == 1
    fp = report.fingerprints[0]
    assert fp.forward == 0 and fp.position_ids == position_ids, fp
    assert fp.fully_masked_rows == 0 and not fp.packed and not fp.cross_doc_leak, fp
    return fp


# ---- Qwen3 -----------------------------------------------------------------------------------------
def _tiny(model_cls, config_cls, impl: str) -> nn.Module:
    model = tiny_causal_lm(config_cls, model_cls, impl=impl, **_TINY)
    assert model.config._attn_implementation == impl
    return model


def _qwen3(impl: str) -> nn.Module:
    return _tiny(transformers.Qwen3ForCausalLM, transformers.Qwen3Config, impl)


@pytest.fixture(scope="module")
def qwen3_reports():
    """Same weights, both attention paths; ``position_ids`` left to HF (it builds them internally)."""
    ids = _ids()
    sdpa = _qwen3("sdpa")
    eager = _qwen3("eager")
    eager.load_state_dict(sdpa.state_dict())
    return {impl: _step(m, input_ids=ids, labels=ids)[0] for impl, m in (("sdpa", sdpa), ("eager", eager))}


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_qwen3_sites_in_execution_order_and_finite(qwen3_reports, impl):
    r = qwen3_reports[impl]
    assert _order(r) == _expected_order(LAYERS, fused=LAYERS if impl == "sdpa" else ())
    _assert_all_finite(r)
    kinds = {(s.site, s.phase): s.kind for s in r.sites}
    assert kinds[("lm_head", "forward")] == kinds[("lm_head", "backward")] == "logits"
    assert {kinds[(site, "forward")] for site in LAYERS} == {"attention"}
    head = next(s for s in r.sites if s.site == "lm_head" and s.phase == "forward")
    assert head.numel == B * S * V and head.dtype == "float32" and head.calls == 1


def test_qwen3_sdpa_backend_recorded(qwen3_reports):
    _assert_cpu_flash(qwen3_reports["sdpa"], LAYERS)


def test_qwen3_eager_runs_no_sdpa(qwen3_reports):
    assert qwen3_reports["eager"].sdpa == []


def test_qwen3_logit_figures(qwen3_reports):
    lse = {s.layer: s for s in qwen3_reports["sdpa"].logits}
    scores = {s.layer: s for s in qwen3_reports["eager"].logits}
    assert sorted(lse) == sorted(scores) == sorted(LAYERS)
    for layer in LAYERS:
        _logit_bound_brackets_exact(lse[layer])
        # eager: the softmax input is the exact score matrix; same weights, so the same maximum
        assert scores[layer].source == "scores"
        assert scores[layer].bound == pytest.approx(scores[layer].exact)
        assert scores[layer].exact == pytest.approx(lse[layer].exact, rel=1e-4, abs=1e-5)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_qwen3_fingerprint_internal_position_ids(qwen3_reports, impl):
    fp = _fingerprint(qwen3_reports[impl], "2d")
    assert fp.mask == "none"
    assert fp.plain_causal is (impl == "sdpa")  # HF's sdpa path passes is_causal=True with no mask


def test_qwen3_explicit_packed_position_ids_flag_the_leak():
    model = _qwen3("sdpa")
    ids = _ids(1)
    pos = torch.cat([torch.arange(S // 2), torch.arange(S // 2)]).expand(B, S)  # two documents per row
    r, _ = _step(model, input_ids=ids, labels=ids, position_ids=pos)
    assert len(r.fingerprints) == 1
    fp = r.fingerprints[0]
    assert (fp.position_ids, fp.packed, fp.plain_causal, fp.cross_doc_leak) == ("2d", True, True, True)
    assert any("documents attend across boundaries" in w for w in r.warnings)


def test_qwen3_nan_weight_names_the_first_offender():
    model = _qwen3("eager")
    with torch.no_grad():
        model.model.layers[1].self_attn.q_proj.weight[0, 0] = float("nan")
    ids = _ids()
    r, _ = _step(model, input_ids=ids, labels=ids)
    assert (r.first_offender, r.first_offender_phase) == ("model.layers.1.self_attn", "forward")
    bad = {(s.site, s.phase) for s in r.sites if s.nan}
    assert ("model.layers.0.self_attn", "forward") not in bad
    assert {("model.layers.1.self_attn", "forward"), ("lm_head", "forward")} <= bad


# ---- Llama -----------------------------------------------------------------------------------------
def _llama(impl: str) -> nn.Module:
    return _tiny(transformers.LlamaForCausalLM, transformers.LlamaConfig, impl)


@pytest.fixture(scope="module")
def llama_models():
    return {impl: _llama(impl) for impl in ("sdpa", "eager")}


@pytest.fixture(scope="module")
def llama_reports(llama_models):
    ids = _ids(2)
    pos = torch.arange(S).expand(B, S)
    return {(impl, how): _step(m, input_ids=ids, labels=ids, **kw)[0]
            for impl, m in llama_models.items()
            for how, kw in (("internal", {}), ("explicit", {"position_ids": pos}))}


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_llama_sites_backend_and_logits(llama_reports, impl):
    r = llama_reports[(impl, "explicit")]
    assert _order(r) == _expected_order(LAYERS, fused=LAYERS if impl == "sdpa" else ())
    _assert_all_finite(r)
    stats = {s.layer: s for s in r.logits}
    assert sorted(stats) == sorted(LAYERS)
    if impl == "sdpa":
        _assert_cpu_flash(r, LAYERS)
        for layer in LAYERS:
            _logit_bound_brackets_exact(stats[layer])
    else:
        assert r.sdpa == []
        assert {s.source for s in stats.values()} == {"scores"}


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_llama_fingerprint_explicit_position_ids(llama_reports, impl):
    _fingerprint(llama_reports[(impl, "explicit")], "2d")


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_llama_fingerprint_internal_position_ids(llama_reports, impl):
    # LlamaModel calls self.rotary_emb(hidden_states, position_ids=position_ids): by keyword
    _fingerprint(llama_reports[(impl, "internal")], "2d")


# ---- Qwen3.5: hybrid Gated DeltaNet (linear attention) + full attention ------------------------------
@pytest.fixture(scope="module")
def qwen3_5_report():
    from transformers.models.qwen3_5 import Qwen3_5TextConfig

    torch.manual_seed(0)
    cfg = Qwen3_5TextConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "mrope_section": [2, 1, 1]},
        attn_implementation="sdpa")
    model = transformers.Qwen3_5ForCausalLM(cfg)
    assert type(model.model.layers[0].linear_attn).__name__ == "Qwen3_5GatedDeltaNet"
    assert type(model.model.layers[1].self_attn).__name__ == "Qwen3_5Attention"
    ids = _ids(3)
    return _step(model, input_ids=ids, labels=ids)[0]


def test_qwen3_5_both_kinds_of_attention_site(qwen3_5_report):
    r = qwen3_5_report
    assert _order(r) == _expected_order(["model.layers.0.linear_attn", "model.layers.1.self_attn"],
                                        fused=["model.layers.1.self_attn"])
    _assert_all_finite(r)
    assert {s.kind for s in r.sites if s.site != "lm_head"} == {"attention"}


def test_qwen3_5_sdpa_and_logits_only_on_full_attention(qwen3_5_report):
    r = qwen3_5_report
    _assert_cpu_flash(r, ["model.layers.1.self_attn"])
    assert [s.layer for s in r.logits] == ["model.layers.1.self_attn"]
    stat = r.logits[0]
    assert stat.source == "lse" and stat.exact is not None
    assert stat.exact - 1e-4 <= stat.bound <= stat.exact + math.log(S) + 1e-4


def test_qwen3_5_fingerprint(qwen3_5_report):
    # Qwen3.5's text model expands position ids to [4, B, S] and hands rotary the 3 mRoPE rows
    fp = _fingerprint(qwen3_5_report, "3d_mrope")
    assert fp.plain_causal


# ---- Qwen2-VL text path, mRoPE -----------------------------------------------------------------------
VL_LAYERS = ("model.language_model.layers.0.self_attn", "model.language_model.layers.1.self_attn")


@pytest.fixture(scope="module")
def qwen2_vl():
    torch.manual_seed(0)
    text = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]})
    vision = dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2)
    cfg = transformers.Qwen2VLConfig(text_config=text, vision_config=vision, attn_implementation="sdpa",
                                     bos_token_id=None, eos_token_id=None)
    return transformers.Qwen2VLForConditionalGeneration(cfg)


@pytest.mark.parametrize("how", ["explicit_3d", "internal"])
def test_qwen2_vl_text_path_mrope(qwen2_vl, how):
    ids = _ids(4)
    kw = {"position_ids": torch.arange(S).view(1, 1, S).expand(3, B, S)} if how == "explicit_3d" else {}
    r, _ = _step(qwen2_vl, input_ids=ids, labels=ids, **kw)
    assert _order(r) == _expected_order(VL_LAYERS, fused=VL_LAYERS)  # the vision tower did not run: no visual.* site
    _assert_all_finite(r)
    _assert_cpu_flash(r, VL_LAYERS)
    assert sorted(s.layer for s in r.logits) == sorted(VL_LAYERS)
    fp = _fingerprint(r, "3d_mrope")
    assert fp.plain_causal


# ---- a plain module calling F.scaled_dot_product_attention itself (support.Mixer) ------------


def _mean_square(out: torch.Tensor) -> torch.Tensor:
    return out.float().pow(2).mean()


def test_plain_module_sdpa_site_is_the_callers_fqn():
    torch.manual_seed(0)
    r, warned = _step(TinyNet(vocab=V), loss=_mean_square, input_ids=_ids(5))
    assert any("no attention module found by class name" in w for w in warned)
    assert _order(r) == [("blocks.0.query", "forward"), ("blocks.0", "forward"), ("blocks.1.query", "forward"),
                         ("blocks.1", "forward"), ("blocks.1", "backward"), ("blocks.0", "backward")]
    _assert_all_finite(r)
    _assert_cpu_flash(r, ["blocks.0", "blocks.1"])
    for stat in r.logits:
        _logit_bound_brackets_exact(stat)
    assert sorted(s.layer for s in r.logits) == ["blocks.0", "blocks.1"]
    fp = _fingerprint(r, "none")
    assert fp.plain_causal


def test_plain_module_as_root_still_reports():
    """The root's FQN is "": the site is named by its class instead (an empty site would fail validation
    on the reporter thread and lose the whole step's report)."""
    torch.manual_seed(0)
    r, _ = _step(Mixer(), loss=_mean_square, x=torch.randn(B, S, 32))
    assert r is not None
    assert _order(r) == [("Mixer.query", "forward"), ("Mixer", "forward"), ("Mixer", "backward")]
    _assert_cpu_flash(r, ["Mixer"])
    _assert_all_finite(r)
