"""The remedies one Monitor applies around each training step, in one place: the optimizers' hooks (weight
guards, post-step checks, discovery: ``nanwatch.hooks.remedies.optimizer_hooks``), the GradScalers watched
(``nanwatch.hooks.remedies.loss_scaling``), the differential rerun with its capsules
(``nanwatch.hooks.forensics.rerun``), and at each step start the rotating read of the parameters and of the
covered optimizers' state (``nanwatch.hooks.measure.param_sweep``).

The Monitor says when (attach, step start, step end, close); this knows in which order the remedies act,
so that the facade stays wiring. The parts that sit in other rooms come from the Monitor, the composition
root, already bound to their options: how to make the rerun (given the optimizers covered here), the spike
check of ``spike_action="skip"``, how to make the replica check. Training thread.

Example usage::

    remedies = StepRemedies(cfg.weights, rollout=cfg.rollout, device=device, rec=rec, model=model_ref,
                            probes=probes, warn=WarnOnce(), rerun=partial(DifferentialRerun, cfg.forensics, ...),
                            spiked=None, replicas=None)
    remedies.attach(model, optimizer=opt, scaler=None)
    remedies.at_step_start(41)
    ...                                   # the step
    remedies.at_step_end(41, raised=None)
    data, state = handover.hand_over(41)  # the step's hand-over
    remedies.new_step(data, state)
    remedies.remove()                     # at close; then remedies.join(timeout)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from nanwatch.hooks.config import RolloutConfig, WeightsConfig
from nanwatch.hooks.failsafe import WarnOnce, contained
from nanwatch.hooks.instrument.probes import Probes
from nanwatch.hooks.measure.param_sweep import ParamSweep
from nanwatch.hooks.measure.recorder import Recorder, StepState
from nanwatch.hooks.remedies.loss_scaling import LossScaling
from nanwatch.hooks.remedies.optimizer_hooks import OptimizerHooks
from nanwatch.hooks.remedies.weight_guard import WeightGuard
from nanwatch.hooks.rollout.attribution import RolloutAttributor
from nanwatch.wire import RolloutEvent

__all__ = ["ACCELERATOR_CHECK_EVERY", "Rerun", "StepRemedies"]

#: ``optimizer_check_every``'s default on an accelerator: the check reads every weight (the model's size in
#: bytes) after one optimizer step in this many, the first included; on the CPU, every step
ACCELERATOR_CHECK_EVERY = 16


class Rerun(Protocol):
    """What the remedies ask of the differential rerun (``nanwatch.hooks.forensics.rerun.DifferentialRerun``)."""

    on: bool
    capsules: Any

    def at_step_start(self, step: int | None = None) -> None: ...

    def before_update(self) -> None: ...

    def at_step_end(self, step: int, *, scaling: Any, weight_guard_on: bool) -> Any: ...

    def handed_over(self, data: torch.Tensor, state: StepState) -> None: ...

    def close(self, timeout: float) -> None: ...


class StepRemedies:
    """The optimizers' hooks, the scalers' watch and the rerun of one Monitor.

    It receives the sections it runs: ``config`` (the weights: weight guards, optimizer and parameter
    checks) and ``rollout`` (the attribution); and, built by the Monitor, ``rerun`` (called with
    ``optimizers=`` and ``unread_updates=``, the covered optimizers' callables, it makes the rerun), ``spiked``
    (``spike_action="skip"``'s check, or None) and ``replicas`` (makes the replica check on the first optimizer
    covered, or None)."""

    def __init__(self, config: WeightsConfig, *, rollout: RolloutConfig, device: torch.device, rec: Recorder,
                 model: Callable[[], torch.nn.Module | None], probes: Probes, warn: WarnOnce,
                 rerun: Callable[..., Rerun], spiked: Callable[[], bool] | None,
                 replicas: Callable[..., Any] | None) -> None:
        self._config, self._rec, self._model, self._warn, self._probes = config, rec, model, warn, probes
        self.rerun = rerun(optimizers=self._covered, unread_updates=self._unread_updates)
        every = config.optimizer_check_every or (1 if device.type == "cpu" else ACCELERATOR_CHECK_EVERY)
        self.optimizers = OptimizerHooks(model, config=config, spiked=spiked, replicas=replicas,
                                         rec=rec, warn=warn, rerun_tap=probes.rerun if self.rerun.on else None,
                                         check_every=every, before_update=self.rerun.before_update
                                         if self.rerun.on else None)
        self._sweep = ParamSweep(model, optimizers=self.optimizers.optimizers, every=config.param_check_every)
        self._scaling: LossScaling | None = None  # from attach on: it patches GradScaler.step to find scalers
        #: the rollout attribution (None: ``rollout_attribution=False``), its capsules the rerun's writer's
        self.attribution = RolloutAttributor(rollout_dtype=rollout.dtype, capsules=self.rerun.capsules
                                             ) if rollout.attribution else None

    def attach(self, model: torch.nn.Module, *, optimizer: torch.optim.Optimizer | None, scaler: Any) -> None:
        """Watch ``scaler`` and any GradScaler found stepping the model's optimizer; find the optimizers
        stepping ``model``'s parameters (unless ``guard="off"`` and no ``optimizer_check``); check
        ``optimizer`` and, under ``guard="auto"``, put a weight guard on it. Undone by :meth:`remove`, also
        when this raises half-way."""
        cfg = self._config
        self._scaling = LossScaling(self._rec, model=self._model, warn=self._warn)
        if scaler is not None:
            self._scaling.watch(scaler)
        if cfg.guard == "auto" or cfg.optimizer_check:
            self.optimizers.discover(model)
        if optimizer is not None:
            self.optimizers.check(optimizer)
            if cfg.guard == "auto":
                self.guard(optimizer)

    def guard(self, optimizer: torch.optim.Optimizer) -> WeightGuard:
        """``Monitor.guard``'s body (see there)."""
        return self.optimizers.guard(optimizer)

    def watch_scaler(self, scaler: Any) -> None:
        """``Monitor.watch_scaler``'s body (see there); a RuntimeError before :meth:`attach`."""
        if self._scaling is None:
            raise RuntimeError("nanwatch: watch_scaler() needs an attached Monitor")
        self._scaling.watch(scaler)

    def _covered(self) -> list[torch.optim.Optimizer]:
        return self.optimizers.optimizers()

    def _unread_updates(self) -> bool:
        return self.optimizers.unread_updates()

    def at_step_start(self, step: int | None = None) -> None:
        """An earlier step's rerun decided, if its flag has landed set (on an accelerator); the weights this
        step starts from, as the last update left them (``OptimizerCheck.carry``); then this step's share of
        the parameters and optimizer state (``param_check_every``), read before any forward so that a tensor
        already non-finite is named the birth site."""
        if self.rerun.on:
            contained(self.rerun.at_step_start, step)
        self.optimizers.at_step_start()
        if self._config.param_check_every:
            contained(self._check_params)

    def _check_params(self) -> None:
        self._probes.check_tensors(self._sweep.share())

    def at_step_end(self, step: int, *, raised: str | None) -> None:
        """Before the step's hand-over: the optimizers' end-of-step bookkeeping, the loss scale into the
        step's slots, and, in rerun mode, the step's classification if it is the run's first non-finite one
        (not when it raised: it never finished)."""
        self.optimizers.at_step_end()
        if self._scaling is not None:
            contained(self._scaling.at_step_end)
        if raised is None:
            contained(self.rerun.at_step_end, step, scaling=self._scaling,
                      weight_guard_on=self.optimizers.effective)

    def keep_rollout(self, kept: dict) -> None:
        """``Monitor.rlhf``'s batch, kept by reference for an attribution (when it has the sequences and the
        rollout's logprobs), and the attribution run on it if one was asked for. Training thread."""
        if self.attribution is not None and kept["input_ids"] is not None and kept["rollout_logprobs"] is not None:
            self.attribution.keep(input_ids=kept["input_ids"], rollout_logprobs=kept["rollout_logprobs"],
                                  logprobs=kept["logprobs"], attention_mask=kept["attention_mask"],
                                  completion_mask=kept["mask"])
            self._attribute()  # if one was asked for: now, while the weights are those that scored the batch

    def on_mismatch(self, event: RolloutEvent) -> None:
        """Reporter thread: a drift or outlier-sequence event asks for an attribution at the next step end."""
        if self.attribution is not None and event.cause in ("drift", "outliers"):
            self.attribution.request(event.cause, event.step)

    def _attribute(self) -> None:
        model = self._model()
        if self.attribution is None or model is None:
            return
        with self._probes.rerun.rerunning_forward():  # its forwards are not the step's
            result = self.attribution.run_requested(model)
        if result is not None:
            self._rec.state.rollout_attribution = result

    def new_step(self, data: torch.Tensor | None = None, state: StepState | None = None) -> None:
        """After the step's hand-over (``data``, ``state``: its values and record, as the report's copy took
        them; a rerun decided a step later decodes them): the scalers' per-step flags start afresh."""
        if data is not None and state is not None and self.rerun.on:
            contained(self.rerun.handed_over, data, state)
        if self._scaling is not None:
            self._scaling.new_step()

    def remove(self) -> None:
        """Take every hook off: the optimizers' (installed after the scalers' watch), then the scalers'."""
        try:
            self.optimizers.remove()
        finally:
            if self._scaling is not None:
                self._scaling.remove()

    def join(self, timeout: float) -> None:
        """A capsule still being written is finished (bounded wait)."""
        self.rerun.close(timeout)
