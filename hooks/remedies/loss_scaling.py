"""Dynamic loss scaling seen by nanwatch: a ``torch.amp.GradScaler`` that finds inf/NaN gradients, skips the
update and lowers the scale is working as designed (#18), so such a step is reported as
``scaler_overflow=True`` with its ``loss_scale``, and starts no incident, no rerun, no NaN episode and no
directive. A forward non-finite value in the same step (the loss itself went NaN) is a real incident.

**Which scaler.** ``attach(..., scaler=)`` or ``Monitor.watch_scaler(scaler)``; the HF callback watches
Accelerate's ``trainer.accelerator.scaler``; and any ``torch.amp.GradScaler`` (``torch.cuda.amp``'s is a
subclass) whose ``step(optimizer)`` steps a parameter of the model is found at that call: while a Monitor is
attached, ``GradScaler.step`` is patched at the class (like SDPA in ``nanwatch.hooks.instrument.patching``), and a
scaler it sees is wrapped on the instance from then on. A scaler found so is watched from that call on,
the overflowing first steps of a run included (``scaler.step`` runs in every step, overflowing or not).

**What is read, and when** (torch 2.1 to 2.13, ``torch/amp/grad_scaler.py``; private names are read in
``try`` and a failure is one warning, never an exception into training):

- ``found_inf``: after each ``scaler.step(optimizer)`` returns, ``_found_inf_per_device(optimizer)`` (a
  private accessor of ``_per_optimizer_states[id(optimizer)]["found_inf_per_device"]``) holds the device
  tensors the scaler's unscale (or, for fused optimizers, ``_check_inf_per_device``) wrote, in both the fused
  and the non-fused path. They are maxed into the step's slot buffer on the device: no host read. They must
  be read there: ``scaler.update()`` clears them.
- ``loss_scale``: ``scaler._scale`` (a 0-d float32 device tensor) copied into the slot buffer at the step's
  end, on the device. It is the scale **in force when the nanwatch step ends**: after this step's
  ``update()`` when ``update()`` runs inside the step (the usual loop, and HF/Accelerate, whose optimizer step
  calls it); the scale this step's backward used when a loop calls ``update()`` after closing the step.

The one host read: in rerun mode on the CPU (``MonitorConfig.forensics.rerun``) the Monitor already reads the step's
non-finite flag on the host; when it is set and the scaler found inf, the found flag and the open step's
phases are read too (``# sync-ok``), so that an overflow does not start the differential rerun. On an
accelerator the rerun decides a step later, from the step's decoded values (``SCALER_FOUND`` and the phases,
``nanwatch.hooks.measure.scaler_overflow``): no read in the step.
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from nanwatch.hooks.failsafe import WarnOnce, probe_failed
from nanwatch.hooks.measure.recorder import Recorder
from nanwatch.hooks.measure.scaler_overflow import LOSS_SCALE, SCALER_FOUND
from nanwatch.hooks.remedies.optimizer_discovery import inner_optimizer, steps_model

__all__ = ["LossScaling", "ScalerWatch", "is_scaler"]

log = logging.getLogger("nanwatch")

_GradScaler = getattr(getattr(torch, "amp", None), "GradScaler", None)
_ORIGINAL_STEP = _GradScaler.step if _GradScaler is not None else None
_lock = threading.Lock()
_discovering: list[LossScaling] = []
#: scaler -> its watch (one watch per scaler, whatever number of Monitors see it)
_watched: weakref.WeakKeyDictionary[Any, ScalerWatch] = weakref.WeakKeyDictionary()


def is_scaler(obj: object) -> bool:
    """A dynamic loss scaler nanwatch can read: a ``torch.amp.GradScaler`` (or subclass)."""
    return _GradScaler is not None and isinstance(obj, _GradScaler)


class ScalerWatch:
    """One watched scaler: ``step`` wrapped on the instance; ``remove()`` puts back what was there."""

    def __init__(self, scaler: Any, owner: LossScaling) -> None:
        self.scaler = scaler
        self.owner = owner
        self.removed = False
        self._previous = scaler.__dict__.get("step")
        original = scaler.step

        @functools.wraps(original)
        def step(optimizer, *args, **kwargs):
            out = original(optimizer, *args, **kwargs)
            if not self.removed:
                self.owner.note(self, optimizer)
            return out

        self._installed = scaler.step = step
        _watched[scaler] = self

    def enabled(self) -> bool:
        try:
            return bool(self.scaler.is_enabled()) and self.scaler._scale is not None
        except Exception:  # noqa: BLE001 - a scaler of another shape: nothing to read
            return False

    def remove(self) -> None:
        self.removed = True
        if self.scaler.__dict__.get("step") is self._installed:
            if self._previous is None:
                del self.scaler.__dict__["step"]
            else:
                self.scaler.step = self._previous
        if _watched.get(self.scaler) is self:
            del _watched[self.scaler]


def _discovering_step(self, optimizer, *args, **kwargs):
    """``GradScaler.step`` while a Monitor is attached: a scaler stepping a watched model's optimizer is
    watched from this call on."""
    found = None
    if self not in _watched:
        for scaling in list(_discovering):
            try:
                found = scaling.offer(self, optimizer)
            except Exception as exc:  # noqa: BLE001 - monitoring must not break the step
                probe_failed(exc)
            if found is not None:
                break
    out = _ORIGINAL_STEP(self, optimizer, *args, **kwargs)
    if found is not None:
        found.owner.note(found, optimizer)
    return out


if _ORIGINAL_STEP is not None:
    functools.update_wrapper(_discovering_step, _ORIGINAL_STEP)


class LossScaling:
    """The scalers one Monitor watches, and the discovery of the others. Training thread."""

    def __init__(self, rec: Recorder, *, model: Callable[[], torch.nn.Module | None], warn: WarnOnce,
                 discover: bool = True) -> None:
        self._rec = rec
        self._model = model  # weak: a scaler found stepping another model's optimizer is left alone
        self._warn = warn
        self.watches: list[ScalerWatch] = []
        self._refused: weakref.WeakSet = weakref.WeakSet()  # optimizers of other models: looked at once
        #: this step's found_inf device tensors, for the rerun-mode decision (``overflow_found``)
        self._found: list[torch.Tensor] = []
        self._discover = discover and _ORIGINAL_STEP is not None
        if self._discover:
            with _lock:
                _discovering.append(self)
                if len(_discovering) == 1:
                    _GradScaler.step = _discovering_step

    def watch(self, scaler: Any) -> ScalerWatch | None:
        """Watch ``scaler`` (a GradScaler); one already watched (here or by another Monitor) is not wrapped
        twice. Anything else: a warning, and None."""
        if not is_scaler(scaler):
            self._warn(f"watch_scaler: {type(scaler).__name__} is not a torch.amp.GradScaler; loss scaling is "
                       "not watched")
            return None
        existing = _watched.get(scaler)
        if existing is not None and not existing.removed:
            return existing
        w = ScalerWatch(scaler, self)
        self.watches.append(w)
        return w

    def offer(self, scaler: Any, optimizer: torch.optim.Optimizer) -> ScalerWatch | None:
        """Discovery, inside ``scaler.step(optimizer)``: watch it if ``optimizer`` steps this model."""
        opt = inner_optimizer(optimizer)
        if opt in self._refused:
            return None
        if not steps_model(self._model(), opt):
            self._refused.add(opt)
            return None
        w = self.watch(scaler)
        if w is not None:
            log.info("nanwatch: watching %s, found stepping the model's optimizer", type(scaler).__name__)
        return w

    @property
    def active(self) -> bool:
        return any(w.enabled() for w in self.watches)

    def note(self, watch: ScalerWatch, optimizer: Any) -> None:
        """After ``watch.scaler.step(optimizer)``: its found_inf into the step's slot (device ops only)."""
        try:
            scaler = watch.scaler
            if not watch.enabled():
                return
            if hasattr(scaler, "_found_inf_per_device"):
                per_device = scaler._found_inf_per_device(optimizer)
            else:  # torch before the accessor: the dict it reads
                per_device = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
            for t in per_device.values():
                t = t.detach().float().reshape(())
                self._rec.slot(SCALER_FOUND, t, how="max")
                self._found.append(t)
        except Exception as exc:  # noqa: BLE001 - another torch's scaler: say so once, carry on
            self._warn(f"could not read the GradScaler's found_inf ({exc!r}): loss-scale overflows are "
                       "reported as non-finite steps")

    def at_step_end(self) -> None:
        """Training thread, before the step's hand-over: the scale into its slot, and the step marked as run
        under loss scaling (device ops only)."""
        live = [w for w in self.watches if not w.removed and w.enabled()]
        if not live:
            return
        try:
            self._rec.figure(LOSS_SCALE, live[-1].scaler._scale.detach().float())
        except Exception as exc:  # noqa: BLE001
            self._warn(f"could not read the GradScaler's scale ({exc!r}); loss_scale is not reported")

    def overflow_found(self) -> bool:
        """Whether a watched scaler found inf/NaN gradients in the open step: a host read of its flag (the
        caller's ``# sync-ok``: rerun mode only)."""
        return any(bool(t) for t in self._found)  # sync-ok: rerun mode, a step whose flag is already set

    def new_step(self) -> None:
        self._found = []

    def remove(self) -> None:
        while self.watches:
            self.watches.pop().remove()
        if self._discover:
            self._discover = False
            with _lock:
                if self in _discovering:
                    _discovering.remove(self)
                if not _discovering and _GradScaler.__dict__.get("step") is _discovering_step:
                    _GradScaler.step = _ORIGINAL_STEP
