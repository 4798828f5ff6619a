"""The weight guard: a training step in which a monitored site saw a non-finite value does not update the
weights. Every ``torch.optim.Optimizer`` is guarded by default (``MonitorConfig.weights.guard="auto"``).

Fused optimizers (``Adam``/``AdamW``/``SGD``/``Adagrad`` with ``fused=True``, on CPU and CUDA) take a
``found_inf`` device tensor, which is how ``GradScaler`` skips steps without a sync: their kernels leave
the parameters (and the step count) alone where it is non-zero. The guard hands them nanwatch's own flag,
the step's non-finite count read straight from the device buffer: free. With a ``GradScaler`` in use, the
scaler sets its ``found_inf`` first and calls ``step()``; the guard combines the two, so either flag
skips the step and the scaler's own bookkeeping (``update()``) is untouched.

Other optimizers (foreach or for-loop AdamW, SGD, Adafactor, 8-bit optimizers...) read no such flag, and
no cheaper sound skip exists for them: zeroing the gradients still moves the weights (momentum, weight
decay), NaN times zero is NaN, and restoring the parameters and state afterwards costs a copy of both.
So the guard reads the flag on the host, once per optimizer step, and skips the call when it is set: the
sync GradScaler already pays for them (``sync-ok``). On a CPU that read costs nothing (the ops already
ran); on a GPU it waits for the step's queued kernels before the optimizer's are launched. Measured by
``nanwatch bench optimizer`` (README, 'Speed'). ``MonitorConfig.weights.guard="off"`` leaves optimizers
unguarded unless ``Monitor.guard`` is called on one.

``optimizer.step(closure)`` (LBFGS always; any optimizer, and Lightning's automatic optimization): the
forward and backward run inside ``step()``, after the guard was entered. So the guard runs the closure
first itself (under ``torch.enable_grad()``, as the optimizers do), then decides on the flag, which now
covers that forward and backward, then calls the real ``step`` with a closure (:class:`FirstResult`) whose
first call returns what the guard's run returned and whose later calls (LBFGS' line search) call the
user's closure: the closure runs exactly as often as without nanwatch. A skipped step does not call the
real ``step`` (or, fused, passes the flag as ``found_inf``) and returns the closure's loss, as ``step``
would. The cost rules are the same with a closure: fused, the flag stays on the device; other optimizers,
one host read. The decision covers the first evaluation (the gradient at the current weights); an LBFGS
evaluation at a trial point later in the same step is measured and reported, and a value it writes into
the weights is named by the optimizer check, but that step is not undone. The discovery pre-hook
(``nanwatch.hooks.remedies.optimizer_discovery``) does the same at an optimizer's first step.

The guard wraps ``step`` on the instance as a bound method (an LR scheduler created later wraps it in
turn, through ``step.__func__``) and ``remove()`` puts back what was there, or, when something wrapped it
since, turns the wrapper into a pass-through. An optimizer is guarded once, whatever number of Monitors
or ``guard()`` calls see it (:func:`guard_of`).

Under torch.distributed the flag every path reads is the job's, not the rank's: reduced (MAX) over the
training process group before the optimizer reads it (``Recorder.nonfinite_flag(job=True)``, one async
collective, see ``nanwatch.hooks.measure.collective``), so every rank skips the step any rank saw a non-finite
value in. The reduction is issued whenever the guard decides, and it decides under conditions that are
the same on every rank: the optimizer's kind (fused or not) and ``MonitorConfig.weights.guard``, and the
``skip_step`` mode, which ranks agree on. A reduction that fails (it should not) is a warning, and the rank
decides on its own flag. With ``spike_action="skip"`` a step that spiked on a rank (``nanwatch.hooks.measure.spikes``,
read on the host before the optimizer step: one read per optimizer step, that opt-in's cost, fused or not)
sets that rank's flag before the reduction, so every rank skips it too. With gradient accumulation the flag covers every micro-batch of the nanwatch step,
i.e. of the optimizer step when the step spans it (the HF callback's does).
"""

from __future__ import annotations

import functools
import logging
import types
import weakref
from collections.abc import Callable
from typing import Any

import torch

from nanwatch.hooks.failsafe import probe_failed
from nanwatch.hooks.measure.recorder import GUARD_SKIPPED, Recorder
from nanwatch.hooks.remedies.optimizer_discovery import inner_optimizer

__all__ = ["FirstResult", "WeightGuard", "asks_skip", "drop_grads_if_flagged", "guard_of", "run_closure"]

log = logging.getLogger("nanwatch")

#: optimizer -> its guard (weak both ways: the guard holds its optimizer, and its Monitor holds the guard)
_guards: weakref.WeakKeyDictionary[torch.optim.Optimizer, weakref.ref[WeightGuard]] = weakref.WeakKeyDictionary()


def guard_of(optimizer: Any) -> WeightGuard | None:
    """The guard on ``optimizer`` (seen through wrappers), if one is installed."""
    ref = _guards.get(inner_optimizer(optimizer))
    g = ref() if ref is not None else None
    return g if g is not None and not g.removed else None


def is_fused(optimizer: torch.optim.Optimizer) -> bool:
    """The optimizer's step takes ``found_inf`` (fused kernels): it can skip on the device."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def job_flag(rec: Recorder, *, spiked: bool = False) -> torch.Tensor:
    """The job's non-finite flag for an optimizer step (device ops and, under torch.distributed, the one
    reduction); this rank's own flag if the reduction fails. ``spiked``: set it (``spike_action="skip"``)."""
    try:
        return rec.nonfinite_flag(job=True, spiked=spiked)
    except Exception as exc:  # noqa: BLE001 - monitoring must not break the step
        probe_failed(exc)
        return rec.nonfinite_flag(spiked=spiked)


