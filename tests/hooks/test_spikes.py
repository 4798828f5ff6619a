"""Spikes before the overflow (issue #29.2): a tiny Qwen3 whose layer-0 MLP output is multiplied by 50 at one
step (finite throughout) is told as a spike at that site and pass, with no incident, no directive and no skip;
``spike_action="skip"`` keeps that step's update out of the weights; a loss jump ×20 fed by ``mon.watch("loss",
loss)`` is a loss spike; 500 healthy steps (AdamW, dropout, gradient accumulation, a warm-up schedule) have
none. The factors (50, 20) are far from the threshold (10): no test depends on the CPU's kernels."""

from __future__ import annotations

import logging
import math
import warnings

import pytest
import torch
from support import tiny_qwen3, token_ids

import nanwatch
from nanwatch.hooks.measure.spikes import SpikeDetector
from nanwatch.wire import SiteStat

pytest.importorskip("transformers")

K = 14  # past the default warm-up (10 measured steps)
MLP = "model.layers.0.mlp"


def _model(**overrides):
    return tiny_qwen3("sdpa", vocab_size=64, hidden_size=32, intermediate_size=64, use_cache=False, **overrides)


def _times(module, factor: float):
    """Multiply ``module``'s output by ``factor`` in the next forwards (an instance patch: every hook, nanwatch's
    included, sees the multiplied output); returns the undo."""
    original = module.forward
    module.forward = lambda *a, **k: original(*a, **k) * factor
    return lambda: module.__dict__.pop("forward")


