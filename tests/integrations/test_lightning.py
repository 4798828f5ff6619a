"""NanwatchCallback inside a real Lightning ``Trainer`` (CPU): manual and automatic optimization, gradient
accumulation, ``16-mixed`` (a real GradScaler) and ``bf16-mixed``, CSV and TensorBoard loggers, and DDP on
two gloo processes. The model is a tiny Qwen3 from a config inside a LightningModule."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from support import step_reports, tiny_qwen3

L = pytest.importorskip("lightning")
pytest.importorskip("transformers")

from nanwatch.hooks.integrations.lightning import NanwatchCallback  # noqa: E402

HERE = Path(__file__).parent


class TinyLM(L.LightningModule):
    """A tiny causal LM; ``poison_at``: the global steps at which layer 0's MLP output turns NaN (a bad batch),
    in every micro-batch of that step. ``manual``: manual optimization, stepping every ``every`` batches."""

    def __init__(self, *, manual: bool = False, every: int = 1, poison_at=(), optimizer: str = "adamw",
                 fused: bool = False) -> None:
        super().__init__()
        self.model = tiny_qwen3("sdpa", vocab_size=64, hidden_size=32, intermediate_size=64, use_cache=False)
        self.automatic_optimization = not manual
        self.every, self.poison_at, self.kind, self.fused = every, set(poison_at), optimizer, fused
        self.losses: list[float] = []
        self.now = -1
        self.model.model.layers[0].mlp.register_forward_hook(
            lambda m, a, out: out * math.nan if self.training and self.now in self.poison_at else out)

    def on_train_batch_start(self, batch, batch_idx):
        self.now = self.trainer.global_step  # the step this batch belongs to (a rerun at its end sees it too)

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.losses.append(float(loss.detach()))
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        self.manual_backward(loss / self.every)
        if (batch_idx + 1) % self.every == 0:
            opt.step()
            opt.zero_grad()
        return None

    def validation_step(self, batch, batch_idx):
        (ids,) = batch
        return self.model(input_ids=ids, labels=ids).loss

    def configure_optimizers(self):
        if self.kind == "sgd":
            return torch.optim.SGD(self.parameters(), lr=1e-2, momentum=0.9, fused=self.fused or None)
        return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=self.fused or None)


def _data(n: int = 16, s: int = 12, batch: int = 2):
    ids = torch.randint(0, 64, (n, s), generator=torch.Generator().manual_seed(0))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=batch)


def _fit(tmp_path, module, *, reports=None, logger=False, callback_options=None, val=False, **trainer_kw):
    reports = [] if reports is None else reports
    cb = NanwatchCallback(run_id="pl", **{"on_report": step_reports(reports),
                                          **(callback_options or {})})
    kw = dict(accelerator="cpu", devices=1, max_steps=4, enable_progress_bar=False, enable_checkpointing=False,
              enable_model_summary=False, logger=logger, default_root_dir=str(tmp_path), log_every_n_steps=1,
              num_sanity_val_steps=0)
    trainer = L.Trainer(callbacks=[cb], **{**kw, **trainer_kw})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, _data(), _data(4) if val else None)
    return trainer, cb, reports


def _train(reports):
    return [r for r in reports if r.stage == "train"]


def _finite(module) -> bool:
    return all(torch.isfinite(p).all() for p in module.parameters())


# ---- manual optimization ----------------------------------------------------------------------------------
@pytest.mark.parametrize(("optimizer", "fused"), [("adamw", False), ("adamw", True), ("sgd", False)])
def test_manual_optimization_a_nan_step_is_skipped_and_training_goes_on(tmp_path, optimizer, fused):
    module = TinyLM(manual=True, poison_at={1}, optimizer=optimizer, fused=fused)
    trainer, cb, reports = _fit(tmp_path, module)
    train = _train(reports)
    assert [r.step for r in train] == [0, 1, 2, 3]  # numbered as Lightning's loggers label the rows
    assert [r.step_skipped for r in train] == [False, True, False, False]
    assert train[1].first_offender is not None and train[1].first_offender.startswith("model.layers.0.mlp")
    assert _finite(module) and math.isfinite(module.losses[-1])  # the step stayed out; training went on
    assert trainer.global_step == 4
    inc = train[1].incident  # the rerun ran on the weights the bad step did not touch: it finds the NaN again
    assert inc is not None and inc.step == 1 and inc.same == "nonfinite"
    assert inc.birth is not None and inc.birth.startswith("model.layers.0.mlp")
    assert cb.monitor.last_report(timeout=0) is not None and not cb._training  # detached at fit end


# ---- automatic optimization: Lightning's optimizer.step(closure) --------------------------------------------
@pytest.mark.parametrize(("optimizer", "fused", "precision"), [("adamw", False, "32-true"), ("adamw", True, "32-true"),
                                                               ("sgd", False, "32-true"), ("adamw", True, "bf16-mixed")])
def test_automatic_optimization_a_nan_step_is_skipped_and_training_goes_on(tmp_path, optimizer, fused, precision):
    """The forward and backward run inside ``optimizer.step(closure)``: the guard decides from what they saw.
    The weights stay finite, the step is reported skipped, later steps train (Lightning checks each closure
    ran), and the rerun runs on the untouched weights: it finds the NaN again, born where it was injected."""
    module = TinyLM(poison_at={1}, optimizer=optimizer, fused=fused)
    trainer, _, reports = _fit(tmp_path, module, precision=precision)
    train = _train(reports)
    assert [r.step for r in train] == [0, 1, 2, 3]
    assert [r.step_skipped for r in train] == [False, True, False, False]
    assert _finite(module) and math.isfinite(module.losses[-1]) and len(module.losses) == 4
    assert trainer.global_step == 4
    inc = train[1].incident
    assert inc is not None and inc.same == "nonfinite" and inc.birth.startswith("model.layers.0.mlp")


def test_gradient_accumulation_makes_one_step_per_optimizer_step(tmp_path):
    # manual: the module steps every 2 batches; automatic: accumulate_grad_batches=2
    for manual, kw in ((True, {}), (False, {"accumulate_grad_batches": 2})):
        module = TinyLM(manual=manual, every=2 if manual else 1)
        trainer, _, reports = _fit(tmp_path / str(manual), module, max_steps=3, **kw)
        train = _train(reports)
        assert [r.step for r in train] == [0, 1, 2], manual
        assert [r.coverage.forwards for r in train] == [2, 2, 2], manual  # both micro-batches in each step
        assert trainer.global_step == 3


def test_validation_is_reported_on_its_own(tmp_path):
    module = TinyLM(manual=True)
    _, _, reports = _fit(tmp_path, module, val=True, val_check_interval=2, num_sanity_val_steps=1)
    evals = [r for r in reports if r.stage == "eval"]
    assert [r.step for r in _train(reports)] == [0, 1, 2, 3]
    assert [r.step for r in evals] == [0, 2, 4]  # the sanity check, then after steps 1 and 3
    assert all(r.coverage.forwards > 0 for r in evals)


# ---- precision plugins ------------------------------------------------------------------------------------
def test_16_mixed_overflows_are_loss_scaling_not_incidents(tmp_path):
    """A real GradScaler starting at 2**40: its first steps overflow the fp16 gradients and are skipped by
    design. They are reported as ``scaler_overflow`` with the scale, start no incident, and the weights stay
    finite; the scale comes down and training goes on."""
    module = TinyLM(manual=False)
    _, cb, reports = _fit(tmp_path, module, max_steps=6, plugins=[_fp16_plugin(2.0**40)])
    train = _train(reports)
    assert len(train) == 6 and train[0].scaler_overflow is True
    assert all(r.incident is None for r in train)
    assert all(r.first_offender is None or r.scaler_overflow for r in train)
    scales = [r.loss_scale for r in train]
    assert scales[0] < 2.0**40 and scales == sorted(scales, reverse=True)
    assert _finite(module)


def _fp16_plugin(init_scale: float = 2.0**16):
    """``precision="16-mixed"`` on the CPU: Lightning turns the string into bf16 there, so the plugin is built
    as the string builds it on a GPU (fp16 autocast and a GradScaler), on the CPU."""
    from lightning.pytorch.plugins.precision import MixedPrecision

    return MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=1000))


def test_16_mixed_a_nan_in_the_forward_is_an_incident_and_skipped(tmp_path):
    module = TinyLM(manual=True, poison_at={1})
    _, _, reports = _fit(tmp_path, module, plugins=[_fp16_plugin()])
    train = _train(reports)
    assert train[1].first_offender is not None and not train[1].scaler_overflow  # a real incident
    # the scaler found the NaN gradients and skipped optimizer.step() itself (so the guard was not asked: the
    # report says step_skipped None, not False), halving its scale; the weights stayed finite
    assert train[1].step_skipped is not False and train[1].loss_scale == train[0].loss_scale / 2
    assert _finite(module) and math.isfinite(module.losses[-1])


def test_bf16_mixed_a_nan_step_is_skipped(tmp_path):
    module = TinyLM(manual=True, poison_at={2})
    _, _, reports = _fit(tmp_path, module, precision="bf16-mixed")
    train = _train(reports)
    assert [r.step_skipped for r in train] == [False, False, True, False]
    assert _finite(module) and math.isfinite(module.losses[-1])


# ---- loggers ------------------------------------------------------------------------------------------------
def _slow(reports):
    """An on_report that keeps the reporter 0.3 s behind the training thread, as a busy one is."""
    keep = step_reports(reports)

    def on_report(r):
        keep(r)
        time.sleep(0.3)

    return on_report


def _expected(reports, rows):
    train = [r for r in _train(reports) if not r.final]
    return {s: float(sum(r.first_offender is not None for r in train if r.step <= s)) for s in rows}


def test_csv_logger_rows_describe_their_own_steps(tmp_path):
    from lightning.pytorch.loggers import CSVLogger

    reports: list = []
    module = TinyLM(manual=True, poison_at={1})
    logger = CSVLogger(str(tmp_path), name="csv")
    _fit(tmp_path, module, logger=logger, callback_options={"on_report": _slow(reports)})
    with open(Path(logger.log_dir) / "metrics.csv") as f:
        rows = {int(r["step"]): r for r in csv.DictReader(f)}
    assert sorted(rows) == [0, 1, 2, 3]
    got = {s: float(r["nanwatch/nonfinite_steps"]) for s, r in rows.items()}
    assert got == _expected(reports, rows) == {0: 0.0, 1: 1.0, 2: 1.0, 3: 1.0}
    assert {s: float(r["nanwatch/skipped_steps"]) for s, r in rows.items()} == {0: 0.0, 1: 1.0, 2: 1.0, 3: 1.0}
    assert all(r["nanwatch/logit_max"] for r in rows.values())


def test_tensorboard_logger_gets_the_scalars_every_log_every_n_steps(tmp_path):
    pytest.importorskip("tensorboard")
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    reports: list = []
    module = TinyLM(manual=True, poison_at={2})
    logger = TensorBoardLogger(str(tmp_path), name="tb")
    _fit(tmp_path, module, logger=logger, max_steps=6, log_every_n_steps=2,
         callback_options={"on_report": _slow(reports)})
    acc = EventAccumulator(logger.log_dir)
    acc.Reload()
    got = {e.step: e.value for e in acc.Scalars("nanwatch/nonfinite_steps")}
    # Lightning writes a row at every 2nd step (steps 1, 3, 5): each covers the steps up to its own
    assert got == _expected(reports, got) == {1: 0.0, 3: 1.0, 5: 1.0}
    assert {"nanwatch/skipped_steps", "nanwatch/headroom_max"} <= set(acc.Tags()["scalars"])


class RolloutLM(TinyLM):
    """A policy whose sampler scores each token 0.1 lower than the trainer does (a constant offset), from
    global step 1 on; at step 2 one of the sampler's logprobs is NaN. ``Monitor.rlhf`` is called from the
    training step, as a user's RL loss does."""

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        logits = self.model(input_ids=ids).logits[:, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        step, monitor = self.trainer.global_step, self.callback.monitor
        if step == 0:
            monitor.rlhf(logprobs=lp)
        else:
            rollout = lp.detach() - 0.1
            if step == 2:
                rollout[0, 0] = math.nan
            monitor.rlhf(logprobs=lp, rollout_logprobs=rollout, rollout_cap=1.05)
        return -lp.mean()


def test_the_rollout_mismatch_reaches_lightnings_logs(tmp_path):
    """The rollout figures of ``report.rlhf.rollout`` reach every Lightning logger as ``nanwatch/rollout_*``
    (the CSV file here), each row its own step's; the NaN the sampler returned is counted (cumulative), and
    the step without rollout logprobs has no rollout scalar at all."""
    from lightning.pytorch.loggers import CSVLogger

    reports: list = []
    module = RolloutLM()
    logger = CSVLogger(str(tmp_path), name="csv")
    cb = NanwatchCallback(run_id="pl", on_report=step_reports(reports))
    module.callback = cb
    trainer = L.Trainer(callbacks=[cb], accelerator="cpu", devices=1, max_steps=4, enable_progress_bar=False,
                        enable_checkpointing=False, enable_model_summary=False, logger=logger,
                        default_root_dir=str(tmp_path), log_every_n_steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, _data())
    with open(Path(logger.log_dir) / "metrics.csv") as f:
        rows = {int(r["step"]): r for r in csv.DictReader(f)}
    train = {r.step: r for r in _train(reports)}
    assert sorted(rows) == sorted(train) == [0, 1, 2, 3]
    assert train[0].rlhf.rollout is None and not any(rows[0].get(k) for k in rows[0] if "rollout" in k)
    for step in (1, 2, 3):
        s, row = train[step].rlhf.rollout, rows[step]
        assert s is not None and s.abs_mean == pytest.approx(0.1, rel=1e-4) and s.cap == pytest.approx(1.05)
        assert s.truncated_fraction == 1.0  # exp(0.1) > 1.05: every token is outside the cap
        for name, field in (("abs_mean", "abs_mean"), ("abs_max", "abs_max"), ("abs_p99", "abs_p99"),
                            ("k3", "k3_mean"), ("truncated_fraction", "truncated_fraction"),
                            ("logprob_slope", "logprob_slope"), ("prob_correlation", "prob_correlation")):
            assert float(row[f"nanwatch/rollout_{name}"]) == pytest.approx(getattr(s, field), rel=1e-6), name
        assert float(row["nanwatch/rollout_nonfinite"]) == (1.0 if step >= 2 else 0.0)
        assert train[step].rlhf.nonfinite["rollout_logprobs"] == (step == 2)


# ---- DDP ----------------------------------------------------------------------------------------------------
def test_ddp_on_two_gloo_processes_skips_a_nan_step_on_every_rank(tmp_path):
    """``strategy="ddp"``, ``devices=2`` on the CPU (gloo): Lightning relaunches the worker script for rank 1.
    Automatic optimization (``optimizer.step(closure)``, DDP's gradient all-reduce inside the closure). A NaN on
    rank 1 alone at step 1: every rank skips that step (the job's flag), the replicas stay equal and finite."""
    env = {**os.environ, "NANWATCH_OUT": str(tmp_path), "PYTHONPATH": os.pathsep.join(
        [str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run([sys.executable, str(HERE / "lightning_ddp_worker.py")], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for o in out:
        assert o["steps"] == [0, 1, 2, 3] and o["skipped"] == [False, True, False, False], o
        assert o["finite"] and o["world_size"] == 2
    assert out[0]["checksum"] == out[1]["checksum"]  # the replicas took the same updates
    assert out[1]["offender"] is not None and out[0]["offender"] is None


# ---- spikes (issue #29.2) -----------------------------------------------------------------------------------
class JumpingLoss(TinyLM):
    """The loss of global step ``at`` ×20 (finite): what Lightning hands ``on_before_backward``."""

    def __init__(self, at: int, **kw) -> None:
        super().__init__(**kw)
        self.at = at

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * 20.0 if self.trainer.global_step == self.at else loss


def test_the_callback_feeds_the_loss_and_a_loss_jump_is_a_spike(tmp_path):
    module = JumpingLoss(at=6)
    _, _, reports = _fit(tmp_path, module, max_steps=8, callback_options={"spike_warmup": 3})
    train = _train(reports)
    assert [r.step for r in train] == list(range(8))
    assert all(any(s.site == "loss" for s in r.sites) for r in train)  # the loss is a site every step
    spiked = {r.step: {(s.site, s.phase) for s in r.spikes} for r in train if r.spikes}
    assert 6 in spiked and ("loss", "forward") in spiked[6], spiked
    assert all(("loss", "forward") not in v for step, v in spiked.items() if step != 6), spiked
    loss = next(s for s in train[6].spikes if s.site == "loss")
    assert 10 < loss.factor < 40 and train[6].incident is None and not train[6].step_skipped