def asks_skip(spiked: Callable[[], bool] | None) -> bool:
    """``spike_action="skip"``'s verdict on the open step (False when off, or when the check fails)."""
    if spiked is None:
        return False
    try:
        return spiked()
    except Exception as exc:  # noqa: BLE001 - monitoring must not break the step
        probe_failed(exc)
        return False


class FirstResult:
    """The closure handed to the real ``step()`` once the guard ran the user's closure itself: its first
    call returns what that run returned (the optimizer's first evaluation is the one the guard decided on,
    not a second forward and backward), later calls (LBFGS' line search) call the user's closure."""

    def __init__(self, result: Any, closure: Any) -> None:
        self.result, self.closure, self.used = result, closure, False

    def __call__(self) -> Any:
        if self.used:
            return self.closure()
        self.used = True
        return self.result


def run_closure(args: tuple, kwargs: dict) -> tuple[bool, Any, tuple, dict]:
    """``optimizer.step(closure)``'s closure run now, before the guard decides (its forward and backward
    are what the step's flag must cover): (whether there was one, what it returned, and ``step``'s
    arguments with :class:`FirstResult` in its place). Run under ``torch.enable_grad()``, as every
    ``torch.optim`` optimizer calls it."""
    closure = kwargs.get("closure") if "closure" in kwargs else args[0] if args else None
    if closure is None or not callable(closure):
        return False, None, args, kwargs
    with torch.enable_grad():
        result = closure()
    first = FirstResult(result, closure)
    if "closure" in kwargs:
        return True, result, args, {**kwargs, "closure": first}
    return True, result, (first, *args[1:]), kwargs


def drop_grads_if_flagged(optimizer: torch.optim.Optimizer, rec: Recorder) -> bool:
    """Inside an optimizer's step already (its pre-hook): skip this call by dropping the gradients of its
    parameters when the job's flag is set (every ``torch.optim`` optimizer skips a parameter whose
    ``grad`` is None). One host read; True when dropped."""
    flag = job_flag(rec)
    rec.slot(GUARD_SKIPPED, flag, how="max")
    if not bool(flag):  # sync-ok: an optimizer found at its first step, once (what the guard pays per step)
        return False
    for group in optimizer.param_groups:
        for p in group["params"]:
            p.grad = None
    log.warning("nanwatch: non-finite values in this step: %s step skipped (gradients dropped)",
                type(optimizer).__name__)
    return True


class WeightGuard:
    """Wraps one optimizer's ``step`` on the instance; ``remove()`` puts it back. A non-fused optimizer is
    guarded at one host read of the flag per step; a fused one reads nothing (free)."""

    def __init__(self, optimizer: Any, *, rec: Recorder, spiked: Callable[[], bool] | None = None) -> None:
        opt = self.optimizer = inner_optimizer(optimizer)
        self.fused = is_fused(opt)
        self.removed = False
        self._rec = rec
        self._previous = opt.__dict__.get("step")  # an instance wrapper already there (an LR scheduler's)
        original = opt.step
        func = getattr(original, "__func__", original)

        @functools.wraps(func)  # GradScaler and LR schedulers inspect step(): keep the original's signature
        def step(_opt, *args, **kwargs):
            if self.removed:
                return original(*args, **kwargs)  # removed under another wrapper
            # step(closure): the forward and backward run now, so that the flag covers them
            _, loss, args, kwargs = run_closure(args, kwargs)
            spike = asks_skip(spiked)  # spike_action="skip": one host read (its opt-in cost)
            flag = job_flag(rec, spiked=spike)
            rec.slot(GUARD_SKIPPED, flag, how="max")
            if self.fused:
                return self._fused_step(original, flag, args, kwargs)
            if bool(flag):  # sync-ok: non-fused optimizer (GradScaler pays the same), or the skip_step directive
                log.warning("nanwatch: %s in this step: optimizer step skipped",
                            "a spike (spike_action='skip')" if spike else "non-finite values")
                return loss  # the closure's loss, as step() would have returned it (None without one)
            return original(*args, **kwargs)

        self._installed = opt.step = types.MethodType(step, opt)
        _guards[opt] = weakref.ref(self)

    def _fused_step(self, original: Any, flag: torch.Tensor, args: tuple, kwargs: dict) -> Any:
        """A fused optimizer's step with the flag as its ``found_inf`` (combined with a GradScaler's):
        its kernels skip the update on the device, no host read."""
        opt = self.optimizer
        scaler_flag = opt.__dict__.get("found_inf")  # set by a GradScaler for this call
        opt.found_inf = flag if scaler_flag is None else torch.maximum(scaler_flag, flag.to(scaler_flag.device))
        try:
            return original(*args, **kwargs)
        finally:
            if scaler_flag is None:
                del opt.found_inf
            else:
                opt.found_inf = scaler_flag

    def remove(self) -> None:
        self.removed = True
        opt = self.optimizer
        if opt.__dict__.get("step") is self._installed:
            if self._previous is None:
                del opt.__dict__["step"]
            else:
                opt.step = self._previous
        # else: something wrapped it since (an LR scheduler created later); the wrapper now passes through
        ref = _guards.get(opt)
        if ref is not None and ref() is self:
            del _guards[opt]
