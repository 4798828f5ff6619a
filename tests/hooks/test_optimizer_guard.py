"""Every optimizer guarded, and a NaN born in the optimizer update named (#17, items 3 and 4).

Non-fused SGD and AdamW, passed to ``attach`` or found by discovery (no optimizer passed): a step whose
forward went NaN leaves every weight finite, and the next clean step trains. ``guard="off"`` lets the NaN
into the weights (so these tests can fail). A pure-fp16 AdamW writes NaN into its parameters at step 0
(eps underflow): the report names the update (site kind ``param``, phase ``optimizer``), the incident is of
class ``optimizer`` at step 0, and the local rules never offer ``fp32``."""

from __future__ import annotations

import contextlib
import logging
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from support import TinyNet, tiny_qwen3, token_ids

import nanwatch
from nanwatch.hooks.remedies.weight_guard import guard_of

pytest.importorskip("transformers")

K = 2  # the step whose forward goes NaN


def _model(dtype=None):
    return tiny_qwen3("eager", dtype=dtype, vocab_size=64, use_cache=False)


def _nan_at(model, step_of, k: int = K) -> None:
    """Layer 0's MLP output turns NaN in the forward of step ``k`` (a bad batch)."""
    model.model.layers[0].mlp.register_forward_hook(lambda m, a, out: out * math.nan if step_of() == k else out)


def _make(kind: str, model):
    if kind in ("sgd", "sgd_fused"):
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, fused=kind == "sgd_fused" or None)
    if kind == "lbfgs":
        return torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3)
    return torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=kind == "adamw_foreach" or None,
                             fused=kind == "adamw_fused" or None)


def _run(kind: str, *, passed: bool, steps: int = K + 2, k: int = K, **options):
    """Train ``steps`` steps with a NaN forward at step ``k``; per step: (report, weights finite, weights
    moved)."""
    model = _model()
    now = [0]
    _nan_at(model, lambda: now[0], k)
    opt = _make(kind, model)
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.attach(model, run_id="g", optimizer=opt if passed else None, directive_source="off",
                             **options) as mon:
            for n in range(steps):
                now[0] = n
                before = [p.detach().clone() for p in model.parameters()]
                ids = token_ids(2, 16, seed=n, vocab=64)
                with mon.step(n):
                    model(input_ids=ids, labels=ids).loss.backward()
                    opt.step()
                    opt.zero_grad()
                r = mon.last_report()
                rows.append((r, all(bool(torch.isfinite(p).all()) for p in model.parameters()),
                             any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))))
            guarded = guard_of(opt) is not None
    assert guard_of(opt) is None and "step" not in opt.__dict__  # removed on close, the optimizer as it was
    return rows, guarded


@pytest.mark.parametrize("passed", [True, False], ids=["passed", "found"])
@pytest.mark.parametrize("kind", ["sgd", "adamw", "adamw_foreach"])
def test_a_non_fused_optimizer_keeps_a_nan_step_out_of_the_weights(kind, passed):
    rows, guarded = _run(kind, passed=passed)
    assert guarded
    assert [finite for _, finite, _ in rows] == [True] * len(rows)
    assert [r.step_skipped for r, _, _ in rows] == [False] * K + [True, False]
    assert [moved for _, _, moved in rows] == [True] * K + [False, True]  # the next clean step trains
    assert rows[K][0].first_offender == "model.layers.0.mlp"


@pytest.mark.parametrize("kind", ["sgd", "adamw_fused"])
def test_a_found_optimizer_whose_first_step_is_nan_drops_that_steps_gradients(kind):
    # found inside its first step: that call is decided by the discovery hook, the later ones by the guard
    rows, guarded = _run(kind, passed=False, k=0, steps=2)
    assert guarded
    assert [(r.step_skipped, finite, moved) for r, finite, moved in rows] == [(True, True, False), (False, True, True)]


@pytest.mark.parametrize("passed", [True, False], ids=["passed", "found"])
def test_guard_off_lets_the_nan_into_the_weights(passed):
    rows, guarded = _run("adamw", passed=passed, guard="off")
    assert not guarded
    assert [finite for _, finite, _ in rows] == [True] * K + [False, False]
    r = rows[K][0]
    # the forward's NaN stays the first offender; the update's is reported after it, in execution order
    assert (r.first_offender, r.first_offender_phase) == ("model.layers.0.mlp", "forward")
    assert any(s.kind == "param" and s.phase == "optimizer" and (s.nan or s.inf) for s in r.sites)
    assert r.incident is None or r.incident.cls != "optimizer"


