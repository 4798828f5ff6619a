"""Every NaN pinned to the module where it was born, on tiny real HF models (Qwen3, Llama, Qwen3-MoE, and
Qwen3.5 with its Gated DeltaNet layers), sdpa and eager, with one fault per run at a random layer and
step, over several seeds:

| fault born in                              | named                                                   |
|--------------------------------------------|---------------------------------------------------------|
| ``layers.L.mlp`` output                    | ``layers.L.mlp`` (forward)                              |
| ``layers.L.post_attention_layernorm`` out  | ``layers.L.post_attention_layernorm`` (forward)         |
| one weight of ``layers.L.mlp.down_proj``   | the weight itself (the step-start check), or the        |
|                                            | incident's birth ``...down_proj`` with ``weight`` NaN   |
| the embedding output                       | ``model.embed_tokens`` (forward)                        |
| the gradient flowing into ``layers.L.mlp`` | ``layers.L.mlp`` (backward)                             |

A healthy run raises no alarm.
"""

from __future__ import annotations

import json
import math
import random
import time
import urllib.request
import warnings

import pytest
import torch
from support import CollectorProcess, step_reports, tiny_causal_lm, token_ids

import nanwatch

transformers = pytest.importorskip("transformers")

LAYERS, STEPS = 3, 4
_BASE = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)


def _qwen3_5_config(**kw):
    from transformers.models.qwen3_5 import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        **{**kw, "head_dim": 16}, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_conv_kernel_dim=4,
        layer_types=["linear_attention", "full_attention", "linear_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
                         "mrope_section": [2, 1, 1]})


MODELS = {
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {}),
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)),
    "qwen3_5": (_qwen3_5_config, transformers.Qwen3_5ForCausalLM, {}),
}


def _model(name: str, impl: str, seed: int):
    config_cls, model_cls, extra = MODELS[name]
    return tiny_causal_lm(config_cls, model_cls, impl=impl, seed=seed, **_BASE, **extra)


def _poison_output(module) -> None:
    module.register_forward_hook(lambda m, a, out: _nan_like(out) if module.armed else out)


def _nan_like(out):
    if isinstance(out, tuple):
        return (out[0] * math.nan, *out[1:])
    return out * math.nan


def _poison_grad(module) -> None:
    def hook(m, a, out):
        if module.armed:
            t = out[0] if isinstance(out, tuple) else out
            t.register_hook(lambda g: g * math.nan)

    module.register_forward_hook(hook)


def _down_proj(layer):
    mlp = layer.mlp
    return mlp.experts if hasattr(mlp, "experts") else mlp.down_proj


def _nan_weight(module) -> None:
    with torch.no_grad():
        w = module.down_proj if hasattr(module, "experts") or type(module).__name__.endswith("Experts") else module.weight
        if w.dim() == 3:  # fused experts [E, out, in]: one weight in every expert, so some token meets one
            w[:, 0, 0] = math.nan
        else:
            w[0, 0] = math.nan


FAULTS = ["mlp_output", "post_attention_layernorm_output", "down_proj_weight", "embedding_output", "mlp_grad"]


def _run(name: str, impl: str, fault: str, seed: int, **attach):
    rng = random.Random(f"{name}/{impl}/{fault}/{seed}")
    layer, step = rng.randrange(LAYERS), rng.randrange(1, STEPS)
    model = _model(name, impl, seed)
    target = {"mlp_output": model.model.layers[layer].mlp, "mlp_grad": model.model.layers[layer].mlp,
              "post_attention_layernorm_output": model.model.layers[layer].post_attention_layernorm,
              "embedding_output": model.model.embed_tokens}.get(fault)
    if target is not None:
        target.armed = False
        (_poison_grad if fault == "mlp_grad" else _poison_output)(target)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)  # guarded: the replay drills down
    reports = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.attach(model, run_id="loc", optimizer=opt, directive_source="off", on_report=step_reports(reports),
                             **attach) as mon:
            for n in range(STEPS):
                if target is not None:
                    target.armed = n == step
                if fault == "down_proj_weight" and n == step:
                    _nan_weight(_down_proj(model.model.layers[layer]))
                ids = token_ids(seed=seed * 10 + n)
                with mon.step(n):
                    model(input_ids=ids, labels=ids).loss.backward()
                    opt.step()
                    opt.zero_grad()
            mon.last_report()
    return reports, layer, step


CASES = [(name, impl) for name in MODELS for impl in ("sdpa", "eager")]


@pytest.mark.parametrize("name,impl", CASES)
@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("seed", [0, 1])
def test_each_fault_is_pinned_to_the_module_of_birth(name, impl, fault, seed):
    reports, layer, step = _run(name, impl, fault, seed)
    assert all(r.first_offender is None for r in reports[:step]), [r.first_offender for r in reports]
    r = reports[step]
    prefix = f"model.layers.{layer}"
    named = (r.first_offender, r.first_offender_phase)
    if fault == "mlp_output":
        assert named == (f"{prefix}.mlp", "forward")
    elif fault == "post_attention_layernorm_output":
        assert named == (f"{prefix}.post_attention_layernorm", "forward")
    elif fault == "embedding_output":
        assert named == ("model.embed_tokens", "forward")
    elif fault == "mlp_grad":
        assert named == (f"{prefix}.mlp", "backward")
    else:  # the weight: met at its use, at the module holding it (no step-start sweep), then drilled down
        module = f"{prefix}.mlp.experts" if name == "qwen3_moe" else f"{prefix}.mlp.down_proj"
        param = "down_proj" if name == "qwen3_moe" else "weight"
        coarse = f"{prefix}.mlp.experts" if name == "qwen3_moe" else f"{prefix}.mlp"  # MoE experts are sites
        assert named == (coarse, "forward"), named
        inc = r.incident
        assert inc is not None and inc.birth == module and inc.birth_params.get(param, 0) >= 1, inc
        assert inc.cls == "data_mask"  # written by hand after a checked update: no optimizer birth
        assert inc.path and inc.path[0].startswith(prefix)  # then onwards, downstream


