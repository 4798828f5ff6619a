"""The weight guard: a training step in which a monitored site saw a non-finite value does not update the
weights, and finding that out costs no host sync.

Fused optimizers (``Adam``/``AdamW``/``SGD``/``Adagrad`` with ``fused=True``, on CPU and CUDA) take a
``found_inf`` device tensor, which is how ``GradScaler`` skips steps without a sync: their kernels leave
the parameters (and the step count) alone where it is non-zero. The guard hands them nanwatch's own flag,
the step's non-finite count read straight from the device buffer. With a ``GradScaler`` in use, the
scaler sets its ``found_inf`` first and calls ``step()``; the guard combines the two, so either flag
skips the step and the scaler's own bookkeeping (``update()``) is untouched.

Other optimizers read no such flag. For them the guard can only decide on the host: ``sync=True`` pays
one sync per step (as GradScaler does for them); otherwise it warns once, names the optimizers that would
make it free, and only the opt-in ``skip_step`` directive (one sync then) protects the weights.

Under torch.distributed the flag every path reads is the job's, not the rank's: reduced (MAX) over the
training process group before the optimizer reads it (``Recorder.job_nonfinite_flag``, one async
collective, see ``nanwatch.hooks.collective``), so every rank skips the step any rank saw a non-finite
value in. The reduction is issued whenever the guard decides, and it decides under conditions that are
the same on every rank: the optimizer's kind (fused or not), ``sync=``, and the ``skip_step`` mode, which
ranks agree on. A reduction that fails (it should not) is a warning, and the rank decides on its own flag.
With gradient accumulation the flag covers every micro-batch of the nanwatch step, i.e. of the optimizer
step when the step spans it (the HF callback's does).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from nanwatch.hooks.directive_state import DirectiveState
from nanwatch.hooks.failsafe import WarnOnce, probe_failed
from nanwatch.hooks.recorder import Recorder

__all__ = ["WeightGuard", "inner_optimizer"]

log = logging.getLogger("nanwatch")


def inner_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside wrappers: Accelerate's ``AcceleratedOptimizer`` (itself an Optimizer
    subclass) keeps it in ``.optimizer`` and its ``step`` calls the inner one, through the GradScaler when
    there is one."""
    seen = set()
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer) and id(optimizer) not in seen:
        seen.add(id(optimizer))
        optimizer = optimizer.optimizer
    return optimizer


class WeightGuard:
    """Wraps one optimizer's ``step`` on the instance; ``remove()`` puts it back."""

    def __init__(self, optimizer: Any, *, rec: Recorder, directive_state: DirectiveState, sync: bool,
                 warn: WarnOnce) -> None:
        opt = self.optimizer = inner_optimizer(optimizer)
        self.fused = bool(getattr(opt, "_step_supports_amp_scaling", False))
        self.effective = self.fused or sync
        if not self.effective:
            warn(f"the weight guard cannot skip a step of {type(opt).__name__} without a host sync: pass "
                 "guard(optimizer, sync=True) (one sync per step), or use a fused optimizer (Adam, AdamW, "
                 "SGD or Adagrad with fused=True), which the guard protects at no cost. Until then only the "
                 "skip_step directive protects the weights")
        self._rec = rec
        original = opt.step

        @functools.wraps(original)  # GradScaler inspects step()'s signature: keep the original's
        def step(*args, **kwargs):
            if not (self.fused or sync or directive_state.mode == "skip_step"):
                return original(*args, **kwargs)  # unguarded (warned): the flag would go unused
            flag = self._flag()
            rec.note_guard_skipped(flag)
            if self.fused:
                scaler_flag = opt.__dict__.get("found_inf")  # set by a GradScaler for this call
                opt.found_inf = flag if scaler_flag is None else torch.maximum(
                    scaler_flag, flag.to(scaler_flag.device))
                try:
                    return original(*args, **kwargs)
                finally:
                    if scaler_flag is None:
                        del opt.found_inf
                    else:
                        opt.found_inf = scaler_flag
            if bool(flag):  # sync-ok: non-fused optimizer, sync=True or the skip_step directive
                log.warning("nanwatch: non-finite values in this step: optimizer step skipped")
                return None
            return original(*args, **kwargs)

        opt.step = step

    def _flag(self) -> torch.Tensor:
        """The job's non-finite flag for this optimizer step (device ops and, under torch.distributed, the
        one reduction); this rank's own flag if the reduction fails."""
        try:
            return self._rec.job_nonfinite_flag()
        except Exception as exc:  # noqa: BLE001 - monitoring must not break the step
            probe_failed(exc)
            return self._rec.nonfinite_flag()

    def remove(self) -> None:
        self.optimizer.__dict__.pop("step", None)
