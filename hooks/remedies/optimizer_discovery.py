"""Optimizer discovery: the optimizers that step a model's parameters, found at their first step, so that
``attach(model)`` without ``optimizer=`` still guards and checks them (#17: it guarded nothing, silently).

A global ``torch.optim.optimizer.register_optimizer_step_pre_hook`` runs before every step of every
``torch.optim.Optimizer`` subclass in the process (Adafactor, bitsandbytes' 8-bit optimizers and
Accelerate's inner optimizers are such subclasses). Each optimizer is looked at once (a weak set; later
steps cost one set lookup): one whose parameter groups hold a parameter of the model is handed to the
Monitor, which guards it from then on and, for this first call, is already inside its step (the pre-hook
decides it: ``nanwatch.hooks.remedies.weight_guard.drop_grads_if_flagged``; a ``step(closure)``'s closure is
run there first, and the step gets a closure that returns that run's result: ``on_found`` may return new
``(args, kwargs)`` for the step, as a step pre-hook may). Other models' optimizers are left
alone, and an optimizer already guarded (passed explicitly, or by another Monitor) is not guarded twice.
The hook is removed when the Monitor closes.

What it cannot see: an optimizer that is not a ``torch.optim.Optimizer`` (or one whose subclass skips
``Optimizer.__init__``, so that its ``step`` runs no hooks). The Monitor says so, loudly, when steps
train and no optimizer was found (:data:`UNFOUND_AFTER_STEPS`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from nanwatch.hooks.failsafe import probe_failed

__all__ = ["UNFOUND_AFTER_STEPS", "OptimizerDiscovery", "inner_optimizer", "steps_model"]

#: Training steps (a training forward in the step) after which a Monitor that found no optimizer says so.
#: More than one, since a loop whose nanwatch steps are micro-batches steps its optimizer every few.
UNFOUND_AFTER_STEPS = 8


def steps_model(model: torch.nn.Module | None, optimizer: torch.optim.Optimizer) -> bool:
    """``optimizer`` updates a parameter of ``model`` (False once the model is gone). Read afresh each call:
    for the rare lookups that need no cache (a GradScaler's first step, ``nanwatch.hooks.remedies.loss_scaling``)."""
    if model is None:
        return False
    ids = {id(p) for p in model.parameters()}
    return any(id(p) in ids for g in optimizer.param_groups for p in g["params"])


def inner_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside wrappers: Accelerate's ``AcceleratedOptimizer`` (itself an Optimizer
    subclass) keeps it in ``.optimizer`` and its ``step`` calls the inner one, through the GradScaler when
    there is one."""
    seen = set()
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer) and id(optimizer) not in seen:
        seen.add(id(optimizer))
        optimizer = optimizer.optimizer
    return optimizer


class OptimizerDiscovery:
    """Calls ``on_found(optimizer, args, kwargs)`` once for each optimizer whose first step updates a
    parameter of ``model`` (from inside that step, before its body runs, with the step's arguments; what it
    returns, None or new ``(args, kwargs)``, is the pre-hook's answer); ``remove()`` takes the global hook
    off.

    Example usage::

        disc = OptimizerDiscovery(model, on_found=lambda opt, args, kwargs: print("found", type(opt).__name__))
        opt.step()        # -> found AdamW
        disc.remove()
    """

    def __init__(self, model: torch.nn.Module, *,
                 on_found: Callable[[torch.optim.Optimizer, tuple, dict], tuple[tuple, dict] | None]) -> None:
        self._params = {id(p) for p in model.parameters()}
        self._model = weakref.ref(model)
        self._on_found = on_found
        self._seen: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self.found = 0
        self._handle = register_optimizer_step_pre_hook(self._pre_step)

    def _pre_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> tuple[tuple, dict] | None:
        if optimizer in self._seen:
            return None
        self._seen.add(optimizer)
        try:
            found = self._steps_model(optimizer)
        except Exception as exc:  # noqa: BLE001 - monitoring must not break the step
            probe_failed(exc)
            return None
        if not found:
            return None  # the step's arguments unchanged
        self.found += 1
        # not contained: the user's closure may run in there, and its exception is the step's
        return self._on_found(optimizer, tuple(args), dict(kwargs))

    def _steps_model(self, optimizer: torch.optim.Optimizer) -> bool:
        ids = self._params
        if any(id(p) in ids for g in optimizer.param_groups for p in g["params"]):
            return True
        model = self._model()  # a wrapper may have swapped the parameters since attach (FSDP flattening)
        if model is None:
            return False
        self._params = ids = {id(p) for p in model.parameters()}
        return any(id(p) in ids for g in optimizer.param_groups for p in g["params"])

    def remove(self) -> None:
        self._handle.remove()
