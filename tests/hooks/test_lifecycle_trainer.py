"""#18, trainer side: dynamic loss scaling at work is no incident, and a run that ends normally says so.

A real ``torch.amp.GradScaler("cpu")`` under fp16 autocast, with an init scale (2**24) large enough that the
first backward passes overflow fp16 honestly; the tests assert what the scaler decided (its scale went down),
never exact values. A forward NaN is a zero input row through an unguarded ``x / |x|`` (0/0)."""

from __future__ import annotations

import json
import logging
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import nanwatch
from nanwatch.hooks.integrations.log_scalars import LogScalars


class Block(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.mlp = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(x / x.norm(dim=-1, keepdim=True))  # a zero row: 0/0, a forward NaN


class Net(nn.Module):
    def __init__(self, d: int = 16, classes: int = 8) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(d), Block(d)])
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def _batch(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(n)), torch.arange(4)


def _run(*, steps: int = 20, scaler=True, explicit=True, fused=False, nan_at=None, **options):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused) if fused else torch.optim.SGD(
        model.parameters(), lr=0.05)
    sc = torch.amp.GradScaler("cpu", init_scale=2.0**24) if scaler else None
    reports = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mon = nanwatch.attach(model, run_id="scale", optimizer=opt, scaler=sc if explicit else None,
                              on_report=reports.append, is_attention=lambda n, m: False, **options)
        with mon:
            for n in range(steps):
                x, y = _batch(n)
                if n == nan_at:
                    x[0] = 0
                with mon.step(n):
                    with torch.autocast("cpu", dtype=torch.float16, enabled=scaler):
                        loss = F.cross_entropy(model(x), y)
                    if sc is None:
                        loss.backward()
                        opt.step()
                    else:
                        sc.scale(loss).backward()
                        sc.step(opt)
                        sc.update()
                    opt.zero_grad()
    return mon, model, [r for r in reports if not r.final], reports


@pytest.mark.parametrize("explicit", [True, False], ids=["scaler=", "found"])
@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "adamw-fused"])
def test_a_gradscaler_overflow_is_reported_as_such_and_is_no_incident(explicit, fused, caplog):
    caplog.set_level(logging.INFO, logger="nanwatch")
    mon, model, reports, _ = _run(explicit=explicit, fused=fused)
    scales = [r.loss_scale for r in reports]
    assert all(s is not None for s in scales)
    # what the scaler decided: a step it skipped lowered the scale; the report says so exactly then
    before = [2.0**24, *scales[:-1]]
    decided = [s < b for s, b in zip(scales, before, strict=True)]
    assert [r.scaler_overflow for r in reports] == decided
    assert decided[0] and sum(decided) >= 3  # 2**24 overflows fp16 gradients at once, and for a few steps
    assert not any(decided[-5:]) and len(set(scales[-5:])) == 1  # then training proceeds at a stable scale
    assert all(r.incident is None for r in reports)
    assert mon.directive_state.mode == "none"  # the local rules offered nothing
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())
    assert all(r.first_offender is None for r in reports if not r.scaler_overflow)
    lines = [rec for rec in caplog.records if rec.name == "nanwatch"]
    assert not [r.getMessage() for r in lines if "non-finite at" in r.getMessage()]  # no NaN episode
    overflow_lines = [r for r in lines if "loss scale overflow at step" in r.getMessage()]
    assert len(overflow_lines) == sum(decided) and all(r.levelno == logging.INFO for r in overflow_lines)


def test_a_forward_nan_under_the_scaler_is_an_incident():
    _, model, reports, _ = _run(steps=14, nan_at=12)
    bad = reports[12]
    assert bad.scaler_overflow is False and bad.first_offender_phase == "forward"
    assert bad.incident is not None  # the differential replay ran for it
    assert all(r.incident is None for r in reports[:12])
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_without_a_scaler_the_fields_are_none():
    _, _, reports, _ = _run(steps=3, scaler=False)
    assert [(r.loss_scale, r.scaler_overflow) for r in reports] == [(None, None)] * 3


