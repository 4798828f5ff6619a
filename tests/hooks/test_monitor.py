"""The Monitor on a real (tiny) HF Qwen3: injected and real failures, first offender, detach, packing."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from support import TinyNet, step_reports, tiny_qwen3, token_ids
from torch.nn.attention import SDPBackend, sdpa_kernel

import nanwatch
from nanwatch.hooks.instrument import patching

pytest.importorskip("transformers")


def _train_step(model, ids, **kw):
    out = model(input_ids=ids, labels=ids, **kw)
    out.loss.backward()
    return out


def _nonfinite(report):
    return sum(s.nan + s.inf for s in report.sites)


# ---- injected failures: exactly the right step and site ----------------------------------------------

@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_nan_in_one_attention_output_names_that_site_at_that_step(impl):
    model = tiny_qwen3(impl, num_hidden_layers=3)
    target = model.model.layers[1].self_attn
    state = {"step": None}

    def inject(mod, args, out):
        if state["step"] == 3:
            o = out[0].clone()
            o[0, 0, 0] = math.nan
            return (o, *out[1:])
        return None

    if impl == "eager":  # our post-hook measures the module output: inject before it runs
        handle = target.register_forward_hook(inject)
    else:  # SDPA is measured inside the module: poison its input so its output is NaN
        handle = target.q_proj.register_forward_hook(
            lambda m, a, o: o.index_fill(0, torch.tensor([0]), math.nan) if state["step"] == 3 else None)
    reports = []
    with nanwatch.attach(model, run_id="inject") as mon:
        for n in range(5):
            state["step"] = n
            with mon.step(n):
                _train_step(model, token_ids(seed=1))
            reports.append(mon.last_report())
    handle.remove()
    assert [r.step for r in reports] == list(range(5))
    # sdpa: the NaN is in the query; the query is read before the output (a fused kernel may or may not carry
    # a NaN in q to its output, depending on the CPU's ISA), so the first offender is the query either way
    first = "model.layers.1.self_attn.query" if impl == "sdpa" else "model.layers.1.self_attn"
    assert [r.first_offender for r in reports] == [None, None, None, first, None]
    assert reports[3].first_offender_phase == "forward"
    bad = {(s.site, s.phase): s for s in reports[3].sites}
    assert bad[("model.layers.1.self_attn", "forward")].nan > 0
    assert bad[("model.layers.0.self_attn", "forward")].nan == 0


def test_inf_in_logits_names_lm_head():
    model = tiny_qwen3()
    state = {"step": None}

    def inject(mod, args, out):
        if state["step"] == 2:
            out = out.clone()
            out[0, 0, 0] = math.inf
            return out
        return None

    model.lm_head.register_forward_hook(inject)
    with nanwatch.attach(model, run_id="logits") as mon:
        for n in range(3):
            state["step"] = n
            with mon.step(n):
                model(input_ids=token_ids(seed=1))
            r = mon.last_report()
    assert r.step == 2 and r.first_offender == "lm_head" and r.first_offender_phase == "forward"
    lm = next(s for s in r.sites if s.site == "lm_head")
    assert (lm.inf, lm.nan, lm.kind) == (1, 0, "logits")  # calls that held an Inf (and no NaN)
    assert lm.headroom == math.inf  # an overflow already happened: no headroom left


def test_nan_in_backward_gradient_names_the_first_site_it_reaches():
    model = tiny_qwen3(num_hidden_layers=3)
    state = {"step": None}

    def poison_grad(mod, args, out):
        if state["step"] == 1:
            out.register_hook(lambda g: g.index_fill(0, torch.tensor([0]), math.nan))
        return None

    # The gradient entering layer 1's MLP output turns NaN: that site is the first to see it in backward
    # order (lm_head and layer 2 are upstream and stay clean); before the coarse sites existed, it was
    # blamed on model.layers.1.self_attn.
    model.model.layers[1].mlp.register_forward_hook(poison_grad)
    with nanwatch.attach(model, run_id="grad") as mon:
        for n in range(2):
            state["step"] = n
            with mon.step(n):
                _train_step(model, token_ids(seed=1))
            r = mon.last_report()
    assert r.step == 1
    assert (r.first_offender, r.first_offender_phase) == ("model.layers.1.mlp", "backward")
    forward_bad = [s for s in r.sites if s.phase == "forward" and s.nan + s.inf]
    assert forward_bad == []
    back = {s.site: s for s in r.sites if s.phase == "backward"}
    assert back["lm_head"].nan == 0 and back["model.layers.2.self_attn"].nan == 0 and back["model.layers.1"].nan == 0
    assert back["model.layers.1.self_attn"].nan > 0 and back["model.layers.0.self_attn"].nan > 0


def test_healthy_run_of_200_steps_reports_nothing():
    model = tiny_qwen3()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    seen = []
    with nanwatch.attach(model, run_id="healthy", on_report=step_reports(seen), exact_logit_every=50) as mon:
        for n in range(200):
            with mon.step(n):
                _train_step(model, token_ids(seed=n))
                opt.step()
                opt.zero_grad()
        mon.last_report()
    assert [r.step for r in seen] == list(range(200))
    assert all(r.first_offender is None for r in seen)
    assert sum(_nonfinite(r) for r in seen) == 0
    # per layer: input norm, the query the fused kernel read, then attention's output, post norm, MLP, the block;
    # then the final norm and lm_head; the embedding first; everything but the queries also in backward
    per_layer = ["input_layernorm", "self_attn.query", "self_attn", "post_attention_layernorm", "mlp", ""]
    forward = ["model.embed_tokens", *[f"model.layers.{i}.{p}".rstrip(".") for i in range(2) for p in per_layer],
               "model.norm", "lm_head"]
    backward = [x for x in reversed(forward) if not x.endswith(".query")]
    # every site, both passes, every step: a one-off value is named where it is born whatever the step number
    for r in seen:
        assert [(s.site, s.phase) for s in r.sites] == [(x, "forward") for x in forward] + [
            (x, "backward") for x in backward]
    assert all(r.coverage.unmeasured == [] and r.coverage.logits for r in seen)
    assert all((r.coverage.attention_calls, r.coverage.attention_probed) == (2, 2) for r in seen)
    assert [r.step for r in seen if any(lg.exact is not None for lg in r.logits)] == [0, 50, 100, 150]
    assert mon.dropped_reports == 0


# ---- real failures, reproduced ---------------------------------------------------------------------

def test_fp16_eager_qk_overflow_is_caught_at_the_layer():
    model = tiny_qwen3("eager", dtype=torch.float16)
    attn = model.model.layers[0].self_attn
    with torch.no_grad():  # large q/k norms: the unscaled q.k passes fp16's 65504 and becomes inf
        attn.q_norm.weight.fill_(100.0)
        attn.k_norm.weight.fill_(100.0)
    with nanwatch.attach(model, run_id="fp16") as mon:
        with mon.step(0):
            model(input_ids=token_ids(seed=1))
        r = mon.last_report()
    assert r.first_offender == "model.layers.0.self_attn"
    layer0 = next(lg for lg in r.logits if lg.layer == "model.layers.0.self_attn")
    assert layer0.source == "scores" and layer0.bound == math.inf


def test_fully_masked_row_with_minus_inf_mask_in_eager_attention():
    model = tiny_qwen3("eager")
    s = 8
    mask = torch.zeros(2, 1, s, s)
    mask.masked_fill_(~torch.ones(s, s, dtype=torch.bool).tril(), -math.inf)
    mask[1, 0, 3, :] = -math.inf  # one query row sees nothing
    with nanwatch.attach(model, run_id="mask") as mon:
        with mon.step(0):
            model(input_ids=token_ids(s=s, seed=1), attention_mask=mask)
        r = mon.last_report()
    assert r.first_offender == "model.layers.0.self_attn"
    assert r.fingerprints[0].mask == "4d" and r.fingerprints[0].fully_masked_rows == 1
    # with finfo.min instead of -inf the same row is silently the mean of V: finite, but still counted
    mask[mask == -math.inf] = torch.finfo(torch.float32).min
    with nanwatch.attach(model, run_id="mask") as mon:
        with mon.step(1):
            model(input_ids=token_ids(s=s, seed=1), attention_mask=mask)
        r = mon.last_report()
    assert r.first_offender is None and r.fingerprints[0].fully_masked_rows == 1


# ---- backend, logit bound ----------------------------------------------------------------------------

def test_backend_cpu_fused_and_forced_math_with_reason():
    model = tiny_qwen3()
    with nanwatch.attach(model, run_id="backend") as mon:
        with mon.step(0):
            _train_step(model, token_ids(seed=1))
        fused = mon.last_report()
        with mon.step(1), sdpa_kernel([SDPBackend.MATH]):
            _train_step(model, token_ids(seed=1))
        math_r = mon.last_report()
    assert {(c.backend, c.predicted, c.confirmed, c.reason) for c in fused.sdpa} == {
        ("cpu_flash", "cpu_flash", True, None)}
    assert {(c.backend, c.predicted, c.confirmed) for c in math_r.sdpa} == {("math", "math", True)}
    assert all(c.reason and "disabled by sdpa_kernel" in c.reason for c in math_r.sdpa)
    assert all(c.dtype == "float32" and c.calls == 1 for c in math_r.sdpa)


@pytest.mark.parametrize("seq", [16, 64])
def test_lse_bound_brackets_the_exact_max(seq):
    model = tiny_qwen3()
    with torch.no_grad():  # make attention peaky so the bound is tight on some heads
        model.model.layers[1].self_attn.q_norm.weight.mul_(4.0)
    with nanwatch.attach(model, run_id="bound", exact_logit_every=1) as mon:
        with mon.step(0):
            _train_step(model, token_ids(s=seq, seed=1))
        r = mon.last_report()
    assert len(r.logits) == 2
    for lg in r.logits:
        assert lg.source == "lse" and lg.exact is not None
        assert lg.exact <= lg.bound + 1e-4 <= lg.exact + math.log(seq) + 2e-4
        assert len(lg.per_head) == 4


# ---- fingerprint: packing ----------------------------------------------------------------------------

def test_packed_batch_leaks_with_default_use_cache_and_not_without():
    model = tiny_qwen3()
    ids = token_ids(1, 32, seed=1)
    pos = torch.cat([torch.arange(10), torch.arange(22)]).unsqueeze(0)
    results = {}
    for use_cache in (None, False):
        kw = {} if use_cache is None else {"use_cache": use_cache}
        with nanwatch.attach(model, run_id="pack") as mon, warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            with mon.step(0):
                model(input_ids=ids, position_ids=pos, **kw)
            results[use_cache] = mon.last_report()
    leak, fixed = results[None].fingerprints[0], results[False].fingerprints[0]
    assert (leak.packed, leak.plain_causal, leak.cross_doc_leak) == (True, True, True)
    assert any("packed" in w for w in results[None].warnings)
    assert (fixed.packed, fixed.cross_doc_leak, fixed.mask) == (True, False, "packed_block")
    assert not any("packed" in w for w in results[False].warnings)


def test_unpacked_and_left_padded_batches_are_not_packed():
    model = tiny_qwen3()
    mask = torch.ones(2, 16, dtype=torch.long)
    mask[1, :5] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with nanwatch.attach(model, run_id="pad") as mon:
        with mon.step(0):
            model(input_ids=token_ids(seed=1), attention_mask=mask, position_ids=pos)
        r = mon.last_report()
    fp = r.fingerprints[0]
    assert (fp.position_ids, fp.mask, fp.packed, fp.cross_doc_leak) == ("2d", "padding_2d", False, False)


# ---- attach / detach ----------------------------------------------------------------------------------

def _hook_dicts(model):
    names = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
             "_forward_hooks_always_called", "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs")
    return {(n, d): len(getattr(m, d)) for n, m in model.named_modules() for d in names if getattr(m, d)}


def test_detach_leaves_no_hook_and_outputs_bit_identical():
    model = tiny_qwen3("sdpa")
    ids = token_ids(seed=1)
    before = model(input_ids=ids).logits.detach().clone()
    assert _hook_dicts(model) == {}
    with nanwatch.attach(model, run_id="detach") as mon:
        assert _hook_dicts(model) != {}
        assert patching.is_installed()
        with mon.step(0):
            during = model(input_ids=ids).logits.detach().clone()
    after = model(input_ids=ids).logits.detach()
    assert _hook_dicts(model) == {}
    assert not patching.is_installed()
    assert F.softmax is patching.ORIGINAL_SOFTMAX
    assert torch.equal(before, during) and torch.equal(before, after)


def test_attach_twice_is_an_error_and_no_attention_is_a_warning():
    model = tiny_qwen3()
    with nanwatch.attach(model, run_id="twice"):
        with pytest.raises(RuntimeError, match="already has a Monitor"):
            nanwatch.attach(model, run_id="twice")
    mlp = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    with pytest.warns(RuntimeWarning, match="no attention module"):
        mon = nanwatch.attach(mlp, run_id="mlp")
    mon.close()


def test_bad_config_is_a_clear_error():
    with pytest.raises(ValueError, match="run_id"):
        nanwatch.attach(tiny_qwen3(), run_id="has space")
    with pytest.raises(ValueError, match="exact_logit_every"):
        nanwatch.attach(tiny_qwen3(), run_id="ok", exact_logit_every=-1)


def test_watch_covers_any_tensor_and_its_gradient():
    x = torch.randn(8, requires_grad=True)
    model = tiny_qwen3()
    with nanwatch.attach(model, run_id="watch") as mon:
        with mon.step(0):
            y = mon.watch("my.tensor", x * 2)
            (y * torch.tensor([math.nan] + [1.0] * 7)).sum().backward()
        r = mon.last_report()
    sites = {(s.site, s.phase): s for s in r.sites}
    assert sites[("my.tensor", "forward")].nan == 0
    assert sites[("my.tensor", "backward")].nan == 1
    assert (r.first_offender, r.first_offender_phase) == ("my.tensor", "backward")


def test_a_probe_failure_warns_and_training_goes_on(monkeypatch):
    model = tiny_qwen3()

    def boom(*a, **k):
        raise RuntimeError("probe exploded")

    with nanwatch.attach(model, run_id="boom") as mon:
        monkeypatch.setattr("nanwatch.hooks.measure.observations.torch.aminmax", boom)
        with pytest.warns(RuntimeWarning, match="probe exploded"), mon.step(0):
            out = _train_step(model, token_ids(seed=1))
    assert torch.isfinite(out.loss)


def test_first_offender_follows_execution_order_across_micro_batches():
    torch.manual_seed(0)
    model = TinyNet()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TinyNet's attention class is not named *Attention
        mon = nanwatch.attach(model, run_id="order")
    with mon, mon.step(0):
        # micro-batch 1: clean forward, its backward turns NaN (reaching blocks.1 first)
        (model(ids).float().square().mean() * math.nan).backward()
        # micro-batch 2: a NaN in the forward of blocks.0, a site that was registered earlier
        with torch.no_grad():
            model.emb.weight[ids[0, 0]] = math.nan
        model(ids)
    r = mon.last_report()
    assert (r.first_offender, r.first_offender_phase) == ("blocks.1.out", "backward")
    # a block that is its own attention: its output is the block site, its SDPA call "<block>.sdpa"
    forward0 = next(s for s in r.sites if (s.site, s.phase) == ("blocks.0.sdpa", "forward"))
    assert forward0.nan > 0 and forward0.calls == 2
    assert next(s for s in r.sites if (s.site, s.phase) == ("blocks.0", "forward")).kind == "block"


def test_fully_masked_rows_are_counted_in_every_forward_that_sees_the_mask():
    model = tiny_qwen3("sdpa")
    s = 8
    keep = torch.ones(2, 1, s, s, dtype=torch.bool).tril()
    keep[0, 0, 2] = False
    keep[1, 0, 5] = False
    with nanwatch.attach(model, run_id="rows") as mon:
        with mon.step(0), torch.no_grad():
            model(input_ids=token_ids(s=s, seed=1), attention_mask=keep)
            model(input_ids=token_ids(s=s, seed=1), attention_mask=keep)  # same mask object, second forward
        r = mon.last_report()
    assert [(f.forward, f.mask, f.fully_masked_rows) for f in r.fingerprints] == [(0, "4d", 2), (1, "4d", 2)]


@pytest.mark.parametrize("collector", ["http://", "http://host:notaport", "ftp://host"])
def test_a_refused_attach_leaves_the_model_untouched(collector):
    model = tiny_qwen3()
    with pytest.raises(ValueError, match="collector"):
        nanwatch.attach(model, run_id="bad", collector=collector)
    assert _hook_dicts(model) == {} and not patching.is_installed()
    with nanwatch.attach(model, run_id="good") as mon, mon.step(0):  # and it can be attached again
        model(input_ids=token_ids(seed=1))
    assert mon.last_report().first_offender is None


def test_attaching_inside_or_around_an_attached_model_is_refused():
    model = tiny_qwen3()
    with nanwatch.attach(model, run_id="outer"):
        with pytest.raises(RuntimeError, match="already has a Monitor"):
            nanwatch.attach(model.model.layers[0], run_id="inner")
    with nanwatch.attach(model.model, run_id="inner"):
        with pytest.raises(RuntimeError, match="already has a Monitor"):
            nanwatch.attach(model, run_id="outer")
    assert _hook_dicts(model) == {}


def test_bad_watch_arguments_warn_and_keep_the_step_report():
    model = tiny_qwen3()
    with nanwatch.attach(model, run_id="watch-bad") as mon:
        with pytest.warns(RuntimeWarning, match="ignored"), mon.step(0):
            mon.watch("loss", torch.tensor([1.0]), kind="loss")  # not a site kind
            mon.watch("", torch.tensor([math.nan]))  # no name
            mon.watch("ok", torch.tensor([math.nan]))
        r = mon.last_report()
        with pytest.raises(ValueError, match="step numbers"), mon.step(-1):
            pass
    assert r is not None and r.first_offender == "ok"
    assert [s.site for s in r.sites] == ["ok"]


def test_the_ingest_token_comes_from_the_environment_or_a_secret_file(tmp_path, monkeypatch):
    from nanwatch.hooks.config import MonitorConfig, resolve_config

    monkeypatch.delenv("NANWATCH_TOKEN", raising=False)
    (tmp_path / "tok").write_text("s3cret\n")
    monkeypatch.setenv("NANWATCH_TOKEN_FILE", str(tmp_path / "tok"))
    assert MonitorConfig(run_id="t").token is None  # constructing a config reads nothing
    assert resolve_config(MonitorConfig(run_id="t")).token == "s3cret"
    monkeypatch.setenv("NANWATCH_TOKEN", "from-env")  # the variable wins over the file
    assert resolve_config(MonitorConfig(run_id="t")).token == "from-env"
    assert resolve_config(MonitorConfig(run_id="t", token="given")).token == "given"
    monkeypatch.delenv("NANWATCH_TOKEN")
    monkeypatch.setenv("NANWATCH_TOKEN_FILE", str(tmp_path / "missing"))
    MonitorConfig(run_id="t")
    with pytest.raises(ValueError, match="NANWATCH_TOKEN_FILE"):
        resolve_config(MonitorConfig(run_id="t"))


def test_attach_with_a_config_refuses_arguments_that_say_otherwise():
    from nanwatch.hooks.config import MeasureConfig, MonitorConfig

    model = tiny_qwen3()
    cfg = MonitorConfig(run_id="cfg", measure=MeasureConfig(grads=False))
    for kwargs, field in [({"run_id": "other"}, "run_id"), ({"collector": "http://127.0.0.1:1"}, "collector"),
                          ({"grads": True}, "measure.grads")]:
        with pytest.raises(ValueError, match=field):
            nanwatch.attach(model, config=cfg, **kwargs)
    with pytest.raises(TypeError, match="no_such_option"):  # an unknown name, with a config or without
        nanwatch.attach(model, config=cfg, no_such_option=1)
    assert _hook_dicts(model) == {}
    with nanwatch.attach(model, run_id="cfg", config=cfg, grads=False) as mon:  # the same values are fine
        assert (mon.config.run_id, mon.config.measure.grads) == ("cfg", False)
        assert mon.config is not cfg and cfg.forensics.capsule is None  # resolved into a new config, the given one unchanged
    with pytest.raises(TypeError, match="run_id"):
        nanwatch.attach(model)


def test_the_old_names_are_gone():
    """0.1.0 carries no shims (CHANGELOG.md): the pre-release names fail loudly, never silently mean the new."""
    from nanwatch.hooks.config import MonitorConfig

    for old in ({"policy": "off"}, {"replay": False}):
        with pytest.raises(TypeError, match=next(iter(old))):
            MonitorConfig.from_options(run_id="old", **old)
    with pytest.raises(ValueError, match="directive_source"):
        MonitorConfig.from_options(run_id="old", directive_source="sometimes")
    with nanwatch.attach(tiny_qwen3(), run_id="old", directive_source="off") as mon:
        assert not hasattr(mon, "directives")
