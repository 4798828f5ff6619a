"""A model with no recognised attention, logits head or decoder block is still guarded (#36): a plain
``nn.Sequential`` MLP fed an Inf at one step. Before, nothing measured it: the step was not skipped, every
parameter went non-finite, and the optimizer check blamed the update ("forward and backward finite")."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import nanwatch


def _mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def _train(model, opt, now: dict, *, then=lambda: None) -> list:
    """Three monitored steps of the MLP on random inputs (``now["step"]`` set before each); ``then()`` runs
    once attached. Returns the reports."""
    reports = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.attach(model, run_id="mlp", optimizer=opt) as mon:
            then()
            for n in range(3):
                now["step"] = n
                with mon.step(n):
                    model(torch.randn(4, 8)).square().mean().backward()
                    opt.step()
                    opt.zero_grad()
                reports.append(mon.last_report())
    return reports


@pytest.mark.parametrize("opt_cls", [torch.optim.SGD, torch.optim.AdamW], ids=["sgd", "adamw"])
def test_a_plain_mlp_with_an_inf_input_is_caught_named_and_its_step_skipped(opt_cls, tmp_path):
    model = _mlp()
    opt = opt_cls(model.parameters(), lr=1e-2)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        mon = nanwatch.attach(model, run_id="mlp", optimizer=opt, capsule_dir=str(tmp_path))
    fallback = [str(w.message) for w in said if "no attention module, logits head or decoder block" in str(w.message)]
    assert len(fallback) == 1 and "every parameter's gradient" in fallback[0], [str(w.message) for w in said]
    reports, moved = [], []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with mon:
            for n in range(4):
                x = torch.randn(4, 8)
                if n == 1:
                    x[0, 0] = math.inf
                before = [p.detach().clone() for p in model.parameters()]
                with mon.step(n):
                    model(x).square().mean().backward()
                    opt.step()
                    opt.zero_grad()
                moved.append(any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)))
                reports.append(mon.last_report())
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert moved == [True, False, True, True]
    r = reports[1]
    assert r.step_skipped and (r.first_offender, r.first_offender_phase) == ("0", "forward")  # the first Linear
    assert r.incident is not None and r.incident.cls == "data_mask", r.incident  # a non-finite input, not the update
    assert all(x.first_offender is None for x in reports if x.step != 1)


def test_a_gradient_turned_non_finite_inside_a_plain_mlp_is_named_at_its_part():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    now = {"step": None}

    def poison(module, args, out) -> None:  # finite forward; the gradient into the ReLU's output turns NaN
        if now["step"] == 1:
            out.register_hook(lambda g: g * math.nan)

    # registered after nanwatch's hooks: nanwatch reads the gradient before the poison
    reports = _train(model, opt, now, then=lambda: model[1].register_forward_hook(poison))
    r = reports[1]
    assert r.step_skipped and (r.first_offender, r.first_offender_phase) == ("0", "backward"), r.first_offender
    assert not any(s.nan + s.inf for s in r.sites if s.phase == "forward")
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_value_born_in_a_weight_gradient_is_caught_at_that_parameter():
    """No activation gradient sees it (born in the weight's own gradient): the parameter gradients, read every
    step in such a model, do."""
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    now = {"step": None}
    model[0].weight.register_hook(lambda g: g * math.nan if now["step"] == 1 else None)  # runs before nanwatch's
    reports = _train(model, opt, now)
    r = reports[1]
    assert r.step_skipped and (r.first_offender, r.first_offender_phase) == ("0.weight", "backward"), r.first_offender
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_a_run_that_attached_but_never_stepped_warns_once():
    model = _mlp()
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with nanwatch.attach(model, run_id="no-step") as mon:
            for _ in range(3):  # the loop forgot `with mon.step(n):`
                model(torch.randn(4, 8)).square().mean().backward()
            with mon.step(0):  # once a step is open, the warning has said what it had to
                model(torch.randn(4, 8)).square().mean().backward()
            model(torch.randn(4, 8)).square().mean().backward()
    told = [str(w.message) for w in said if "outside `with mon.step(n):`" in str(w.message)]
    assert len(told) == 1, told