@pytest.mark.parametrize("every", [None, 16], ids=["cpu-default", "amortised"])
def test_pure_fp16_adamw_names_the_optimizer_update_at_step_0_and_offers_no_fp32(every):
    # A real optimizer-born NaN, no injection: in fp16, eps=1e-8 rounds to 0 and exp_avg_sq underflows
    # where gradients are small, so AdamW divides 0/0 or x/0 at its first step (checked below: the
    # forward and backward of step 0 are finite, the weights after it are not). Amortised (an
    # accelerator's default, forced here), the check still reads the first step.
    model = _model(torch.float16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-8)
    reports, modes = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.attach(model, run_id="fp16", optimizer=opt, directive_source="local",
                             optimizer_check_every=every) as mon:
            for n in range(5):
                ids = token_ids(2, 16, seed=n, vocab=64)
                with mon.step(n):
                    modes.append(mon.directive_state.mode)
                    model(input_ids=ids, labels=ids).loss.backward()
                    opt.step()
                    opt.zero_grad()
                reports.append(mon.last_report())
            modes.append(mon.directive_state.mode)
    r0 = reports[0]
    assert not any(p.isfinite().all() for p in model.parameters())  # the update really wrote NaN/Inf
    assert not any((s.nan or s.inf) and s.phase != "optimizer" for s in r0.sites)  # forward/backward finite
    bad = [s for s in r0.sites if s.kind == "param" and s.phase == "optimizer" and (s.nan or s.inf)]
    assert 0 < len(bad) <= 16
    assert (r0.first_offender, r0.first_offender_phase) == (bad[0].site, "optimizer")
    inc = r0.incident
    assert (inc.cls, inc.step, inc.phase, inc.birth_kind, inc.birth) == ("optimizer", 0, "optimizer", "param",
                                                                          bad[0].site)
    n_bad = sum(1 for p in model.parameters() if not p.isfinite().all())
    assert len(inc.birth_params) == n_bad and f"{n_bad} parameters" in inc.note and "AdamW" in inc.note
    assert any("parameters non-finite after AdamW.step()" in w for w in r0.warnings)
    assert not nanwatch.policy.precision_helps(r0)
    # later steps start from non-finite weights: a parameter is named first (never the attention it poisons)
    assert all(r.first_offender_phase == "forward" and any(s.site == r.first_offender and s.kind == "param"
                                                           for s in r.sites) for r in reports[1:])
    assert all(r.incident is None for r in reports[1:])  # one incident per run
    assert modes == ["none"] * len(modes)  # the local rules never offered fp32


def test_a_carried_value_is_dropped_once_the_weights_are_restored():
    model = _model(torch.float16)
    good = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.attach(model, run_id="restore", optimizer=opt, directive_source="off",
                             param_check_every=0) as mon:
            ids = token_ids(2, 16, seed=0, vocab=64)
            with mon.step(0):
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad()
            assert mon.last_report().first_offender_phase == "optimizer"
            model.load_state_dict(good)  # the user restores the weights (and stops stepping the optimizer)
            with mon.step(1), torch.no_grad():
                model(input_ids=ids)
            assert mon.last_report().first_offender is None


def test_a_grad_scaler_with_a_non_fused_optimizer_skips_on_either_flag():
    torch.manual_seed(0)
    model = TinyNet(vocab=64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    skipped, scales = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.attach(model, run_id="scaler", optimizer=opt, grads=False) as mon:
            for n in range(3):
                before = [p.detach().clone() for p in model.parameters()]
                with mon.step(n):
                    loss = F.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
                    if n == 1:
                        mon.watch("loss", loss * math.nan)  # nanwatch's flag; the scaler's gradients are finite
                    boost = 1e38 if n == 2 else 1.0  # the scaler's flag: scaled gradients overflow
                    scaler.scale(loss * boost).backward()
                    scaler.step(opt)
                    scaler.update()
                opt.zero_grad()
                skipped.append(all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)))
                scales.append(scaler.get_scale())
    assert skipped == [False, True, True]
    assert scales == [2.0**16, 2.0**16, 2.0**15]  # the scaler's bookkeeping: only its own overflow halves it


