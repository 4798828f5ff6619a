"""nanwatch under torch.compile: attaching must not crash, change results, or add graph breaks.

``backend="aot_eager"`` traces with dynamo and AOTAutograd exactly as inductor would, without the C++
codegen that is too slow for a 2-core CI box. Inside a compiled region the probes step aside
(``torch.compiler.is_compiling()``): eager-only work (backend prediction, grad_fn, saved lse, Python
bookkeeping) would break the graph. Modules that stay eager are still measured.
"""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from support import SMALL, TinyNet, step_reports, tiny_qwen3, token_ids

import nanwatch

pytest.importorskip("transformers")

B, S, V = 2, 16, 128
TOL = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _ids(seed: int = 0) -> torch.Tensor:
    return token_ids(B, S, seed=seed, vocab=V)


def _qwen3(impl: str = "sdpa") -> nn.Module:
    return tiny_qwen3(impl, **SMALL)


def _logits(out) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.logits


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].reshape(-1, V).float(), ids[:, 1:].reshape(-1))


def _train_step(fn, model: nn.Module, ids: torch.Tensor):
    logits = _logits(fn(input_ids=ids))
    _loss(logits, ids).backward()
    return logits.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _assert_same(a, b) -> None:
    (logits_a, grads_a), (logits_b, grads_b) = a, b
    torch.testing.assert_close(logits_a, logits_b, **TOL)
    assert sorted(grads_a) == sorted(grads_b)
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")


