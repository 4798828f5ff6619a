"""HF ``Trainer`` integration: one callback, one line.

Example usage::

    from nanwatch.hooks.integrations.transformers import NanwatchCallback

    trainer = Trainer(model, args, train_dataset=ds,
                      callbacks=[NanwatchCallback(run_id="sft-0412", collector="http://collector:8000")])
    trainer.train()

The callback attaches a Monitor when training begins (to the model the trainer calls, so DDP and
``torch.compile`` wrappers are seen through and their boundary is measured) and detaches when it ends.
A nanwatch step is one optimizer step, gradient-accumulation micro-batches included, numbered as HF
numbers it in its logs: the ``global_step`` the step ends at (``on_step_begin`` sees it one lower).

Every evaluation is one ``stage="eval"`` report of its own, keyed by HF's ``global_step`` when it ran:
``trainer.evaluate`` and ``trainer.predict`` are wrapped on the instance (from ``on_init_end``, or
``on_train_begin`` for a callback added later), so the evaluations during training, the final one, and a
standalone ``trainer.evaluate()`` (before, after or without ``train()``: the callback attaches for its
length then) are all reported, and none is charged to a training step. ``generate()`` forwards are
labelled with their stage.

Each micro-batch's loss (what ``training_step`` returns) is watched as the site ``loss``: a loss spike
(``MonitorConfig.spikes.factor``× over its recent steps) is reported.

A step that raises is reported with ``raised`` (the exception's type): ``training_step`` is wrapped while
training, so the callback sees the exception, reports the step and detaches before it propagates; anything
else that ends the process is reported at interpreter exit.

Under ``fp16=True`` Accelerate's ``GradScaler`` (``trainer.accelerator.scaler``) is watched: an overflow it
handles is reported as ``scaler_overflow``, with the ``loss_scale`` (``nanwatch.hooks.remedies.loss_scaling``), not as
an incident. ``on_train_end`` sends the run's final report; a ``train()`` that raised sends none.

The trainer's optimizer gets the weight guard (``Monitor.guard``): a step that saw a non-finite value does
not update the weights, at no cost with a fused optimizer (HF's default ``adamw_torch_fused``), at one host
read per step with any other ``torch.optim`` optimizer (``adamw_torch``, ``sgd``, Adafactor, 8-bit ones); an
optimizer created later (FSDP, DeepSpeed) is found at its first step. ``NanwatchCallback(run_id=...,
guard="off")`` opts out. Its updates are checked after each step (``optimizer_check``), so a NaN the
optimizer itself writes is named at that step.
For a TRL ``GRPOTrainer`` or ``RLOOTrainer`` (or a subclass) the adapter (:mod:`nanwatch.hooks.integrations.trl`)
adds logprob, ratio and KL health without a subclass of ours.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from nanwatch.hooks.config import MonitorConfig
from nanwatch.hooks.facade import Monitor
from nanwatch.hooks.integrations.log_scalars import LogScalars
from nanwatch.hooks.measure.call_stack import nearest_self

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

    ``run_id`` and ``collector`` are as for ``nanwatch.attach``; ``options`` are its flat option names
    (``MonitorConfig.from_options``; ``rank`` and ``world_size`` default to the trainer's process index and
    world size).
    """

    def __init__(self, run_id: str, collector: str | None = None, **options: Any) -> None:
        super().__init__()
        MonitorConfig.from_options(run_id=run_id, collector=collector, **options)  # bad options fail here, not mid-run
        self._run_id, self._collector, self._options = run_id, collector, options
        self.monitor: Monitor | None = None
        """The run's Monitor: attached during ``train()``, and still readable after it (``last_report()``)."""
        self._training = False  # between on_train_begin and close(): step events reach the Monitor
        self._scalars = LogScalars()
        self._undo: list[Any] = []
        self._eval_depth = 0  # evaluate() nests (one call per dataset of a dict): the outermost reports

    # ---- lifecycle -------------------------------------------------------------------------------
    def on_init_end(self, args, state, control, **kwargs):
        trainer = _find_trainer(self)
        if trainer is not None:  # a standalone trainer.evaluate() fires no event before its forwards
            self._wrap_evaluation(trainer)

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.close()  # a second train() on the same callback starts afresh
        trainer = _find_trainer(self)
        if trainer is not None:
            self._wrap_evaluation(trainer)
        # never by truthiness: a torch.compile'd HF model answers bool() through len(), which it refuses
        wrapped = getattr(trainer, "model_wrapped", None)
        target = wrapped if wrapped is not None else model
        if target is None:
            warnings.warn("nanwatch: the trainer handed the callback no model; nothing is monitored",
                          RuntimeWarning, stacklevel=2)
            return
        options = {"rank": args.process_index, "world_size": args.world_size, **self._options}
        options["on_report"] = self._scalars.observer(self._options.get("on_report"))
        config = MonitorConfig.from_options(run_id=self._run_id, collector=self._collector, **options)
        self.monitor = Monitor(target, config).attach(optimizer=optimizer)
        self._scalars.follow(self.monitor)
        self._training = True
        scaler = getattr(getattr(trainer, "accelerator", None), "scaler", None)  # fp16: Accelerate's GradScaler
        if scaler is not None:
            try:
                self.monitor.watch_scaler(scaler)
            except Exception as exc:  # noqa: BLE001 - monitoring never breaks training
                log.warning("nanwatch: could not watch the trainer's GradScaler: %r", exc)
        if trainer is not None:  # nanwatch/* scalars in the Trainer's own logs (W&B, TensorBoard, MLflow...)
            self._undo.append(self._scalars.wrap_log(trainer))
            self._undo.append(self._wrap_training_step(trainer))
        if trainer is not None and "trl" in sys.modules:  # a TRL trainer, or a user's subclass of one
            from nanwatch.hooks.integrations.trl import instrument

            handle = instrument(trainer, self.monitor)
            if handle is not None:
                self._undo.append(handle)

    def on_step_begin(self, args, state, control, **kwargs):
        if self._training:
            # HF increments global_step after the optimizer step and logs the step under the new value
            self.monitor.begin_step(state.global_step + 1)

    def on_step_end(self, args, state, control, **kwargs):
        if self._training:
            self.monitor.end_step()
            self._scalars.ended = state.global_step  # the row HF logs next covers it

    def on_train_end(self, args, state, control, **kwargs):
        self.close()  # a normal end: the Monitor's final report goes (a train() that raised never gets here)

    def close(self, timeout: float = 10.0) -> None:
        """Detach (reporting a step left open) and undo every wrap. Also done at interpreter exit. The
        Monitor stays readable afterwards (``callback.monitor.last_report()``), until the next ``train()``."""
        while self._undo:
            self._undo.pop().remove()
        self._training = False
        if self.monitor is not None:
            self.monitor.close(timeout)

    # ---- wraps on the trainer instance -----------------------------------------------------------------
    def _wrap_training_step(self, trainer: Any) -> _Unwrap:
        """See a step's exception: its report says ``raised``, and it is sent (the callback detaches) before
        the exception leaves ``train()`` (HF skips ``on_train_end`` then). And see its loss: ``training_step``
        returns each micro-batch's loss (detached, after its backward, before the optimizer step), watched as
        the site ``loss`` (its forward pass only: no gradient), so that a loss spike is reported."""
        original = trainer.training_step

        @functools.wraps(original)
        def training_step(*args: Any, **kwargs: Any) -> Any:
            try:
                loss = original(*args, **kwargs)
            except BaseException as exc:
                try:
                    if self._training and self.monitor is not None:
                        self.monitor.mark_raised(exc)
                        self.close()
                except Exception as inner:  # noqa: BLE001 - the trainer's exception is the one to see
                    log.warning("nanwatch: could not report the step that raised: %r", inner)
                raise
            if self._training and self.monitor is not None and isinstance(loss, torch.Tensor):
                self.monitor.watch("loss", loss)  # the micro-batch's loss (detached): a site, for its spikes
            return loss

        trainer.training_step = training_step
        return _Unwrap(trainer, "training_step")

    def _wrap_evaluation(self, trainer: Any) -> None:
        """Wrap ``evaluate`` and ``predict`` on the trainer instance, once, for the trainer's life (a
        standalone evaluation after ``train()`` is reported too); a wrap whose callback left the trainer
        passes straight through."""
        for name in ("evaluate", "predict"):
            current = trainer.__dict__.get(name)
            if getattr(current, "_nanwatch_callback", None) is self:
                continue
            original = getattr(trainer, name)

            def run(*args: Any, _original=original, **kwargs: Any) -> Any:
                if self not in getattr(trainer.callback_handler, "callbacks", ()):
                    return _original(*args, **kwargs)
                with self._evaluation(trainer):
                    return _original(*args, **kwargs)

            functools.update_wrapper(run, original)
            run._nanwatch_callback = self
            setattr(trainer, name, run)

    @contextlib.contextmanager
    def _evaluation(self, trainer: Any) -> Iterator[None]:
        """One eval window around an evaluation: on the training Monitor while training, else on a Monitor
        attached for the evaluation's length (rank reports, local rules: it applies no directive)."""
        self._eval_depth += 1
        try:
            if self._eval_depth > 1:
                yield
                return
            step = int(trainer.state.global_step)
            mon = self.monitor if self._training else self._attach_for_eval(trainer)
            if mon is None:
                yield
                return
            try:
                with mon.evaluating(step):
                    yield
            finally:
                if not self._training:
                    mon.close()
        finally:
            self._eval_depth -= 1

    def _attach_for_eval(self, trainer: Any) -> Monitor | None:
        wrapped = getattr(trainer, "model_wrapped", None)
        target = wrapped if wrapped is not None else getattr(trainer, "model", None)
        if target is None:
            return None
        args = trainer.args
        options = {"rank": args.process_index, "world_size": args.world_size, **self._options}
        # no directive is applied outside training, and a report_scope of job would be a collective at attach
        options.update(report_scope="rank", directive_source="local",
                       on_report=self._scalars.observer(self._options.get("on_report")))
        try:
            config = MonitorConfig.from_options(run_id=self._run_id, collector=self._collector, **options)
            self.monitor = Monitor(target, config).attach()
        except Exception as exc:  # noqa: BLE001 - monitoring never breaks the evaluation
            warnings.warn(f"nanwatch: could not attach for the evaluation ({exc!r}); it is not monitored",
                          RuntimeWarning, stacklevel=3)
            return None
        return self.monitor


class _Unwrap:
    """Undoes a wrap set on the trainer instance (the class's method shows through again)."""

    def __init__(self, trainer: Any, name: str) -> None:
        self._trainer, self._name = trainer, name

    def remove(self) -> None:
        self._trainer.__dict__.pop(self._name, None)