def test_other_models_optimizers_are_left_alone_and_nothing_is_guarded_twice():
    model, other = _model(), TinyNet(vocab=64)
    opt, other_opt = _make("adamw", model), torch.optim.SGD(other.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.attach(model, run_id="a", optimizer=opt) as mon, nanwatch.attach(other, run_id="b",
                                                                                       guard="off") as mon_b:
            g = guard_of(opt)
            assert mon.guard(opt) is g  # an optimizer is guarded once
            assert mon_b.guard(opt) is g  # by whichever Monitor guarded it first
            ids = token_ids(2, 16, seed=0, vocab=64)
            with mon.step(0):
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
            with mon_b.step(0):
                F.cross_entropy(other(ids).flatten(0, 1), ids.flatten()).backward()
                other_opt.step()
            assert guard_of(other_opt) is None and "step" not in other_opt.__dict__


def test_an_lr_scheduler_made_after_the_guard_wraps_it_and_close_restores_it():
    model = _model()
    opt = _make("adamw", model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # "optimizer.step() has been overridden": none
        with nanwatch.attach(model, run_id="sched", optimizer=opt) as mon:
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
            ids = token_ids(2, 16, seed=0, vocab=64)
            with mon.step(0):
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                sched.step()
            assert mon.last_report().step_skipped is False
        opt.step()  # the scheduler's wrapper still works, passing through the removed guard
    assert opt.param_groups[0]["lr"] == pytest.approx(5e-4)


def test_without_any_optimizer_it_says_so_loudly():
    model = _model()
    with nanwatch.attach(model, run_id="none") as mon:
        with pytest.warns(RuntimeWarning, match="no torch.optim optimizer stepped this model's parameters"):
            for n in range(8):
                ids = token_ids(2, 16, seed=n, vocab=64)
                with mon.step(n):
                    model(input_ids=ids, labels=ids).loss.backward()
                    with torch.no_grad():
                        for p in model.parameters():  # a hand-written update nanwatch cannot see
                            p -= 1e-3 * p.grad
                            p.grad = None


# ---- optimizer.step(closure): the forward and backward run inside step() (#26, finding 1) ----------------

CLOSURE_KINDS = ["adamw_fused", "adamw", "sgd_fused", "sgd", "lbfgs"]


def _run_closure(kind: str, *, passed: bool | None, k: int = K, steps: int = K + 2, skip: frozenset = frozenset(),
                 caplog=None):
    """Train with ``opt.step(closure)``, the closure's forward NaN at step ``k``; ``passed=None``: no
    nanwatch at all, the steps in ``skip`` not stepped (the reference run). Per step: a row of (report,
    closure calls, the loss step() returned is the closure's first, weights finite, weights moved), and the
    weights at the end."""
    model = _model()
    now = [0]
    _nan_at(model, lambda: now[0], k)
    opt = _make(kind, model)
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mon = None if passed is None else nanwatch.attach(model, run_id="closure", directive_source="off",
                                                          optimizer=opt if passed else None)
        for n in range(steps):
            now[0] = n
            before = [p.detach().clone() for p in model.parameters()]
            ids = token_ids(2, 16, seed=n, vocab=64)
            losses = []

            def closure(ids=ids, losses=losses):
                opt.zero_grad()
                loss = model(input_ids=ids, labels=ids).loss
                loss.backward()
                losses.append(loss)
                return loss

            with mon.step(n) if mon is not None else contextlib.nullcontext():
                out = None if n in skip else opt.step(closure)
            rows.append({"report": mon.last_report() if mon is not None else None, "calls": len(losses),
                         "returned": out is not None and out is losses[0],
                         "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
                         "moved": any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))})
        if mon is not None:
            mon.close()
    return rows, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("passed", [True, False], ids=["passed", "found"])
