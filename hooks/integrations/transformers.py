"""HF ``Trainer`` integration: one callback, one line.

Example usage::

    from nanwatch.hooks.integrations.transformers import NanwatchCallback

    trainer = Trainer(model, args, train_dataset=ds,
                      callbacks=[NanwatchCallback(run_id="sft-0412", collector="http://collector:8000")])
    trainer.train()

The callback attaches a Monitor when training begins (to the model the trainer calls, so DDP and
``torch.compile`` wrappers are seen through and their boundary is measured) and detaches when it ends.
A nanwatch step is one optimizer step (``state.global_step``), gradient-accumulation micro-batches
included. Eval forwards (the model in eval mode) and ``generate()`` forwards are labelled with their
stage. A step that raises is still reported: the Monitor reports its open step when it closes, also at
interpreter exit. The trainer's optimizer gets the weight guard (``Monitor.guard``): a step that saw a
non-finite value does not update the weights, at no cost with a fused optimizer (HF's default
``adamw_torch_fused``), at one host read per step with any other ``torch.optim`` optimizer (``adamw_torch``,
``sgd``, Adafactor, 8-bit ones); an optimizer created later (FSDP, DeepSpeed) is found at its first step.
``NanwatchCallback(run_id=..., guard="off")`` opts out. Its updates are checked after each step
(``optimizer_check``), so a NaN the optimizer itself writes is named at that step.
For a TRL ``GRPOTrainer`` the GRPO adapter (:mod:`nanwatch.hooks.integrations.trl`) adds logprob, ratio and
KL health without a subclass.
"""

from __future__ import annotations

import logging
import sys
import warnings
from typing import Any

from nanwatch.hooks.call_stack import nearest_self
from nanwatch.hooks.config import MonitorConfig
from nanwatch.hooks.facade import Monitor
from nanwatch.hooks.integrations.log_scalars import LogScalars

__all__ = ["NanwatchCallback"]

log = logging.getLogger("nanwatch")


def _trainer_base() -> type:
    try:
        from transformers import TrainerCallback
    except ImportError as e:  # pragma: no cover - transformers is the point of this module
        raise ImportError("nanwatch.hooks.integrations.transformers needs transformers installed") from e
    return TrainerCallback


def _find_trainer(callback: object, max_depth: int = 12) -> Any | None:
    """The Trainer firing this event: the nearest ``self`` up the call stack whose callback handler holds
    ``callback`` (callbacks are not handed the trainer, and TRL's adapter needs it), starting at the
    frame that called the event method (two above this one)."""

    def holds_callback(obj: object) -> object | None:
        handler = getattr(obj, "callback_handler", None)
        return obj if handler is not None and callback in getattr(handler, "callbacks", ()) else None

    return nearest_self(holds_callback, skip=2, max_depth=max_depth)


class NanwatchCallback(_trainer_base()):
    """Attach nanwatch to a HF ``Trainer`` (or TRL trainer) for the length of ``train()``.

    ``run_id`` and ``collector`` are as for ``nanwatch.attach``; ``options`` are ``MonitorConfig`` fields
    (``rank`` and ``world_size`` default to the trainer's process index and world size).
    """

    def __init__(self, run_id: str, collector: str | None = None, **options: Any) -> None:
        super().__init__()
        MonitorConfig(run_id=run_id, collector=collector, **options)  # bad options fail here, not mid-run
        self._run_id, self._collector, self._options = run_id, collector, options
        self.monitor: Monitor | None = None
        """The run's Monitor: attached during ``train()``, and still readable after it (``last_report()``)."""
        self._training = False  # between on_train_begin and close(): step events reach the Monitor
        self._scalars = LogScalars()
        self._undo: list[Any] = []

    # ---- lifecycle -------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.close()  # a second train() on the same callback starts afresh
        trainer = _find_trainer(self)
        # never by truthiness: a torch.compile'd HF model answers bool() through len(), which it refuses
        wrapped = getattr(trainer, "model_wrapped", None)
        target = wrapped if wrapped is not None else model
        if target is None:
            warnings.warn("nanwatch: the trainer handed the callback no model; nothing is monitored",
                          RuntimeWarning, stacklevel=2)
            return
        options = {"rank": args.process_index, "world_size": args.world_size, **self._options}
        options["on_report"] = self._scalars.observer(self._options.get("on_report"))
        config = MonitorConfig(run_id=self._run_id, collector=self._collector, **options)
        self.monitor = Monitor(target, config).attach(optimizer=optimizer)
        self._training = True
        if trainer is not None:  # nanwatch/* scalars in the Trainer's own logs (W&B, TensorBoard, MLflow...)
            self._undo.append(self._scalars.wrap_log(trainer))
        if trainer is not None and "trl" in sys.modules:  # a TRL trainer, or a user's subclass of one
            from nanwatch.hooks.integrations.trl import instrument

            handle = instrument(trainer, self.monitor)
            if handle is not None:
                self._undo.append(handle)

    def on_step_begin(self, args, state, control, **kwargs):
        if self._training:
            self.monitor.begin_step(state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        if self._training:
            # global_step was incremented just before this event: the step that ran is the one opened
            self.monitor.end_step()

    def on_train_end(self, args, state, control, **kwargs):
        self.close()

    def close(self, timeout: float = 10.0) -> None:
        """Detach (reporting a step left open) and undo every wrap. Also done at interpreter exit. The
        Monitor stays readable afterwards (``callback.monitor.last_report()``), until the next ``train()``."""
        while self._undo:
            self._undo.pop().remove()
        self._training = False
        if self.monitor is not None:
            self.monitor.close(timeout)