def _monitored(model: nn.Module, fn, ids: torch.Tensor, steps: int = 2):
    """Train ``steps`` steps (recompiles happen on the first) under a monitor; last result + report."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nanwatch.attach(model, run_id="compile", exact_logit_every=1) as mon:
            for n in range(steps):
                model.zero_grad(set_to_none=True)
                with mon.step(n):
                    result = _train_step(fn, model, ids)
            report = mon.last_report()
    failed = [str(w.message) for w in caught if "probe failed" in str(w.message)]
    assert failed == [], failed
    assert report is not None and report.step == steps - 1
    return result, report, [str(w.message) for w in caught]


def _tiny_net() -> TinyNet:
    torch.manual_seed(0)
    return TinyNet(vocab=V)


MODELS = {"qwen3_sdpa": lambda: _qwen3("sdpa"), "qwen3_eager": lambda: _qwen3("eager"), "plain": _tiny_net}


@pytest.mark.parametrize("name", ["qwen3_sdpa", "plain"])
def test_full_compile_with_monitor_matches_eager_without(name):
    model = MODELS[name]()
    reference = copy.deepcopy(model)
    ids = _ids()
    expected = _train_step(reference, reference, ids)
    compiled = torch.compile(model, backend="aot_eager")
    got, report, _ = _monitored(model, compiled, ids)
    _assert_same(got, expected)
    # Everything ran inside the graph, so the eager probes stood aside; the attention calls are counted.
    assert report.nonfinite_total == 0 and report.first_offender is None
    assert {(c.site, c.backend, c.dtype, c.calls) for c in report.sdpa} == {
        ("<compiled>", "compiled", "float32", 2)}  # two attention layers, one forward


def _graph_breaks(model: nn.Module, ids: torch.Tensor, *, attached: bool):
    torch._dynamo.reset()
    if not attached:
        out = torch._dynamo.explain(model)(input_ids=ids)
    else:
        with nanwatch.attach(model, run_id="explain") as mon, mon.step(0):
            out = torch._dynamo.explain(model)(input_ids=ids)
    torch._dynamo.reset()
    return out.graph_break_count, out.graph_count, [str(b.reason) for b in out.break_reasons]


@pytest.mark.filterwarnings("ignore:nanwatch. no attention module found:RuntimeWarning")
@pytest.mark.parametrize("name", ["qwen3_sdpa", "qwen3_eager", "plain"])
def test_attaching_adds_no_graph_break(name):
    model = MODELS[name]()
    ids = _ids(1)
    bare = _graph_breaks(model, ids, attached=False)
    watched = _graph_breaks(model, ids, attached=True)
    assert watched == bare
    assert bare[0] == 0, bare  # these models compile to a single graph; the monitor keeps it that way


def test_compiled_layers_eager_head_still_measured():
    model = _qwen3("sdpa")
    reference = copy.deepcopy(model)
    ids = _ids(2)
    expected = _train_step(reference, reference, ids)
    for layer in model.model.layers:
        layer.compile(backend="aot_eager")
    got, r, _ = _monitored(model, model, ids)
    _assert_same(got, expected)
    head = {s.phase: s for s in r.sites if s.site == "lm_head"}
    assert sorted(head) == ["backward", "forward"]
    assert head["forward"].numel == B * S * V and head["forward"].kind == "logits"
    assert head["forward"].nan == head["forward"].inf == head["backward"].nan == 0
    assert head["forward"].amax > 0 and head["backward"].amax > 0
    # the fingerprint runs in the eager root and rotary modules
    assert [fp.position_ids for fp in r.fingerprints] == ["2d"]
    # attention ran inside the compiled layers, where the probes are off
    assert not any(s.kind == "attention" for s in r.sites)


def test_compiled_layers_are_not_misreported_as_no_attention():
    model = _qwen3("sdpa")
    for layer in model.model.layers:
        layer.compile(backend="aot_eager")
    _, r, warned = _monitored(model, model, _ids(3), steps=1)
    assert not any("check is_attention" in w for w in r.warnings + warned)
    assert [(c.backend, c.calls) for c in r.sdpa] == [("compiled", 2)]
    # said plainly: the attention was counted, not measured; the eager head was measured
    assert r.coverage.unmeasured == ["compiled"] and r.coverage.logits
    assert (r.coverage.attention_calls, r.coverage.attention_probed, r.coverage.compiled_calls) == (2, 0, 2)


def test_compiled_eager_attention_is_said_to_be_compiled():
    model = _qwen3("eager")  # no SDPA call to count: the report must still not blame is_attention=
    for layer in model.model.layers:
        layer.compile(backend="aot_eager")
    _, r, warned = _monitored(model, model, _ids(3), steps=1)
    assert not any("check is_attention" in w for w in r.warnings + warned)
    assert any("torch.compile'd code" in w for w in r.warnings)


@pytest.mark.parametrize("attach_to", ["model_then_compile", "compiled_module"])
def test_whole_model_compile_reports_the_non_finite_step(attach_to):
    """Inside the graph nothing is probed, so the step must be caught outside it: parameter gradients
    (hooks run after the compiled backward) and, given the compiled module, the logits at its boundary."""
    model = _qwen3("sdpa")
    ids = _ids(4)
    compiled = torch.compile(model, backend="aot_eager")
    target = compiled if attach_to == "compiled_module" else model
    reports = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.attach(target, run_id="whole", on_report=step_reports(reports)) as mon:
            for n in range(4):
                if n == 2:  # a weight goes NaN (as after a bad update): step 2 is the first non-finite step
                    with torch.no_grad():
                        model.model.layers[0].mlp.down_proj.weight[0, 0] = math.nan
                model.zero_grad(set_to_none=True)
                with mon.step(n):
                    _train_step(compiled, model, ids)
            mon.last_report()
    assert [r.step for r in reports] == [0, 1, 2, 3]
    assert [r.first_offender is None for r in reports] == [True, True, False, False]
    assert reports[2].nonfinite_total > 0
    for r in reports:  # never "clean" for free: the report says the attention ran compiled
        assert "compiled" in r.coverage.unmeasured and r.coverage.compiled_calls == 2
        grads = {s.site for s in r.sites if s.phase == "backward" and s.site.endswith(".weight")}
        assert len(grads) == sum(1 for p in model.parameters() if p.requires_grad)
    head = {(s.site, s.phase) for s in reports[0].sites if s.kind == "logits"}
    if attach_to == "compiled_module":  # the boundary is in eager: logits and their gradient are measured
        assert head == {("lm_head", "forward"), ("lm_head", "backward")} and reports[0].coverage.logits
        # the weight itself when step 2's share of the parameter check read it, else the logits
        assert reports[2].first_offender in ("lm_head", "model.layers.0.mlp.down_proj.weight")
    else:  # the head ran inside the graph: said, not hidden
        assert head == set() and "no_logits" in reports[0].coverage.unmeasured


def test_a_nan_born_in_a_compiled_forward_is_never_said_to_be_born_in_backward():
    """Under torch.compile the forward inside the graph is not probed: a NaN added to an MLP's output is
    first seen in backward (the parameter gradients), which is no evidence of a backward birth."""
    model = _qwen3("sdpa")
    ids = _ids(4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    compiled = torch.compile(model, backend="aot_eager")
    reports = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.attach(model, run_id="compiled-birth", optimizer=opt, on_report=step_reports(reports)) as mon:
            for n in range(3):
                if n == 2:
                    model.model.layers[0].mlp.register_forward_hook(lambda m, a, out: out * math.nan)
                with mon.step(n):
                    _train_step(compiled, model, ids)
                    opt.step()
                    opt.zero_grad(set_to_none=True)
            mon.last_report()
    r = reports[2]
    assert r.first_offender is not None and r.first_offender_phase == "backward", r.first_offender
    assert r.incident is not None and r.incident.cls == "not_classified"
    assert "compiled" in r.incident.note and "born in backward" not in r.incident.note, r.incident.note