@pytest.mark.parametrize("kind", CLOSURE_KINDS)
def test_a_closure_step_is_decided_on_what_its_forward_and_backward_saw(kind, passed, caplog):
    caplog.set_level(logging.WARNING, logger="nanwatch")
    rows, weights = _run_closure(kind, passed=passed)
    ref, ref_weights = _run_closure(kind, passed=None, skip=frozenset({K}))  # no nanwatch, step K not taken
    assert [r["finite"] for r in rows] == [True] * len(rows)
    assert [r["report"].step_skipped for r in rows] == [False] * K + [True, False]
    assert [r["moved"] for r in rows] == [True] * K + [False, True]  # the next clean step trains
    assert all(r["returned"] for r in rows)  # step() returns the closure's loss, skipped or not
    # the closure ran as often as the optimizer calls it (LBFGS: several times), once at the skipped step
    assert [r["calls"] for r in rows] == [1 if n == K else ref[n]["calls"] for n in range(len(rows))]
    assert kind != "lbfgs" or all(r["calls"] > 1 for n, r in enumerate(rows) if n != K)
    # the same training as a loop that did not take step K at all
    assert all(torch.equal(a, b) for a, b in zip(weights, ref_weights, strict=True))
    assert rows[K]["report"].first_offender == "model.layers.0.mlp"
    lines = [r.getMessage() for r in caplog.records if f"step {K} (train): non-finite at" in r.getMessage()]
    assert len(lines) == 1 and "step skipped (weights not updated)" in lines[0], lines


@pytest.mark.parametrize("kind", ["sgd", "adamw_fused", "lbfgs"])
def test_a_found_optimizer_whose_first_closure_step_is_nan_is_skipped(kind):
    # found inside its first step, before step() calls the closure: the discovery hook runs it and decides
    rows, _ = _run_closure(kind, passed=False, k=0, steps=2)
    assert [(r["report"].step_skipped, r["finite"], r["moved"], r["returned"]) for r in rows] == [
        (True, True, False, True), (False, True, True, True)]
    assert rows[0]["calls"] == 1


# ---- what the optimizer check says about a parameter (#26, finding 7) -----------------------------------

BAD = "model.layers.0.mlp.down_proj.weight"


def test_a_parameter_already_non_finite_before_a_skipped_step_is_told_as_such_once_per_episode(caplog):
    """Fused SGD (its post-step check runs on a skipped step too: the kernel skipped, the call did not).
    Episode 1: the update itself writes Inf into one parameter at step 1 (its gradient turned Inf by a hook
    nanwatch does not measure: forward and backward finite), and steps 2-3 are skipped on it. Episode 2:
    the weights and optimizer state restored at step 4 (finite again), then the parameter overwritten with NaN by hand before
    step 5, and steps 5-6 skipped. Each episode is told once, in the training log only (no RuntimeWarning),
    and says what happened: written by the update, or already non-finite before a step that was skipped."""
    caplog.set_level(logging.WARNING, logger="nanwatch")
    model = _model()
    good = {k: v.clone() for k, v in model.state_dict().items()}
    param = model.get_parameter(BAD)
    now = [0]
    param.register_hook(lambda g: g * math.inf if now[0] == 1 else g)
    opt = _make("sgd_fused", model)
    reports = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nanwatch.attach(model, run_id="told", optimizer=opt, directive_source="off") as mon:
            for n in range(7):
                now[0] = n
                if n == 4:  # a restore: the weights and the optimizer's state (its momentum holds the Inf)
                    model.load_state_dict(good)
                    opt.state.clear()
                if n == 5:
                    with torch.no_grad():
                        param[0, 0] = math.nan
                ids = token_ids(2, 16, seed=n, vocab=64)
                with mon.step(n):
                    model(input_ids=ids, labels=ids).loss.backward()
                    opt.step()
                    opt.zero_grad()
                reports.append(mon.last_report())
    assert [r.step_skipped for r in reports] == [False, False, True, True, False, True, True]
    told = [r.getMessage() for r in caplog.records if "SGD.step()" in r.getMessage()]
    assert len(told) == 2, told
    assert "step 1: 1 parameter non-finite after SGD.step()" in told[0] and "the update wrote it" in told[0]
    assert "step 5: 1 parameter already non-finite before SGD.step()" in told[1], told[1]
    assert "skipped" in told[1] and BAD in told[1] and "after" not in told[1]
    assert not [w for w in caught if "SGD.step()" in str(w.message)]  # one channel: the log
    # the reports carry the same words, at the step they were told
    assert [[w for w in r.warnings if "SGD.step()" in w] for r in reports] == [
        [], [told[0].removeprefix("nanwatch: ")], [], [], [], [told[1].removeprefix("nanwatch: ")], []]


