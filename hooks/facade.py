"""The Monitor, nanwatch's trainer-side facade: the public API, and the wiring of its parts.

From ``attach`` down: ``instrument`` (probes, hooks) -> ``measure`` (the recorder, on the device) ->
``report`` (hand-over, StepReport on the reporter thread, the collector); ``remedies`` keep a bad step out of
the weights and explain it; directives come back through ``directive_state``, which also says which thread
owns which field. Each part is built after the parts it needs and handed them as values; what the Monitor
builds it owns through one ``contextlib.ExitStack``, closed in reverse order.
"""

from __future__ import annotations

import atexit
import contextlib
import operator
import sys
import uuid
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from nanwatch.hooks.config import MonitorConfig, resolve_config
from nanwatch.hooks.directives.agreement import rank_and_world
from nanwatch.hooks.directives.directive_state import DirectiveState
from nanwatch.hooks.failsafe import WarnOnce, contained, probe_failed
from nanwatch.hooks.instrument.eval_windows import EvalWindows, check_step, window
from nanwatch.hooks.instrument.install import device_of, install, probes_for, user_model
from nanwatch.hooks.instrument.probes import watch as watch_site
from nanwatch.hooks.measure import compiled
from nanwatch.hooks.measure.recorder import Recorder
from nanwatch.hooks.measure.rlhf import checked_kl, record_rlhf
from nanwatch.hooks.remedies.step_remedies import StepRemedies
from nanwatch.hooks.remedies.weight_guard import WeightGuard
from nanwatch.hooks.report.flow import ReportFlow
from nanwatch.hooks.report.handover import StepHandover, connect
from nanwatch.wire import StepReport

__all__ = ["Monitor", "attach"]

_open: weakref.WeakSet[Monitor] = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    """A run that dies with an exception still reports the step it died in (bounded wait), saying which
    exception: the interpreter sets ``sys.last_type`` for the one that ended it, before atexit runs."""
    raised = getattr(sys, "last_type", None)
    for mon in list(_open):
        try:
            if raised is not None:
                mon.mark_raised(raised)
            mon.close(timeout=5.0)
        except Exception:  # noqa: BLE001 - the interpreter is going down; say nothing more
            pass


@dataclass(slots=True)
class _Timeout:
    """The timeout ``close()`` was given, for the parts the ExitStack closes with it."""

    seconds: float = 10.0

    def call(self, close: Callable[[float], None]) -> None:
        close(self.seconds)


