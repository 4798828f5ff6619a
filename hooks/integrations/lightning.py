"""PyTorch Lightning integration: one callback, one line.

Example usage::

    from nanwatch.hooks.integrations.lightning import NanwatchCallback

    trainer = lightning.Trainer(callbacks=[NanwatchCallback(run_id="sft-0412", collector="http://collector:8000")])
    trainer.fit(module, data)

Works with ``lightning.Trainer`` and with ``pytorch_lightning.Trainer`` (the class derives from the
``Callback`` of each one installed); Lightning stays an optional dependency, imported when this module is.

The callback attaches a Monitor when ``fit`` starts (after the strategy set up the model and its
optimizers) and detaches when it ends, sending the run's final report; a fit that raised (``on_exception``)
reports its open step as ``raised`` and sends none.

**Which module.** The Monitor watches the module whose ``forward`` the training step calls: its forward
inputs are what the differential rerun re-runs, and its forwards are the coverage. A ``training_step`` rarely
calls the ``LightningModule``'s own ``forward``; the usual module holds the network in one attribute
(``self.model = ...``) and calls that. So the default is the one child module that holds every parameter of
the ``LightningModule``, else the ``LightningModule`` itself; ``model="encoder"`` (an attribute path) names
another. Site names are relative to it.

**Steps.** A nanwatch step is one optimizer step: it opens at the first batch after the last optimizer step
and closes at the batch end at which Lightning's ``global_step`` moved, so that the micro-batches of
``accumulate_grad_batches`` (or of a manual loop that steps every k batches) are one step. It is numbered by
``trainer.global_step`` when it opens: the step Lightning's loggers write its row under (one optimizer).
Validation (the sanity check included) is one ``stage="eval"`` report per validation run. The loss each
backward starts from (``on_before_backward``) is watched as the site ``loss``, so a loss spike is reported.

**The weight guard.** Lightning's optimizers (``trainer.optimizers``) get the weight guard
(``Monitor.guard``), in automatic and manual optimization: Lightning steps them as
``optimizer.step(closure)`` in both (manual: a closure that runs its hooks only). Under ``precision="16-mixed"``
the precision plugin's ``GradScaler`` is watched: an overflow it handles is ``scaler_overflow``, loss scaling
at work, not an incident (``nanwatch.hooks.remedies.loss_scaling``). ``bf16-mixed`` needs no scaler.
``NanwatchCallback(run_id=..., guard="off")`` opts out.

**Logs.** On each step Lightning writes a log row at (``log_every_n_steps``), the ``nanwatch/*`` scalars
(:mod:`nanwatch.hooks.integrations.log_scalars`) go to every Lightning logger through ``pl_module.log_dict``;
the row waits (bounded) for its own step's report, so it covers exactly the steps up to its own.
"""

from __future__ import annotations

import importlib
import logging
import operator
from typing import Any

from nanwatch.hooks.config import MonitorConfig
from nanwatch.hooks.facade import Monitor
from nanwatch.hooks.failsafe import contained
from nanwatch.hooks.integrations.log_scalars import LOG_WAIT_S, LogScalars

__all__ = ["NanwatchCallback"]

log = logging.getLogger("nanwatch")


def _callback_bases() -> tuple[type, ...]:
    """The ``Callback`` class of each Lightning package installed (``lightning`` installs both)."""
    bases = []
    for name in ("lightning.pytorch", "pytorch_lightning"):
        try:
            bases.append(importlib.import_module(name).Callback)
        except ImportError:
            continue
    if not bases:
        raise ImportError("nanwatch.hooks.integrations.lightning needs lightning (or pytorch_lightning) installed")
    return tuple(bases)