def test_the_step_a_parameter_first_went_non_finite_is_named_when_it_is_known():
    """The reporter side alone (real tensors, the decoded shapes): a parameter the rotating check saw
    non-finite at step 3, first found by an optimizer check at step 4 whose update was skipped, is told at
    step 4 as non-finite since step 3; a finite check ends the episode; an update writing it at step 7 is
    told as written by the update."""
    from nanwatch.hooks.measure.optimizer_check import NonfiniteParams, read_batch
    from nanwatch.hooks.measure.recorder import ParamBatch
    from nanwatch.wire import SiteStat

    names = ["a.weight", "b.weight"]

    def seen(values, phase="optimizer"):
        batch = ParamBatch(pos=0, phase=phase, owner="SGD", names=names, dtypes=["float32"] * 2, numels=[4, 4],
                           values=torch.tensor(values))
        return read_batch(batch, values)

    site = SiteStat(site="a.weight", kind="param", phase="forward", stage="train", dtype="float32", calls=1, numel=4,
                    nan=1, inf=0, amax=math.nan, headroom=math.nan)
    params = NonfiniteParams()
    assert params.observe([], [site], step=3, skipped=True) == []  # no optimizer check yet: nothing told
    told = params.observe([seen([math.nan, 1.0])], [site], step=4, skipped=True)
    assert told == ["step 4: 1 parameter already non-finite before SGD.step(), which was skipped (it wrote "
                    "nothing): a.weight (first seen non-finite at step 3); restore the weights"]
    assert params.observe([seen([math.nan, 1.0], "forward"), seen([math.nan, 1.0])], [], step=5, skipped=True) == []
    assert params.observe([seen([1.0, 1.0])], [], step=6, skipped=False) == []  # finite again: the episode ends
    assert params.observe([seen([math.inf, math.inf])], [], step=7, skipped=False) == [
        "step 7: 2 parameters non-finite after SGD.step(): the update wrote them (a.weight, b.weight)"]


def test_the_cpu_path_of_the_check_gives_the_foreach_norms_values():
    """The post-step check reads each parameter's largest |x| with one aminmax each on the CPU (14x cheaper
    there than ``_foreach_norm(ord=inf)``): the same values, NaN and Inf included, in every dtype."""
    import math

    from nanwatch.hooks.measure.optimizer_check import _largest_abs

    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        group = [torch.randn(7, 5, generator=g).to(dtype) * 3 for _ in range(4)]
        group[1][2, 3], group[2][0, 0], group[3][4, 4] = math.nan, -math.inf, -1e4
        want = torch.stack(torch._foreach_norm(group, ord=math.inf))
        got = _largest_abs(group)
        assert got.dtype == want.dtype and torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0))
        with_empty = _largest_abs([torch.zeros(0, dtype=dtype), *group])  # (the foreach norm refuses an empty one)
        assert with_empty[0] == 0 and torch.equal(with_empty[1:].nan_to_num(0.0), want.nan_to_num(0.0))


# ---- the check amortised (an accelerator's default, #35): an unchecked update's NaN is still named ---------