class Monitor:
    """Numerical-health probes on one model. Registers hooks on ``__enter__`` (or ``attach``), removes
    every one of them on ``__exit__``/``close``, leaving the model exactly as it was.

    Example usage::

        model = Qwen3ForCausalLM(config)
        with nanwatch.attach(model, run_id="grpo-0412", collector="http://127.0.0.1:9464") as mon:
            for n, batch in enumerate(loader):
                with mon.step(n):
                    out = model(**batch)
                    mon.rlhf(logprobs=lp, old_logprobs=old_lp, ref_logprobs=ref_lp, mask=mask)
                    loss.backward()
                    opt.step()
                report = mon.last_report()   # optional: waits for that step's async copy
                print(report.step, report.first_offender)
                if n % 100 == 0:
                    with mon.evaluating():   # one stage="eval" report, keyed by step n
                        evaluate(model)

    Evaluations are reported on their own (``stage="eval"``, ``step`` = the training step they follow): in
    an ``evaluating()`` window, and also without one, when a forward in eval mode starts outside any
    training step (that implicit window closes at the next training forward, step, or ``close``). A step
    that raised says so (``raised``), and its rank is marked crashed by the collector.
    """

    def __init__(self, model: torch.nn.Module, config: MonitorConfig) -> None:
        self.config, self._outer = config, weakref.ref(model)
        model = user_model(model)
        self._model = weakref.ref(model)
        self.rank, self.world_size = rank_and_world(rank=config.rank, world_size=config.world_size)
        self.incarnation = uuid.uuid4().hex[:12]
        self._active = False
        self._raised: str | None = None  # the exception type the open step raised
        self._warn_once = warn = WarnOnce()
        device = device_of(model)
        self._rec = rec = Recorder(device, group=config.process_group, reduce=config.guard_reduce)
        self.directive_state = state = DirectiveState(model=self._model, rec=rec, rank=self.rank,
                                                      check_every=config.directive_check_every)
        self._probes = probes = probes_for(model, config=config, rec=rec, directive_state=state,
                                           model_ref=self._model)
        self._remedies = StepRemedies(config, rank=self.rank, device=device, rec=rec, model=self._model,
                                      probes=probes, directive_state=state, warn=warn)
        self._flow = ReportFlow(config, rank=self.rank, world_size=self.world_size, incarnation=self.incarnation,
                                rec=rec, warn=warn, directive_state=state,
                                expects_logits=partial(operator.is_not, probes.head, None))  # known by now
        self._handover = StepHandover(self._flow, rec=rec, directive_state=state,
                                      max_pending=config.max_pending_reports)
        self._evals = EvalWindows(rec, hand_over=self._handover.hand_over, new_window=probes.new_window)
        # closed in reverse order: (pushed at attach) the remedies' hooks, every probe and patch, the final
        # report; then the reporter and its sender, then the capsules still being written
        self._stack, self._timeout = contextlib.ExitStack(), _Timeout()
        self._stack.callback(self._timeout.call, self._remedies.join)
        self._stack.callback(self._timeout.call, self._flow.close)

    @property
    def directives(self) -> DirectiveState:
        """Deprecated name of :attr:`directive_state`."""
        warnings.warn("Monitor.directives is deprecated: use Monitor.directive_state", DeprecationWarning,
                      stacklevel=2)
        return self.directive_state

    # ---- attach / detach -------------------------------------------------------------------------
    def __enter__(self) -> Monitor:
        if not self._active:
            self.attach()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.mark_raised(exc_type)
        self.close()

    def attach(self, *, optimizer: torch.optim.Optimizer | None = None, scaler: Any = None) -> Monitor:
        """Register every probe, and cover ``optimizer`` (its weight guard, unless ``guard="off"``, and its
        post-step check) and any other optimizer found stepping the model's parameters
        (``nanwatch.hooks.remedies.optimizer_discovery``); watch ``scaler`` (a ``torch.amp.GradScaler``, see
        :meth:`watch_scaler`) and any GradScaler found stepping such an optimizer; on any failure, undo what
        was done and re-raise (the model is left as it was)."""
        model = self._model()
        if model is None:
            raise RuntimeError("nanwatch: the model was garbage-collected before attach")
        try:
            self._stack.callback(self._handover.finish)  # the final report: once every hook below is off
            for handle in install(model, self._probes, outer=self._outer(), owner=self, config=self.config):
                self._stack.callback(handle.remove)
            self._probes.outside_step(self._evals.outside_step)
            self._active = True
            _open.add(self)
            self._flow.open_job()  # job scope: a collective (every rank attaches), on this thread
            connect(self.config, rank=self.rank, flow=self._flow, directive_state=self.directive_state)
            self._stack.callback(self._remedies.remove)
            self._remedies.attach(model, optimizer=optimizer, scaler=scaler)
        except BaseException as exc:
            self._active = True
            self._handover.ended_by = type(exc).__name__  # an attach that failed is no normal end: no final
            self.close(timeout=1.0)
            raise
        return self

    def watch_scaler(self, scaler: Any) -> None:
        """Watch a ``torch.amp.GradScaler``: a step in which it found inf/NaN gradients (and no forward value
        was non-finite) is reported as ``scaler_overflow=True``, not as an incident, and every training
        report carries its ``loss_scale`` (``nanwatch.hooks.remedies.loss_scaling``). A scaler that steps an
        optimizer of this model is also found by itself, at its first ``scaler.step``; this is for being
        explicit: ``mon.watch_scaler(scaler)``, or ``nanwatch.attach(model, ..., scaler=scaler)``."""
        if not self._active:
            raise RuntimeError("nanwatch: watch_scaler() needs an attached Monitor")
        self._remedies.watch_scaler(scaler)

    def close(self, timeout: float = 10.0) -> None:
        """Remove every hook, restore the patched functions, flush the last reports (bounded wait). A normal
        close (no step, evaluation or ``with`` block raised, not the interpreter going down on an exception)
        sends the incarnation's final report (``final=True``) after the last step's: the run ended, it did
        not crash or hang."""
        if self._active:
            if self._evals.open:  # e.g. the final evaluation, run after the last step
                contained(self.end_eval)
            if self._evals.open_step is not None:  # e.g. the training loop raised inside a step: report it
                contained(self.end_step)
            self._active = False
            _open.discard(self)
        self._timeout.seconds = timeout
        self._stack.close()

    def guard(self, optimizer: torch.optim.Optimizer, *, sync: bool | None = None) -> WeightGuard:
        """Protect the weights: a step in which a monitored site saw a non-finite value does not update
        them. Free (no host sync) for fused optimizers; others at one host read of the step's flag per
        optimizer step (``nanwatch.hooks.remedies.weight_guard``). ``sync``: deprecated (None and True guard
        alike); ``sync=False`` opts a non-fused optimizer out of the host read, and then only the
        ``skip_step`` directive protects it. Guards even under ``guard="off"``; an optimizer already guarded
        is not guarded twice. Removed when the Monitor closes. ``attach(model, optimizer=opt)`` calls it."""
        if not self._active:
            raise RuntimeError("nanwatch: guard() needs an attached Monitor")
        return self._remedies.guard(optimizer, sync=sync)

    # ---- steps -----------------------------------------------------------------------------------
    def step(self, n: int) -> contextlib.AbstractContextManager[Monitor]:
        """Mark one training step; stats of everything inside are reported under step ``n``."""
        self.begin_step(n)
        return window(self, end=self.end_step, mark_raised=self.mark_raised)

    def begin_step(self, n: int) -> None:
        """Open step ``n`` (for callbacks; ``with mon.step(n):`` is the same). A step still open is
        reported first."""
        check_step(n)
        if self._evals.open:  # an evaluation between steps ends when training resumes
            contained(self.end_eval)
        if self._evals.open_step is not None:
            contained(self.end_step)
        self._evals.training(n)
        self._raised = None
        self._handover.ended_by = None  # training went on after an exception it caught (e.g. an OOM retry)
        every = self.config.exact_logit_every
        self._probes.begin_step(sampled=bool(every) and n % every == 0)
        try:
            self.directive_state.at_step_boundary(n)
        except Exception as exc:
            probe_failed(exc)
        self._remedies.at_step_start()  # then this step's share of the parameters and optimizer state

    def end_step(self) -> None:
        """Close the open step and hand it to the reporter (no host sync, but in rerun mode: one read of the
        step's non-finite flag, ``nanwatch.hooks.remedies.rerun``)."""
        if self._evals.open:  # an evaluation inside the step: reported on its own, first
            contained(self.end_eval)
        n, raised, self._raised = self._evals.open_step, self._raised, None
        self._evals.training(None)
        self._probes.end_step()
        if n is None or not self._active:
            return
        self._rec.fold_compiled(compiled.drain())  # compiled code: counted, not probed
        self._remedies.at_step_end(n, raised=raised)
        self._handover.hand_over(n, raised)
        self._remedies.new_step()

    def mark_raised(self, exc: BaseException | type[BaseException]) -> None:
        """The open eval window, else the open step, raised ``exc`` (an exception or its type): its report
        says so (``raised``), makes no coverage claim about what the exception cut short, and the collector
        marks the rank crashed. For integrations that see the exception (``with mon.step(n):``,
        ``evaluating()`` and ``__exit__`` call it themselves)."""
        kind = (exc if isinstance(exc, type) else type(exc)).__name__[:128]
        self._handover.ended_by = self._handover.ended_by or kind  # not a normal end: no final report
        if not self._evals.mark_raised(kind) and self._evals.open_step is not None:
            self._raised = self._raised or kind

    # ---- evaluations -----------------------------------------------------------------------------
    def evaluating(self, step: int | None = None) -> contextlib.AbstractContextManager[Monitor]:
        """An evaluation: everything inside is one ``stage="eval"`` report of its own, keyed by ``step``
        (default: the last training step opened, or 0). Inside an open training step too: the step's own
        record is put aside meanwhile, so the evaluation never reaches its figures or its first offender."""
        self.begin_eval(step)
        return window(self, end=self.end_eval, mark_raised=self.mark_raised)

    def begin_eval(self, step: int | None = None) -> None:
        """Open an eval window (for callbacks; ``with mon.evaluating():`` is the same). A window still open is
        reported first."""
        if step is not None:
            check_step(step)
        if self._evals.open:
            contained(self.end_eval)
        if self._active:
            self._evals.begin(step)

    def end_eval(self) -> None:
        """Close the eval window and hand its report to the reporter (no host sync)."""
        self._evals.end(active=self._active)

    def last_report(self, timeout: float | None = 10.0) -> StepReport | None:
        """The latest completed StepReport, waiting (up to ``timeout``) for the last step's copy."""
        return self._flow.last_report(timeout)

    def should_skip_step(self) -> bool:
        """With the opt-in ``skip_step`` directive active: True if this step saw a non-finite value, so
        the trainer can skip ``optimizer.step()``. Costs one host sync then; free otherwise."""
        return self.directive_state.should_skip_step()

    @property
    def dropped_reports(self) -> int:
        """Reports that never reached the collector: behind the reporter, or queued and dropped to send."""
        return self._flow.dropped

    # ---- public probes ---------------------------------------------------------------------------
    def watch(self, name: str, tensor: torch.Tensor, *, kind: str = "tensor") -> torch.Tensor:
        """Measure any tensor (and its gradient, if it requires grad); returns it unchanged. ``name``
        becomes the site (1-256 printable characters); ``kind`` is one of attention, logits, logprob,
        tensor. A bad name or kind is a warning and the tensor is not measured: it must not cost the whole
        step's report."""
        if self._active and not torch.compiler.is_compiling():
            contained(watch_site, self._probes, name, kind, tensor, self._warn_once)
        return tensor

    def rlhf(self, *, logprobs: torch.Tensor, ref_logprobs: torch.Tensor | None = None,
             old_logprobs: torch.Tensor | None = None, advantages: torch.Tensor | None = None,
             mask: torch.Tensor | None = None, clip_eps: float = 0.2, kl_optimised: str | None = None) -> None:
        """Ratio, KL (k1, k3), clip-fraction, advantage and logprob health, on the device. ``advantages`` may
        be per token (the mask's shape) or per sequence (``[B]``, as GRPO's are); ``kl_optimised`` says
        which KL the loss uses (``k1``, ``k3`` or ``k3_ratio``), so that the report labels it."""
        if not self._active or torch.compiler.is_compiling():
            return
        kl_optimised = checked_kl(kl_optimised, self._warn_once)
        contained(self._probes.site, "rlhf.logprobs", "logprob", logprobs)
        contained(record_rlhf, self._rec, logprobs=logprobs, ref_logprobs=ref_logprobs, old_logprobs=old_logprobs,
                  advantages=advantages, mask=mask, clip_eps=clip_eps, kl_optimised=kl_optimised)


def attach(model: torch.nn.Module, *, run_id: str | None = None, collector: str | None = None,
           optimizer: torch.optim.Optimizer | None = None, scaler: Any = None, config: MonitorConfig | None = None,
           **options) -> Monitor:
    """Attach nanwatch to ``model`` and return the Monitor (a context manager that detaches on exit).

    ``optimizer``: guard its weights (``Monitor.guard``) and check its updates; without it, the optimizer
    that steps the model's parameters is found at its first step (``guard=`` and ``optimizer_check=``
    say what is done with it). ``scaler``: a ``torch.amp.GradScaler`` to watch (``Monitor.watch_scaler``;
    one stepping the model's optimizer is also found by itself). ``options`` are MonitorConfig fields
    (``grads=``, ``exact_logit_every=``, ``rank=``, ``directive_source=``, ...). With ``config=``,
    ``run_id``/``collector``/``options`` may only repeat what it says (a differing value is a ValueError).
    """
    config = resolve_config(config, run_id=run_id, collector=collector, **options)
    return Monitor(model, config).attach(optimizer=optimizer, scaler=scaler)
