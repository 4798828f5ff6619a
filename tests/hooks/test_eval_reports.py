"""Evaluations as reports of their own, and steps that raised (wire 1.5 ``stage`` and ``raised``), on the Monitor."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from support import step_reports, tiny_qwen3, token_ids

import nanwatch

BLOCK = "model.layers.1"


def _setup(**options):
    """A tiny Qwen3 whose layer-1 MLP turns NaN while ``poison["on"]``, a fused AdamW under the weight guard."""
    model = tiny_qwen3(num_hidden_layers=2)
    poison = {"on": False}
    model.model.layers[1].mlp.register_forward_hook(lambda m, a, out: out * math.nan if poison["on"] else out)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    reports = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mon = nanwatch.attach(model, run_id="ev", on_report=step_reports(reports), optimizer=opt,
                              **options)  # every step names the block part
    return model, opt, mon, poison, reports


def _train_step(model, opt, ids):
    model.train()
    model(ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def _eval_forward(model, ids, poison, *, nan: bool):
    model.eval()
    poison["on"] = nan
    with torch.no_grad():
        model(ids)
    poison["on"] = False


def test_an_evaluation_between_steps_is_its_own_report_without_a_window():
    """HF's Trainer evaluates between one step's end and the next one's start: the eval forwards open a report
    of their own (implicitly), which the next step closes; nothing of it reaches the next step."""
    model, opt, mon, poison, reports = _setup()
    ids = token_ids()
    with mon:
        for n in (1, 2, 3):
            with mon.step(n):
                _train_step(model, opt, ids)
            _eval_forward(model, ids, poison, nan=n == 2)
            _eval_forward(model, ids, poison, nan=False)
        mon.last_report()
        before = [p.detach().clone() for p in model.parameters()]
    assert [(r.stage, r.step) for r in reports] == [("train", 1), ("eval", 1), ("train", 2), ("eval", 2),
                                                     ("train", 3), ("eval", 3)]  # the last one closed by close()
    train = [r for r in reports if r.stage == "train"]
    assert [r.first_offender for r in train] == [None] * 3
    assert [r.step_skipped for r in train] == [False] * 3  # the guard's flag never saw the eval NaN
    assert all(r.incident is None for r in reports)  # nor did the replay
    assert all({s.stage for s in r.sites} == {"train"} for r in train)
    evals = [r for r in reports if r.stage == "eval"]
    assert [r.coverage.forwards for r in evals] == [2, 2, 2]
    assert [(r.first_offender, r.first_offender_stage) for r in evals] == [
        (None, None), (BLOCK + ".mlp", "eval"), (None, None)]
    assert all(torch.isfinite(p).all() for p in before)


def test_an_evaluation_inside_a_step_is_reported_apart_and_the_step_keeps_its_figures():
    model, opt, mon, poison, reports = _setup()
    ids = token_ids()
    with mon:
        with mon.step(7):
            model.train()
            loss = model(ids, labels=ids).loss
            with mon.evaluating():
                _eval_forward(model, ids, poison, nan=True)
            model.train()
            loss.backward()
            opt.step()
        with mon.step(8):
            _eval_forward(model, ids, poison, nan=True)  # no window: labelled eval, never the step's first offender
            _train_step(model, opt, ids)
    eval_report, step7, step8 = reports
    assert (eval_report.stage, eval_report.step, eval_report.first_offender) == ("eval", 7, BLOCK + ".mlp")
    assert (step7.stage, step7.step, step7.first_offender, step7.step_skipped) == ("train", 7, None, False)
    assert {s.stage for s in step7.sites} == {"train"} and step7.coverage.forwards == 1
    assert step8.first_offender is None and step8.step_skipped is False
    assert any(s.stage == "eval" and s.nan for s in step8.sites)


@pytest.mark.parametrize("how", ["step", "exit"])
def test_a_step_that_raised_says_so_and_claims_nothing_unmeasured(how):
    model, opt, mon, poison, reports = _setup()
    model.model.layers[0].mlp.register_forward_hook(lambda m, a, out: (_ for _ in ()).throw(KeyError("boom"))
                                                    if poison.get("raise") else out)
    ids = token_ids()
    with pytest.raises(KeyError):
        with mon:
            with mon.step(1):
                _train_step(model, opt, ids)
            poison["raise"] = True
            if how == "step":
                with mon.step(2):
                    _train_step(model, opt, ids)
            else:  # a step left open by the loop: reported by Monitor.__exit__, which sees the exception
                mon.begin_step(2)
                _train_step(model, opt, ids)
    assert [(r.step, r.raised) for r in reports] == [(1, None), (2, "KeyError")]
    assert reports[0].coverage.unmeasured == []  # a whole step measures everything here
    # the forward stopped in layer 0: the logits were never seen, and that is not "no_logits"
    assert reports[1].coverage.unmeasured == [] and not reports[1].coverage.logits
    assert any("raised KeyError" in w for w in reports[1].warnings)