@pytest.mark.parametrize("defer", [False, True], ids=["decided-at-step-end", "decided-a-step-later"])
def test_an_update_the_amortised_check_did_not_read_is_named_at_its_parameter(defer, monkeypatch, caplog):
    """Fused SGD's update writes Inf into one parameter at step 1 (its gradient turned Inf by a hook nanwatch
    does not measure: forward and backward finite); the check reads only the first step of sixteen, so step
    1 is finite. Step 2's forward meets the weight at the module holding it (the first offender), the guard
    skips step 2 and every later one, and the rerun reads every parameter once: class ``optimizer``, born at
    the parameter. With ``defer`` the accelerator's path (the step decided at the next step start)."""
    from nanwatch.hooks.forensics import rerun as rerun_module

    monkeypatch.setattr(rerun_module, "defers", lambda device: defer)
    caplog.set_level(logging.WARNING, logger="nanwatch")
    model = _model()
    param = model.get_parameter(BAD)
    now = [0]
    param.register_hook(lambda g: g * math.inf if now[0] == 1 else g)
    opt = _make("sgd_fused", model)
    reports, finite = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.attach(model, run_id="amortised", optimizer=opt, directive_source="local",
                             optimizer_check_every=16) as mon:
            for n in range(5):
                now[0] = n
                ids = token_ids(2, 16, seed=n, vocab=64)
                with mon.step(n):
                    model(input_ids=ids, labels=ids).loss.backward()
                    opt.step()
                    opt.zero_grad()
                reports.append(mon.last_report())
                finite.append(bool(param.isfinite().all()))
    assert finite == [True, False, False, False, False]  # the update of step 1 wrote it
    assert [r.first_offender for r in reports[:2]] == [None, None]  # step 1's update was not read
    assert (reports[2].first_offender, reports[2].first_offender_phase) == ("model.layers.0.mlp", "forward")
    assert [r.step_skipped for r in reports] == [False, False, True, True, True]  # guarded from step 2 on
    at = 3 if defer else 2
    inc = reports[at].incident
    assert [r.incident is not None for r in reports].count(True) == 1
    assert (inc.cls, inc.step, inc.birth, inc.birth_kind, inc.phase) == ("optimizer", 2, BAD, "param", "forward")
    assert inc.birth_params == {BAD: param.numel()} and "born in an optimizer update" in inc.note  # all Inf
    assert "momentum_buffer" in inc.note  # the state it also wrote, named
    assert not nanwatch.policy.precision_helps(reports[2]) and not nanwatch.policy.precision_helps(reports[at])
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("nanwatch: step 2 (train)")]
    told = " ".join(lines)
    assert "non-finite at model.layers.0.mlp (forward" in told and "step skipped" in told, lines
    assert f"class optimizer; born at {BAD} (param)" in told and "when step 2's forward used it" in told, lines
    # nothing says the update of step 2 wrote it (it was skipped): the check never read a step since step 0
    assert not any("after SGD.step(): the update wrote" in x for x in told.split(";")), lines


def test_a_nan_weight_written_by_hand_is_not_blamed_on_an_update_the_check_read():
    """Every step checked (the CPU's default): a parameter made NaN between steps is no optimizer birth."""
    model = _model()
    opt = _make("sgd_fused", model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.attach(model, run_id="by-hand", optimizer=opt, directive_source="off") as mon:
            for n in range(3):
                if n == 2:
                    with torch.no_grad():
                        model.get_parameter(BAD)[0, 0] = math.nan
                ids = token_ids(2, 16, seed=n, vocab=64)
                with mon.step(n):
                    model(input_ids=ids, labels=ids).loss.backward()
                    opt.step()
                    opt.zero_grad()
            inc = mon.last_report().incident
    assert (inc.cls, inc.birth, inc.birth_params) == ("data_mask", BAD.removesuffix(".weight"), {"weight": 1}), inc


def test_a_nan_in_optimizer_state_is_named_without_a_sweep():
    """No step-start sweep (the default): an ``exp_avg`` turned NaN before step 2 reaches the weight in step
    2's update (amortised check: not read), the weight reaches step 3's forward at the module holding it,
    and the rerun's one read names the parameter and the state it came from."""
    model = _model()
    opt = _make("adamw_fused", model)
    param = model.get_parameter(BAD)
    reports = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.attach(model, run_id="state", optimizer=opt, directive_source="off",
                             optimizer_check_every=16) as mon:
            for n in range(4):
                if n == 2:
                    opt.state[param]["exp_avg"][0, 0] = math.nan
                ids = token_ids(2, 16, seed=n, vocab=64)
                with mon.step(n):
                    model(input_ids=ids, labels=ids).loss.backward()
                    opt.step()
                    opt.zero_grad()
                reports.append(mon.last_report())
    assert [r.first_offender for r in reports] == [None, None, None, "model.layers.0.mlp"]
    assert all(r.coverage.params_checked == 0 for r in reports)  # nothing read at step start
    inc = reports[3].incident
    assert (inc.cls, inc.step, inc.birth, inc.birth_kind) == ("optimizer", 3, BAD, "param"), inc
    assert f"optimizer.{BAD}.exp_avg" in inc.note, inc.note