class NanwatchCallback(*_callback_bases()):
    """Attach nanwatch to a Lightning ``Trainer`` for the length of ``fit``.

    ``run_id`` and ``collector`` are as for ``nanwatch.attach``; ``options`` are its flat option names
    (``MonitorConfig.from_options``; ``rank`` and ``world_size`` default to the trainer's global rank and
    world size). ``model``: the
attribute path of the module to watch (default: see the module's docstring). ``log_wait_s``: how
    long a log row waits at most for its step's report (``log_scalars.LOG_WAIT_S``).
    """

    def __init__(self, run_id: str, collector: str | None = None, *, model: str | None = None,
                 log_wait_s: float = LOG_WAIT_S, **options: Any) -> None:
        super().__init__()
        MonitorConfig.from_options(run_id=run_id, collector=collector, **options)  # bad options fail here, not mid-run
        self._run_id, self._collector, self._options, self._model_path = run_id, collector, options, model
        self.monitor: Monitor | None = None
        """The run's Monitor: attached during ``fit``, and still readable after it (``last_report()``)."""
        self._scalars = LogScalars(log_wait_s)
        self._opened_at: int | None = None  # trainer.global_step when the open nanwatch step began
        self._training = False  # between on_fit_start and close(): batch events reach the Monitor

    # ---- lifecycle -------------------------------------------------------------------------------
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self.close()  # a second fit on the same callback starts afresh
        options = {"rank": trainer.global_rank, "world_size": trainer.world_size, **self._options}
        options["on_report"] = self._scalars.observer(self._options.get("on_report"))
        config = MonitorConfig.from_options(run_id=self._run_id, collector=self._collector, **options)
        optimizers = list(trainer.optimizers)
        self.monitor = Monitor(_watched(pl_module, self._model_path), config).attach(optimizer=optimizers[0] if optimizers else None)
        if config.weights.guard != "off":
            for opt in optimizers[1:]:
                self.monitor.guard(opt)
        self._scalars.follow(self.monitor)
        self._training = True
        scaler = getattr(getattr(trainer, "precision_plugin", None), "scaler", None)  # 16-mixed's GradScaler
        if scaler is not None:
            try:
                self.monitor.watch_scaler(scaler)
            except Exception as exc:  # noqa: BLE001 - monitoring never breaks training
                log.warning("nanwatch: could not watch Lightning's GradScaler: %r", exc)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self.close()  # a normal end: the Monitor's final report goes

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self._training:
            contained(self.monitor.mark_raised, exception)
        self.close()

    def close(self, timeout: float = 10.0) -> None:
        """Detach (reporting a step left open). Also done at interpreter exit. The Monitor stays readable
        afterwards (``callback.monitor.last_report()``), until the next ``fit``."""
        self._opened_at, self._training = None, False
        if self.monitor is not None:
            self.monitor.close(timeout)

    # ---- steps -----------------------------------------------------------------------------------
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if self._training and self._opened_at is None:
            self._opened_at = trainer.global_step
            self.monitor.begin_step(trainer.global_step)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self._training:
            return
        if self._opened_at is not None and trainer.global_step != self._opened_at:  # an optimizer stepped
            self.monitor.end_step()
            self._scalars.ended, self._opened_at = self._opened_at, None
        if self._scalars.ended is not None and _writes_row(trainer):
            figures = self._scalars.figures()
            if figures:
                pl_module.log_dict(figures, on_step=True, on_epoch=False, prog_bar=False, logger=True)

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        if self._training:  # the loss is a site (``loss``): its spikes are seen (``nanwatch.hooks.measure.spikes``)
            self.monitor.watch("loss", loss)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        if self._training:
            self.monitor.begin_eval(trainer.global_step)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        if self._training:
            self.monitor.end_eval()


def _watched(pl_module: Any, path: str | None) -> Any:
    """The module the training step runs a forward of (see the module's docstring)."""
    if path is not None:
        return operator.attrgetter(path)(pl_module)
    params = {id(p) for p in pl_module.parameters()}
    holders = [m for m in pl_module.children() if params and {id(p) for p in m.parameters()} == params]
    return holders[0] if len(holders) == 1 else pl_module


def _writes_row(trainer: Any) -> bool:
    """Lightning writes its loggers' row at this batch's end (``log_every_n_steps``, or the trainer is
    stopping). Read through the logger connector, whose rule it is; if that is not there, every batch."""
    try:
        return bool(trainer._logger_connector.should_update_logs)
    except Exception:  # noqa: BLE001 - another Lightning version: log every batch (each row then waits)
        return True
