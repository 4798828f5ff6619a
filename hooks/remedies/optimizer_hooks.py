"""The hooks on the optimizers one Monitor covers: their weight guards
(``nanwatch.hooks.remedies.weight_guard``), their post-step checks (``nanwatch.hooks.measure.optimizer_check``),
the discovery of the ones ``attach()`` was not given (``nanwatch.hooks.remedies.optimizer_discovery``), and
the one warning when training steps pass and none was found.

The Monitor keeps the public ``guard()`` and the attached/closed state; this keeps the bookkeeping (which
optimizer is guarded or checked, and every handle to remove), so that the facade stays wiring. Training
thread.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch

from nanwatch.hooks.config import WeightsConfig
from nanwatch.hooks.failsafe import WarnOnce, contained, probe_failed
from nanwatch.hooks.instrument.rerun_tap import RerunTap
from nanwatch.hooks.measure.optimizer_check import OptimizerCheck
from nanwatch.hooks.measure.recorder import Recorder
from nanwatch.hooks.remedies.optimizer_discovery import (
    UNFOUND_AFTER_STEPS,
    OptimizerDiscovery,
    inner_optimizer,
)
from nanwatch.hooks.remedies.weight_guard import (
    WeightGuard,
    drop_grads_if_flagged,
    guard_of,
    run_closure,
)

__all__ = ["OptimizerHooks"]

log = logging.getLogger("nanwatch")


class OptimizerHooks:
    """The weight guards, checks and discovery of one Monitor's optimizers; ``remove()`` takes every one off
    (last installed, first removed), keeping the record of what was covered.

    ``rerun_tap``: the probes' :class:`~nanwatch.hooks.instrument.rerun_tap.RerunTap` when rerun mode is on
    (else None), told after each new weight guard whether to keep the forward inputs (rerun mode needs an
    effective weight guard to protect the weights meanwhile). ``before_update``: called at each guarded
    optimizer's pre-step (the rerun's last chance to re-run a step on the weights it saw). ``check_every``:
    the optimizer checks' cadence (``MonitorConfig.weights.optimizer_check_every``, resolved for the device).
    ``spiked``: ``spike_action="skip"``'s check, shared by every weight guard (``nanwatch.hooks.measure.spikes``'
    ``SpikeSkip``; None: not asked). ``replicas``: makes the replica check on the first optimizer covered,
    called as ``replicas(optimizer, optimizers=...)`` (``nanwatch.hooks.remedies.replica_check.ReplicaCheck``
    with its options bound; None: no replica check). Both come built from the Monitor.

    Example usage::

        hooks = OptimizerHooks(model_ref, config=cfg.weights, spiked=None, replicas=None, rec=rec,
                               warn=WarnOnce(), rerun_tap=probes.rerun)
        hooks.guard(opt)   # weight guard on, and checked
        ...
        hooks.remove()
    """

    def __init__(self, model: weakref.ref[torch.nn.Module], *, config: WeightsConfig,
                 spiked: Callable[[], bool] | None, replicas: Callable[..., Any] | None, rec: Recorder,
                 warn: WarnOnce, rerun_tap: RerunTap | None,
                 check_every: int = 1, before_update: Callable[[], None] | None = None) -> None:
        self._model = model
        self._check_every = check_every
        self._before_update = before_update
        self._config = config
        self._replicas = replicas
        self._rec = rec
        self._warn = warn
        self._rerun_tap = rerun_tap
        self._weight_guards: list[WeightGuard] = []
        self._checks: dict[int, OptimizerCheck] = {}  # id(optimizer) -> its post-step check
        self._discovery: OptimizerDiscovery | None = None
        self._steps_unfound = 0  # training steps with no optimizer found (attach without optimizer=)
        self.replicas: Any = None  # the replica check, on the first optimizer covered (replica_check_every)
        self._handles: list = []
        #: ``spike_action="skip"``: the open step's spike check, shared by every guard (None: not asked)
        self._spike_skip = spiked

    def discover(self, model: torch.nn.Module) -> None:
        """Find the optimizers stepping ``model``'s parameters at their first step (:meth:`found`), until
        :meth:`remove`."""
        self._discovery = OptimizerDiscovery(model, on_found=self.found)
        self._handles.append(self._discovery)

    def guard(self, optimizer: torch.optim.Optimizer) -> WeightGuard:
        """``Monitor.guard``'s body: the weight guard on ``optimizer`` (a new one, or the one there)."""
        existing = guard_of(optimizer)
        if existing is not None:
            if existing not in self._weight_guards:
                self._warn(f"{type(existing.optimizer).__name__} is guarded by another Monitor already; "
                           "it is not guarded twice")
            return existing
        g = WeightGuard(optimizer, rec=self._rec, spiked=self._spike_skip)
        self._weight_guards.append(g)
        self._handles.append(g)
        if self._before_update is not None:  # the rerun's last chance on the weights a step saw
            self._handles.append(g.optimizer.register_step_pre_hook(self._pre_step))
        self.check(optimizer)
        self._check_replicas(g.optimizer)
        if self._rerun_tap is not None:
            self._rerun_tap.keep_forward_inputs(self.effective)
        return g

    def check(self, optimizer: torch.optim.Optimizer) -> None:
        """Check the parameters ``optimizer`` writes after each of its steps (``optimizer_check``)."""
        opt = inner_optimizer(optimizer)
        model = self._model()
        if not self._config.optimizer_check or id(opt) in self._checks or model is None:
            return
        check = OptimizerCheck(opt, rec=self._rec, names={id(p): n for n, p in model.named_parameters()},
                               every=self._check_every)
        self._checks[id(opt)] = check
        self._handles.append(check)
        self._check_replicas(opt)

    def _check_replicas(self, optimizer: torch.optim.Optimizer) -> None:
        """The replica check on the first optimizer covered (``replica_check_every``): every rank covers the
        same optimizer at the same point (attach, or its first step), so its collectives are issued alike."""
        if self.replicas is None and self._replicas is not None and self._config.replica_check_every:
            self.replicas = self._replicas(optimizer, optimizers=self.optimizers)
            self._handles.append(self.replicas)

    def found(self, optimizer: torch.optim.Optimizer, args: tuple = (), kwargs: dict | None = None
              ) -> tuple[tuple, dict] | None:
        """Discovery (inside ``optimizer``'s first step, its pre-hook, training thread): check it and, under
        ``guard="auto"``, guard it from now on and decide this call by dropping its gradients when the
        step's flag is set; a ``step(closure)``'s closure runs here first (its forward and backward are the
        step's), and the step's new arguments come back (a closure returning that run's result). Every rank
        finds the same optimizer at the same step, so the flag's reduction is issued on every rank."""
        contained(self.check, optimizer)
        if self._config.guard != "auto" or guard_of(optimizer) is not None:
            return None
        try:
            g = self.guard(optimizer)
        except Exception as exc:  # noqa: BLE001 - monitoring must not break the step
            probe_failed(exc)
            return None
        log.info("nanwatch: guarding %s, found stepping the model's parameters", type(g.optimizer).__name__)
        # a pre-hook's args start with the optimizer (step's self); the user's closure: its exception is the step's
        head, rest = (args[:1], args[1:]) if args and args[0] is optimizer else ((), args)
        had, _, rest, kwargs = run_closure(rest, kwargs or {})
        contained(drop_grads_if_flagged, g.optimizer, self._rec)
        return ((*head, *rest), kwargs) if had else None

    @property
    def effective(self) -> bool:
        """Some weight guard skips a flagged step."""
        return bool(self._weight_guards)

    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers guarded or checked (their state joins the rotating parameter check)."""
        opts = {id(c.optimizer): c.optimizer for c in self._checks.values()}
        opts.update((id(g.optimizer), g.optimizer) for g in self._weight_guards)
        return list(opts.values())

    def _pre_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        if self._before_update is not None and not torch.compiler.is_compiling():
            contained(self._before_update)

    def unread_updates(self) -> bool:
        """An optimizer update ran after its optimizer check last read the parameters (the check is
        amortised: ``optimizer_check_every``)."""
        return any(c.unread for c in self._checks.values())

    def at_step_start(self) -> None:
        """The weights this step starts from, as the last update left them (``OptimizerCheck.carry``)."""
        for check in self._checks.values():
            contained(check.carry)

    def at_step_end(self) -> None:
        """Discovery on and still no optimizer: after ``UNFOUND_AFTER_STEPS`` training steps, say so, once."""
        if self._discovery is not None and not self._checks and not self._weight_guards:
            contained(self._note_unfound)

    def _note_unfound(self) -> None:
        self._steps_unfound += self._rec.trained
        if self._steps_unfound == UNFOUND_AFTER_STEPS:
            self._warn(f"no torch.optim optimizer stepped this model's parameters in {UNFOUND_AFTER_STEPS} "
                       "training steps: the weights are not guarded and the optimizer update is not "
                       "checked. Pass attach(..., optimizer=opt), or call monitor.guard(opt); an optimizer "
                       "that is not a torch.optim.Optimizer cannot be guarded (use should_skip_step())")

    def remove(self) -> None:
        """Take every hook off, last installed first (the Monitor's close)."""
        while self._handles:  # last installed, first removed
            self._handles.pop().remove()
