"""The Monitor, nanwatch's trainer-side facade: the public API plus the wiring of its collaborators.

The walk from ``attach`` down: ``install`` (hooks and handles) -> ``probes`` (hook bodies) -> ``recorder``
(one step's measurements) -> ``report`` (a StepReport, on the reporter thread) -> ``reporter`` (the async
copy) -> ``transport`` (to the collector). Directives come back through ``directive_state``.

Which thread owns which field of the trainer side is written down once, in
``nanwatch.hooks.directives.directive_state`` (where the training and reporter threads meet).
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import sys
import time
import uuid
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch

from nanwatch.hooks.config import MonitorConfig, resolve_config
from nanwatch.hooks.directives.agreement import rank_and_world
from nanwatch.hooks.directives.directive_state import DirectiveState
from nanwatch.hooks.failsafe import WarnOnce, contained, probe_failed
from nanwatch.hooks.instrument.eval_windows import EvalWindows
from nanwatch.hooks.instrument.install import install, probes_for, user_model
from nanwatch.hooks.instrument.probes import Probes, watch
from nanwatch.hooks.measure import compiled
from nanwatch.hooks.measure.param_sweep import ParamSweep
from nanwatch.hooks.measure.recorder import Recorder, StepState
from nanwatch.hooks.measure.rlhf import checked_kl, record_rlhf
from nanwatch.hooks.remedies.capsule import CapsuleWriter, capsule_settings
from nanwatch.hooks.remedies.loss_scaling import LossScaling
from nanwatch.hooks.remedies.optimizer_discovery import steps_model
from nanwatch.hooks.remedies.optimizer_hooks import OptimizerHooks
from nanwatch.hooks.remedies.rerun import classify
from nanwatch.hooks.remedies.weight_guard import WeightGuard
from nanwatch.hooks.report.build import StepContext
from nanwatch.hooks.report.flow import ReportFlow
from nanwatch.wire import MAX_INT, StepReport

__all__ = ["Monitor", "attach"]

log = logging.getLogger("nanwatch")
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
        self.config = config
        self._outer = weakref.ref(model)
        model = user_model(model)
        self._model = weakref.ref(model)
        self.rank, self.world_size = rank_and_world(rank=config.rank, world_size=config.world_size)
        self.incarnation = uuid.uuid4().hex[:12]
        try:
            self._device = next(model.parameters()).device
        except StopIteration:
            self._device = torch.device("cpu")
        self._rec = Recorder(self._device, group=config.process_group, reduce=config.guard_reduce)
        self._handles: list = []
        self._active = False
        self._open_step: int | None = None
        self._last_step: int | None = None  # the last training step opened: what an evaluation follows
        self._raised: str | None = None  # the exception type the open step raised
        self._ended_by: str | None = None  # an exception that ended the run (no final report then)
        self._reported_step: int | None = None  # the step of the last report handed over (the final's step)
        self._scaling: LossScaling | None = None  # the GradScalers watched (``nanwatch.hooks.remedies.loss_scaling``)
        self._warn_once = WarnOnce()
        self.directive_state = DirectiveState(model=self._model, rec=self._rec, rank=self.rank,
                                              check_every=config.directive_check_every)
        self._probes: Probes | None = None
        self._evals = EvalWindows(self._rec, hand_over=self._hand_over, new_window=lambda: self._probes.new_window())
        self._guards = OptimizerHooks(self._model, config=config, rec=self._rec, directive_state=self.directive_state,
                              warn=self._warn_once, device=self._device,
                              keep_forward_inputs=lambda on: self._probes.rerun.keep_forward_inputs(on))
        self._sweep = ParamSweep(self._model, optimizers=self._guards.optimizers, every=config.param_check_every)
        self._incident_done = False
        try:  # the options were checked by MonitorConfig; a bad NANWATCH_CAPSULE_* variable turns capsules off
            on, count, folder, limit = capsule_settings(config.capsule, config.capsule_max, config.capsule_dir,
                                                        config.capsule_max_bytes)
        except ValueError as exc:
            log.warning("nanwatch: incident capsules off: %s", exc)
            on, count, folder, limit = False, 0, "", 0
        self._capsules = CapsuleWriter(run_id=config.run_id, rank=self.rank, directory=folder, max_count=count,
                                       max_bytes=limit) if on else None
        self._flow = ReportFlow(config, rank=self.rank, world_size=self.world_size, incarnation=self.incarnation,
                                rec=self._rec, warn=self._warn_once, directive_state=self.directive_state,
                                expects_logits=lambda: self._probes is not None and self._probes.head is not None)

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
        cfg = self.config
        try:
            self._probes = probes_for(model, config=cfg, rec=self._rec, directive_state=self.directive_state,
                                      model_ref=self._model)
            self._handles = install(model, self._probes, outer=self._outer(), owner=self, config=cfg)
            self._probes.outside_step(self._forward_outside_step)
            self._active = True
            _open.add(self)
            self._flow.open_job()  # job scope: a collective (every rank attaches), on this thread
            if cfg.collector:
                from nanwatch.hooks.report.transport import DirectivePoller, ReportSender

                self._flow.send_to(ReportSender(cfg.collector, token=cfg.token))
                if cfg.directive_source in ("auto", "collector") and self.rank == 0:  # the others: by agreement
                    self.directive_state.follow(DirectivePoller(cfg.collector, cfg.run_id, token=cfg.token))
            self._scaling = LossScaling(self._rec, steps_model=lambda opt: steps_model(self._model(), opt),
                                        warn=self._warn_once)
            self._handles.append(self._scaling)
            if scaler is not None:
                self._scaling.watch(scaler)
            self._handles.append(self._guards)  # after the scalers: removed before them
            if cfg.guard == "auto" or cfg.optimizer_check:
                self._guards.discover(model, on_found=self._found_optimizer)
            if optimizer is not None:
                self._guards.check(optimizer)
                if cfg.guard == "auto":
                    self.guard(optimizer)
        except BaseException as exc:
            self._active = True
            self._ended_by = type(exc).__name__  # an attach that failed is no normal end: no final report
            self.close(timeout=1.0)
            raise
        return self

    def watch_scaler(self, scaler: Any) -> None:
        """Watch a ``torch.amp.GradScaler``: a step in which it found inf/NaN gradients (and no forward value
        was non-finite) is reported as ``scaler_overflow=True``, not as an incident, and every training report
        carries its ``loss_scale`` (``nanwatch.hooks.remedies.loss_scaling``). A scaler that steps an optimizer of this
        model is also found by itself, at its first ``scaler.step``; this call is for being explicit.

        Example usage::

            scaler = torch.amp.GradScaler("cuda")
            mon = nanwatch.attach(model, run_id="r", optimizer=opt, scaler=scaler)  # or mon.watch_scaler(scaler)
        """
        if not self._active or self._scaling is None:
            raise RuntimeError("nanwatch: watch_scaler() needs an attached Monitor")
        self._scaling.watch(scaler)

    def close(self, timeout: float = 10.0) -> None:
        """Remove every hook, restore the patched functions, flush the last reports (bounded wait). A normal
        close (no step, evaluation or ``with`` block raised, not the interpreter going down on an exception)
        sends the incarnation's final report (``final=True``) after the last step's: the run ended, it did
        not crash or hang."""
        if not self._active:
            self._flow.close(timeout)  # never attached (or already closed): just the thread
            return
        if self._evals.open:  # e.g. the final evaluation, run after the last step
            contained(self.end_eval)
        if self._open_step is not None:  # e.g. the training loop raised inside a step: report it
            contained(self.end_step)
        self._active = False
        _open.discard(self)
        while self._handles:  # last installed, first removed
            self._handles.pop().remove()
        # the final report says the mode and version the run ended in: read them before the state closes
        final = StepContext(StepState(), self.directive_state.mode, self.directive_state.version, time.time(),
                            final=True)
        self.directive_state.close()
        if self._ended_by is None:
            contained(self._flow.final, self._reported_step or 0, final)
        self._flow.close(timeout)
        if self._capsules is not None:  # a capsule still being written is finished (bounded)
            self._capsules.join(timeout)

    def guard(self, optimizer: torch.optim.Optimizer, *, sync: bool | None = None) -> WeightGuard:
        """Protect the weights: a step in which a monitored site saw a non-finite value does not update
        them. Free (no host sync) for fused optimizers; others at one host read of the step's flag per
        optimizer step (see ``nanwatch.hooks.remedies.weight_guard``). ``sync``: deprecated, no longer needed
        (None and True guard alike); ``sync=False`` opts a non-fused optimizer out of the host read, and
        then only the ``skip_step`` directive protects it. Guards even under ``guard="off"`` (an explicit
        call); an optimizer already guarded is not guarded twice. Removed when the Monitor closes.

        Example usage::

            opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
            mon = nanwatch.attach(model, run_id="r", optimizer=opt)   # or mon.guard(opt)
        """
        if not self._active:
            raise RuntimeError("nanwatch: guard() needs an attached Monitor")
        return self._guards.guard(optimizer, sync=sync)

    def _found_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Discovery found ``optimizer`` stepping the model (``OptimizerHooks.found``), while attached."""
        if self._active:
            self._guards.found(optimizer)

    # ---- steps -----------------------------------------------------------------------------------
    def step(self, n: int) -> contextlib.AbstractContextManager[Monitor]:
        """Mark one training step; stats of everything inside are reported under step ``n``."""
        self.begin_step(n)
        return self._window(self.end_step)

    @contextlib.contextmanager
    def _window(self, end) -> Iterator[Monitor]:
        """The body of ``step()`` and ``evaluating()``: an exception is the window's ``raised``; ``end``
        reports it whatever happened."""
        try:
            yield self
        except BaseException as exc:
            if not isinstance(exc, GeneratorExit):
                self.mark_raised(type(exc))
            raise
        finally:
            contained(end)

    def begin_step(self, n: int) -> None:
        """Open step ``n`` (for callbacks; ``with mon.step(n):`` is the same). A step still open is
        reported first."""
        if not isinstance(n, int) or not 0 <= n <= MAX_INT:
            raise ValueError(f"nanwatch: step numbers are integers from 0 to {MAX_INT}, got {n!r}")
        if self._evals.open:  # an evaluation between steps ends when training resumes
            contained(self.end_eval)
        if self._open_step is not None:
            contained(self.end_step)
        self._open_step = self._last_step = n
        self._raised = None
        self._ended_by = None  # training went on after an exception it caught (e.g. an OOM retry)
        every = self.config.exact_logit_every
        if self._probes is not None:
            self._probes.in_step(True)
            self._probes.begin_step(sampled=bool(every) and n % every == 0)
        try:
            self.directive_state.at_step_boundary(n)
        except Exception as exc:
            probe_failed(exc)
        self._guards.at_step_start()
        if self.config.param_check_every and self._probes is not None:
            contained(self._check_params)

    def _check_params(self) -> None:
        """This step's share of the parameters and optimizer state (``nanwatch.hooks.measure.param_sweep``)."""
        self._probes.check_tensors(self._sweep.share())

    def end_step(self) -> None:
        """Close the open step and hand it to the reporter (no host sync)."""
        if self._evals.open:  # an evaluation inside the step: reported on its own, first
            contained(self.end_eval)
        n, self._open_step = self._open_step, None
        raised, self._raised = self._raised, None
        if self._probes is not None:
            self._probes.in_step(False)
        if n is None or not self._active:
            return
        self._rec.fold_compiled(compiled.drain())  # compiled code: counted, not probed
        self._guards.at_step_end()
        if self._scaling is not None:
            contained(self._scaling.at_step_end)
        if self._probes.rerun.keep_inputs and not self._incident_done and raised is None:
            contained(self._classify, n)
        self._hand_over(n, raised)
        if self._scaling is not None:
            self._scaling.new_step()

    def _hand_over(self, n: int, raised: str | None = None) -> None:
        """The recorder's current record (a training step's, or an evaluation's) to the reporter."""
        self._reported_step = n
        data = self._rec.flat()
        ctx = StepContext(self._rec.swap(), self.directive_state.mode, self.directive_state.version, time.time(),
                          raised=raised)
        if not self._flow.capture(data, n, ctx):
            log.warning("nanwatch: reporter is %d steps behind; dropped the report for step %d",
                        self.config.max_pending_reports, n)

    def mark_raised(self, exc: BaseException | type[BaseException]) -> None:
        """The open eval window, else the open step, raised ``exc`` (an exception or its type): its report
        says so (``raised``), makes no coverage claim about what the exception cut short, and the collector
        marks the rank crashed. For integrations that see the exception (``with mon.step(n):``,
        ``evaluating()`` and ``__exit__`` call it themselves)."""
        kind = (exc if isinstance(exc, type) else type(exc)).__name__[:128]
        self._ended_by = self._ended_by or kind  # the run did not end normally: no final report at close
        if not self._evals.mark_raised(kind) and self._open_step is not None:
            self._raised = self._raised or kind

    # ---- evaluations -----------------------------------------------------------------------------
    def evaluating(self, step: int | None = None) -> contextlib.AbstractContextManager[Monitor]:
        """An evaluation: everything inside is one ``stage="eval"`` report of its own, keyed by ``step``
        (default: the last training step opened, or 0). Inside an open training step too: the step's own
        record is put aside meanwhile, so the evaluation never reaches its figures or its first offender."""
        self.begin_eval(step)
        return self._window(self.end_eval)

    def begin_eval(self, step: int | None = None) -> None:
        """Open an eval window (for callbacks; ``with mon.evaluating():`` is the same). A window still open is
        reported first."""
        if step is not None and (not isinstance(step, int) or not 0 <= step <= MAX_INT):
            raise ValueError(f"nanwatch: step numbers are integers from 0 to {MAX_INT}, got {step!r}")
        if self._evals.open:
            contained(self.end_eval)
        if self._active:
            self._evals.begin(step, open_step=self._open_step, last_step=self._last_step)

    def end_eval(self) -> None:
        """Close the eval window and hand its report to the reporter (no host sync)."""
        self._evals.end(active=self._active, in_step=self._open_step is not None)

    def _forward_outside_step(self, stage: str) -> None:
        """Probes: a model forward of ``stage`` starts outside any training step (an implicit eval window,
        ``nanwatch.hooks.instrument.eval_windows``)."""
        if self._active:  # a window is only ever open while active
            self._evals.outside_step(stage, open_step=self._open_step, last_step=self._last_step)

    def _classify(self, n: int) -> None:
        """Replay mode: read this step's non-finite flag (the one host read it costs) and, the first time
        it is set, classify the step by a differential replay before anything else moves."""
        if not bool(self._rec.nonfinite_flag()):  # sync-ok: replay mode (free on the CPU; opt-in on GPU)
            return
        if self._scaling is not None and self._scaling.handled_overflow():  # sync-ok: replay mode, flag set
            return
        self._incident_done = True
        classify(rec=self._rec, model=self._model(), probes=self._probes, directive_state=self.directive_state,
                 step=n, guarded=self._guards.effective, rank=self.rank, capsules=self._capsules)

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
        """Measure any tensor (and its gradient, if it requires grad); returns it unchanged.

        ``name`` becomes the site (1-256 printable characters); ``kind`` is one of attention, logits,
        logprob, tensor. A bad name or kind is a warning and the tensor is not measured: it must not
        cost the whole step's report."""
        if self._active and not torch.compiler.is_compiling():
            contained(watch, self._probes, name, kind, tensor, self._warn_once)
        return tensor

    def rlhf(self, *, logprobs: torch.Tensor, ref_logprobs: torch.Tensor | None = None,
             old_logprobs: torch.Tensor | None = None, advantages: torch.Tensor | None = None,
             mask: torch.Tensor | None = None, clip_eps: float = 0.2, kl_optimised: str | None = None) -> None:
        """Ratio, KL (k1, k3), clip-fraction, advantage and logprob health, on the device.

        ``advantages`` may be per token (the mask's shape) or per sequence (``[B]``, as GRPO's are);
        ``kl_optimised`` says which KL the loss uses (``k1``, ``k3`` or ``k3_ratio``), so that the report
        labels it."""
        if not self._active or torch.compiler.is_compiling():
            return
        kl_optimised = checked_kl(kl_optimised, self._warn_once)
        contained(self._probes.site, "rlhf.logprobs", "logprob", logprobs)
        contained(record_rlhf, self._rec, logprobs=logprobs, ref_logprobs=ref_logprobs,
                old_logprobs=old_logprobs, advantages=advantages, mask=mask, clip_eps=clip_eps,
                kl_optimised=kl_optimised)


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