@pytest.mark.parametrize("name,impl", CASES)
def test_a_healthy_run_raises_no_alarm(name, impl):
    model = _model(name, impl, 0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reports = []
        with nanwatch.attach(model, run_id="calm", optimizer=opt, on_report=step_reports(reports)) as mon:
            for n in range(STEPS):
                with mon.step(n):
                    ids = token_ids(seed=n)
                    model(input_ids=ids, labels=ids).loss.backward()
                    opt.step()
                    opt.zero_grad()
            mon.last_report()
    for r in reports:
        assert r.first_offender is None and r.incident is None and not r.step_skipped
        assert r.nonfinite_total == 0 and r.coverage.unmeasured == []
        assert r.coverage.params_checked == 0  # no sweep by default: an incident's rerun reads them once
    kinds = {s.kind for s in reports[0].sites}
    assert {"embedding", "block", "mlp", "norm", "attention", "logits"} <= kinds
    if name == "qwen3_moe":  # routers and experts are sites; the routers' logits get a logit max
        assert {"router", "expert"} <= kinds
        routers = [lg for lg in reports[0].logits if lg.source == "router"]
        assert len(routers) == LAYERS and all(math.isfinite(lg.bound) for lg in routers)


@pytest.mark.slow
def test_the_collector_keeps_the_incident_with_its_birth(tmp_path):
    """A NaN weight the step-start check is off for: the drill-down names the module, its NaN weight and
    the path, and the collector keeps all of it as the run's incident event."""
    with CollectorProcess(db_path=tmp_path / "c.db") as c:
        reports, layer, step = _run("qwen3", "sdpa", "down_proj_weight", 0, collector=c.url, param_check_every=0)
        deadline = time.monotonic() + 10
        while True:
            run = json.loads(urllib.request.urlopen(f"{c.url}/v1/runs/loc").read())
            events = [e for e in run["events"] if e["kind"] == "incident"]
            if events or time.monotonic() > deadline:
                break
    prefix = f"model.layers.{layer}.mlp"
    assert reports[step].first_offender == prefix
    assert len(events) == 1, run["events"]
    detail = events[0]["detail"]
    assert detail["birth"] == f"{prefix}.down_proj" and detail["birth_params"] == {"weight": 1}
    assert detail["cls"] == "data_mask" and detail["birth_elements"] > 0
    path = detail["path"]  # the MLP, then its block, every block after it, the final norm, the head
    assert path[:2] == [prefix, f"model.layers.{layer}"] and path[-2:] == ["model.norm", "lm_head"], path


def _one_off_run(fault_steps: set[int], *, grad: bool = False, layer: int = 0, steps: int = 6, **attach):
    """A tiny Qwen3 at nanwatch's defaults, layer ``layer``'s MLP output (``grad``: the gradient into it) NaN at
    ``fault_steps`` only. Returns the reports and, per step, whether the weights moved."""
    model = _model("qwen3", "sdpa", 0)
    mlp = model.model.layers[layer].mlp
    mlp.armed = False
    (_poison_grad if grad else _poison_output)(mlp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    reports, moved = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.attach(model, run_id="one-off", optimizer=opt, directive_source="off",
                             on_report=step_reports(reports), **attach) as mon:
            for n in range(steps):
                mlp.armed = n in fault_steps
                before = [p.detach().clone() for p in model.parameters()]
                ids = token_ids(seed=n)
                with mon.step(n):
                    model(input_ids=ids, labels=ids).loss.backward()
                    opt.step()
                    opt.zero_grad()
                moved.append(any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)))
            mon.last_report()
    assert all(torch.isfinite(p).all() for p in model.parameters())  # the weight guard kept every NaN out
    return reports, moved


def test_every_localising_site_is_read_every_step_in_both_passes():
    reports, _ = _one_off_run(set())
    assert [r.step for r in reports] == list(range(6))
    for r in reports:
        kinds = {s.kind for s in r.sites}
        assert {"embedding", "attention", "logits", "mlp", "norm", "block"} <= kinds, (r.step, kinds)
        backward = {s.kind for s in r.sites if s.phase == "backward"}
        assert backward == {"embedding", "attention", "logits", "mlp", "norm", "block"}, (r.step, backward)
        assert r.first_offender is None and not r.step_skipped
    assert len({r.coverage.sites for r in reports}) == 1  # no step reads less than another


# Every step number of the old rotation (one step in four read the coarse sites), and the first step after it:
# a one-off value is named at its birth whichever step it happens on.
@pytest.mark.parametrize("step", [1, 2, 3, 4, 5])
def test_a_one_off_nan_born_in_an_mlp_is_named_there_on_any_step(step):
    reports, moved = _one_off_run({step})
    r = reports[step]
    assert (r.first_offender, r.first_offender_phase) == ("model.layers.0.mlp", "forward"), r.first_offender
    assert r.step_skipped and not moved[step]
    assert all(x.first_offender is None for x in reports if x.step != step)


@pytest.mark.parametrize("step", [1, 2, 3, 4, 5])
def test_a_one_off_nan_born_in_backward_is_named_at_its_site_on_any_step(step):
    reports, moved = _one_off_run({step}, grad=True, layer=1)
    r = reports[step]
    assert (r.first_offender, r.first_offender_phase) == ("model.layers.1.mlp", "backward"), r.first_offender
    assert r.step_skipped and not moved[step]