def _run(steps: int = K + 3, *, at: int = K, fault=None, fused: bool = False, layer: int = 0, **options):
    """Train ``steps`` steps; at step ``at`` the fault: ``"mlp"``, layer ``layer``'s MLP output x50; ``"loss"``,
    the loss x20."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=fused)
    ids = token_ids(2, 12, vocab=64)
    rows = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.attach(model, run_id="spikes", optimizer=opt, **options) as mon:
            for n in range(steps):
                undo = _times(model.model.layers[layer].mlp, 50.0) if fault == "mlp" and n == at else None
                before = {k: p.detach().clone() for k, p in model.named_parameters()}
                with mon.step(n):
                    loss = model(input_ids=ids, labels=ids).loss
                    if fault == "loss" and n == at:
                        loss = loss * 20.0
                    mon.watch("loss", loss)
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                if undo is not None:
                    undo()
                r = mon.last_report()
                moved = any(not torch.equal(before[k], p) for k, p in model.named_parameters())
                rows.append(dict(report=r, moved=moved))
    return rows


def _spikes(rows):
    return {n: [(s.site, s.phase) for s in row["report"].spikes] for n, row in enumerate(rows) if row["report"].spikes}


def test_a_layer_output_times_50_is_a_spike_at_its_site_and_pass_and_nothing_else(caplog):
    with caplog.at_level(logging.WARNING, logger="nanwatch"):
        rows = _run(fault="mlp")
    spiked = _spikes(rows)
    assert set(spiked) == {K}, spiked  # that step only: the jump joined the baseline, nothing after it
    r = rows[K]["report"]
    top = {(s.site, s.phase): s for s in r.spikes}
    mlp = top[(MLP, "forward")]
    assert 50 / 2 < mlp.factor < 50 * 2 and mlp.kind == "mlp" and math.isclose(mlp.factor, mlp.value / mlp.baseline)
    assert [s.factor for s in r.spikes] == sorted((s.factor for s in r.spikes), reverse=True)
    # a precursor, not an incident: nothing non-finite, no incident, no directive, no skip
    assert r.first_offender is None and r.incident is None and r.attention_mode == "none"
    assert all(row["report"].attention_mode == "none" and not row["report"].step_skipped for row in rows)
    assert all(row["moved"] for row in rows)
    said = [m for m in caplog.messages if "spike at" in m]
    assert said and said[0].startswith(f"nanwatch: step {K}: spike at ") and f"{MLP} (forward)" in said[0]


@pytest.mark.parametrize("at", [30, 31])
def test_a_one_step_spike_is_reported_in_its_step_whatever_the_step_number(at):
    """The issue's trial: layer 1's MLP output x50 at step 30 (not a multiple of the old rotation's 4) went
    unreported; every site is read every step, so it is reported in its step and nowhere else."""
    rows = _run(at + 3, at=at, fault="mlp", layer=1)
    spiked = _spikes(rows)
    assert set(spiked) == {at}, spiked
    assert ("model.layers.1.mlp", "forward") in spiked[at]


@pytest.mark.parametrize("fused", [False, True])
def test_spike_action_skip_keeps_the_spiking_step_out_of_the_weights(fused):
    rows = _run(fault="mlp", spike_action="skip", fused=fused)
    assert (MLP, "forward") in _spikes(rows)[K]
    assert [n for n, row in enumerate(rows) if not row["moved"]] == [K]  # the spiking update, and only it
    r = rows[K]["report"]
    assert r.step_skipped is True and r.incident is None and r.first_offender is None
    assert r.attention_mode == "none"


def test_a_loss_jump_times_20_fed_by_watch_is_a_loss_spike(caplog):
    with caplog.at_level(logging.WARNING, logger="nanwatch"):
        rows = _run(fault="loss")
    r = rows[K]["report"]
    loss = next(s for s in r.spikes if (s.site, s.phase) == ("loss", "forward"))
    assert 10 < loss.factor < 40 and loss.kind == "tensor"
    assert r.incident is None and r.step_skipped is not True and rows[K]["moved"]
    assert any(m.startswith(f"nanwatch: step {K}: ") and "loss spike at loss (forward)" in m for m in caplog.messages)


def test_500_healthy_steps_with_adamw_dropout_accumulation_and_warmup_have_no_spike():
    """No false alarm in 500 ordinary steps; one control step (450: the MLP output ×50) shows the detector
    was watching all along: it is the only step with spikes."""
    model = _model(attention_dropout=0.1)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 50))  # 50-step linear warm-up
    spiked = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.attach(model, run_id="healthy", optimizer=opt,
                             on_report=lambda r: r.spikes and spiked.append((r.step, r.spikes))) as mon:
            for n in range(500):
                undo = _times(model.model.layers[0].mlp, 50.0) if n == 450 else None
                with mon.step(n):
                    for micro in range(2):  # gradient accumulation: two micro-batches per optimizer step
                        ids = token_ids(2, 12, seed=n * 2 + micro, vocab=64)
                        loss = model(input_ids=ids, labels=ids).loss / 2
                        mon.watch("loss", loss)
                        loss.backward()
                    opt.step()
                    sched.step()
                    opt.zero_grad()
                if undo is not None:
                    undo()
            assert mon.last_report().step == 499
    assert [step for step, _ in spiked] == [450], [(step, [(s.site, s.phase, round(s.factor, 1)) for s in sp])
                                                   for step, sp in spiked]
    assert (MLP, "forward") in {(s.site, s.phase) for s in spiked[0][1]}


def _site(value: float, *, site: str = "a", phase: str = "forward") -> SiteStat:
    return SiteStat(site=site, kind="tensor", phase=phase, stage="train", dtype="float32", calls=1, numel=4,
                    nan=0, inf=0, amax=value, headroom=value / 3.4e38)


def test_the_baseline_ignores_warmup_zero_baselines_non_finite_values_and_a_step_seen_again():
    d = SpikeDetector(factor=10.0, window=3, warmup=2)
    assert d.observe(0, [_site(1.0)]) == [] and d.observe(1, [_site(100.0)]) == []  # warm-up
    assert d.observe(2, [_site(1.0)]) == []                     # baseline 100
    assert d.observe(3, [_site(math.inf)]) == []                # non-finite: an incident, never a spike
    assert d.observe(4, [_site(2.0)]) == [] and d.observe(5, [_site(2.0)]) == []  # 100 left the window
    assert d.observe(6, [_site(30.0)])[0].factor == 15.0        # the last 3 values: 1, 2, 2
    assert d.observe(6, [_site(3.0)]) == []                     # step 6 seen again: its value replaced
    z = SpikeDetector(factor=10.0, window=3, warmup=0)
    assert z.observe(0, [_site(0.0)]) == [] and z.observe(1, [_site(5.0)]) == []  # baseline 0: no comparison


def test_status_file_shows_the_spikes(tmp_path):
    from nanwatch.cli.status_view import fold, read_records, render_detail

    _run(fault="mlp", log_dir=str(tmp_path))
    (path,) = tmp_path.glob("*.jsonl")
    (view,) = fold(read_records(str(path)))
    lines = [ln for ln in render_detail(view) if ln.strip().startswith("latest spikes")]
    assert lines and f"latest spikes at step {K} on rank 0" in lines[0] and f"spike at {MLP} (forward)" in lines[0], lines