def test_log_scalars_count_overflows_apart_from_nonfinite_steps():
    _, _, reports, everything = _run()
    scalars = LogScalars()
    for r in everything:
        scalars.observe(r)
    figures = scalars._figures
    assert figures["nanwatch/scaler_overflows"] == sum(bool(r.scaler_overflow) for r in reports) > 0
    assert figures["nanwatch/nonfinite_steps"] == 0
    assert figures["nanwatch/loss_scale"] == reports[-1].loss_scale


def test_a_scale_under_one_is_a_warning(caplog):
    from support import step_report

    from nanwatch.hooks.report.local_log import _Lines

    caplog.set_level(logging.INFO, logger="nanwatch")
    lines = _Lines(incidents=True, every=None)
    for step, scale in enumerate([2.0, 1.0, 0.5, 0.25]):
        lines.observe(step_report(step=step).model_copy(update={"loss_scale": scale, "scaler_overflow": True,
                                                                 "first_offender": None, "sites": []}))
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "step 2: loss scale fell below 1 (1 -> 0.5)" in warned[0]


# ---- the final report -----------------------------------------------------------------------------------
def _loop(mon, model, steps, *, raise_at=None, raise_between=False):
    for n in range(steps):
        if raise_between and n == steps - 1:
            raise KeyboardInterrupt
        with mon.step(n):
            if n == raise_at:
                raise FloatingPointError("boom")
            model(_batch(n)[0]).sum().backward()


def _attach(model, reports, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return nanwatch.attach(model, run_id="final", on_report=reports.append, is_attention=lambda n, m: False,
                               **kw)


def test_a_normal_exit_sends_one_final_report_last(tmp_path):
    model, reports = Net(), []
    with _attach(model, reports, log_dir=str(tmp_path)) as mon:
        _loop(mon, model, 3)
    assert [r.final for r in reports] == [False, False, False, True]
    final = reports[-1]
    assert (final.step, final.scope, final.sites, final.raised) == (2, "rank", [], None)
    assert mon.last_report().step == 2 and not mon.last_report().final  # still the last step's report
    mon.close()  # again: nothing more is sent
    assert sum(r.final for r in reports) == 1
    (path,) = tmp_path.glob("*.jsonl")
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[-1]["final"] is True and not any(rec.get("nanwatch_log") == "closed" for rec in lines)
    from nanwatch.cli.status_view import fold

    (run,) = fold(lines)
    assert run["ranks"][0]["state"] == "ended" and run["latest_step"] == 2


@pytest.mark.parametrize("how", ["in_step", "between_steps"])
def test_a_run_that_raised_sends_no_final_report(tmp_path, how):
    model, reports = Net(), []
    with pytest.raises((FloatingPointError, KeyboardInterrupt)):
        with _attach(model, reports, log_dir=str(tmp_path)) as mon:
            _loop(mon, model, 3, raise_at=1 if how == "in_step" else None, raise_between=how == "between_steps")
    assert reports and not any(r.final for r in reports)
    (path,) = tmp_path.glob("*.jsonl")
    assert json.loads(path.read_text().splitlines()[-1])["nanwatch_log"] == "closed"


def test_the_exit_hook_after_an_uncaught_exception_sends_no_final(monkeypatch):
    from nanwatch.hooks import facade

    model, reports = Net(), []
    mon = _attach(model, reports)
    _loop(mon, model, 2)
    monkeypatch.setattr("sys.last_type", ValueError, raising=False)
    facade._close_at_exit()
    assert reports and not any(r.final for r in reports)


def test_training_on_after_a_caught_exception_still_ends_normally():
    model, reports = Net(), []
    with _attach(model, reports) as mon:
        with pytest.raises(FloatingPointError):
            _loop(mon, model, 2, raise_at=1)
        _loop(mon, model, 1)  # an OOM-retry style loop goes on
    assert reports[-1].final and not any(r.final for r in reports[:-1])


def test_a_collector_accepts_the_final_and_scaler_reports(collector):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mon, _, reports, everything = _run(steps=6, collector=collector.url, token=collector.token)
    assert everything[-1].final and any(r.scaler_overflow for r in reports)
    assert mon.dropped_reports == 0
    import urllib.request

    req = urllib.request.Request(f"{collector.url}/v1/runs/scale", headers={"Authorization": f"Bearer {collector.token}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        run = json.loads(resp.read())
    assert run["latest_step"] == 5
    assert math.isfinite(reports[-1].loss_scale)
