"""The Monitor, nanwatch's trainer-side facade: the public API, and the wiring of its parts (``instrument``
-> ``measure`` -> ``report``; ``remedies``; ``directives``, whose ``directive_state`` says which thread owns
which field). Each part is built after the parts it needs and handed them as values; what the Monitor builds
it owns through one ``contextlib.ExitStack``, closed in reverse order.

This is the composition root: a part that sits in another room than the module using it is built here (the
report flow's builder and job-level reporting, the remedies' rerun, spike check and replica check) and handed
in, so that a room's module imports what it makes, not the siblings it is handed (#38).
"""

from __future__ import annotations

import atexit
import contextlib
import operator
import sys
import uuid
import weakref
from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import torch

from nanwatch.hooks.config import MonitorConfig, resolve_config
from nanwatch.hooks.directives.agreement import rank_and_world
from nanwatch.hooks.directives.directive_state import DirectiveState
from nanwatch.hooks.failsafe import WarnOnce, contained, probe_failed
from nanwatch.hooks.forensics.rerun import DifferentialRerun
from nanwatch.hooks.instrument.eval_windows import EvalWindows, check_step, window
from nanwatch.hooks.instrument.install import device_of, install, probes_for, user_model
from nanwatch.hooks.instrument.probes import watch as watch_site
from nanwatch.hooks.measure import compiled
from nanwatch.hooks.measure.recorder import Recorder
from nanwatch.hooks.measure.rlhf import rlhf_probe
from nanwatch.hooks.measure.spikes import spike_observer, spike_skip
from nanwatch.hooks.moe.taps import MoeTaps
from nanwatch.hooks.remedies.replica_check import ReplicaCheck
from nanwatch.hooks.remedies.step_remedies import StepRemedies
from nanwatch.hooks.remedies.weight_guard import WeightGuard
from nanwatch.hooks.report.build import ReportBuilder
from nanwatch.hooks.report.flow import ReportFlow
from nanwatch.hooks.report.handover import CloseTimeout, StepHandover, connect
from nanwatch.hooks.report.job import open_job_reporting
from nanwatch.hooks.rollout.weight_publish import publish_weights
from nanwatch.wire import StepReport

__all__ = ["Monitor", "attach"]

_open: weakref.WeakSet[Monitor] = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    """A run that dies with an exception still reports the step it died in (bounded wait), saying which
    exception: the interpreter sets ``sys.last_type`` for the one that ended it, before atexit runs."""
    raised = getattr(sys, "last_type", None)
    for mon in list(_open):
        with contextlib.suppress(Exception):  # the interpreter is going down; say nothing more
            if raised is not None:
                mon.mark_raised(raised)
            mon.close()


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

    Evaluations (``with mon.evaluating():``) are reported on their own (``stage="eval"``), or when an eval
    mode forward starts outside any training step (until the next training forward, step, or ``close``). A
    step that raised says so (``raised``), and the collector marks its rank crashed.
    """

    def __init__(self, model: torch.nn.Module, config: MonitorConfig) -> None:
        self.config = config = resolve_config(config)  # the environment and the shard (no-op after attach)
        self._outer = weakref.ref(model)
        self._model = weakref.ref(model := user_model(model))
        self.rank, self.world_size = rank_and_world(rank=config.rank, world_size=config.world_size)
        self.incarnation = uuid.uuid4().hex[:12]
        self._active = False
        self._raised: str | None = None  # the exception type the open step raised
        self._warn_once = warn = WarnOnce()
        device = device_of(model)
        weights = config.weights
        self._rec = rec = Recorder(device, group=weights.process_group, reduce=weights.guard_reduce)
        self.directive_state = state = DirectiveState(model=self._model, rec=rec, rank=self.rank,
                                                      check_every=config.directives.check_every)
        self._probes = probes = probes_for(model, config=config.measure, rec=rec, directive_state=state,
                                           model_ref=self._model)
        self._remedies = StepRemedies(
            weights, rollout=config.rollout, device=device, rec=rec, model=self._model, probes=probes, warn=warn,
            rerun=partial(DifferentialRerun, config.forensics, run_id=config.run_id, rank=self.rank, device=device,
                          rec=rec, model=self._model, probes=probes, directive_state=state),
            spiked=spike_skip(config.spikes, rec),  # spike_action="skip": shared by every weight guard
            replicas=partial(ReplicaCheck, model=self._model, rec=rec, config=weights,
                             timeout_s=config.reports.reduce_timeout_s, warn=warn))  # a peer's wait: the report's
        reports = config.reports
        builder = ReportBuilder(run_id=config.run_id, rank=self.rank, world_size=self.world_size,
                                incarnation=self.incarnation, warn=warn,
                                expects_logits=partial(operator.is_not, probes.head, None),  # known by now
                                agree_every=config.directives.check_every if self.world_size > 1 else None,
                                spikes=spike_observer(config.spikes))
        self._flow = ReportFlow(reports, directives=config.directives, local_log=config.log, run_id=config.run_id,
                                collector=config.collector, token=config.token, rank=self.rank,
                                incarnation=self.incarnation, warn=warn, directive_state=state, builder=builder,
                                open_job=partial(open_job_reporting, scope=reports.scope, rank=self.rank,
                                                 world_size=self.world_size, heartbeat_s=reports.heartbeat_s,
                                                 timeout_s=reports.reduce_timeout_s),
                                job_spikes=spike_observer(config.spikes),  # the job report's own baselines
                                on_mismatch=self._remedies.on_mismatch)
        self._handover = StepHandover(self._flow, rec=rec, directive_state=state,
                                      max_pending=config.reports.max_pending)
        self._moe = MoeTaps(model, probes, routing_replay=config.rollout.routing_replay, warn=warn)
        self._evals = EvalWindows(rec, hand_over=self._handover.hand_over, new_window=probes.new_window, warn=warn)
        # closed in reverse order: (pushed at attach) the remedies' hooks, every probe and patch, the final
        # report; then the reporter and its sender, then the capsules still being written
        self._stack, self._timeout = contextlib.ExitStack(), CloseTimeout()
        self._stack.callback(self._timeout.call, self._remedies.join)
        self._stack.callback(self._timeout.call, self._flow.close)

    # ---- attach / detach -------------------------------------------------------------------------
    def __enter__(self) -> Monitor:
        return self if self._active else self.attach()

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.mark_raised(exc_type)
        self.close()

    def attach(self, *, optimizer: torch.optim.Optimizer | None = None, scaler: Any = None) -> Monitor:
        """Register every probe; cover ``optimizer`` (weight guard unless ``guard="off"``, post-step check)
        and any other optimizer found stepping the model's parameters; watch ``scaler`` (:meth:`watch_scaler`)
        and any GradScaler found stepping such an optimizer. On any failure, undo it all and re-raise."""
        model = self._model()
        if model is None:
            raise RuntimeError("nanwatch: the model was garbage-collected before attach")
        try:
            self._stack.callback(self._handover.finish)  # the final report: once every hook below is off
            cfg = self.config
            for handle in [*install(model, self._probes, outer=self._outer(), owner=self, config=cfg.measure),
                           *self._moe.install()]:
                self._stack.callback(handle.remove)
            self._probes.outside_step(self._evals.outside_step)
            self._active = True
            _open.add(self)
            self._flow.open_job()  # job scope: a collective (every rank attaches), on this thread
            connect(cfg.directives, run_id=cfg.run_id, collector=cfg.collector, token=cfg.token,
                    log_dir=cfg.log.dir, rank=self.rank, flow=self._flow, directive_state=self.directive_state)
            self._stack.callback(self._remedies.remove)
            self._remedies.attach(model, optimizer=optimizer, scaler=scaler)
        except BaseException as exc:
            self._active = True
            self._handover.ended_by = type(exc).__name__  # a failed attach is no normal end: no final report
            self.close(timeout=1.0)
            raise
        return self

    def watch_scaler(self, scaler: Any) -> None:
        """Watch a ``torch.amp.GradScaler``: a step in which it found inf/NaN gradients (and no forward value
        was non-finite) is ``scaler_overflow=True``, no incident; reports carry its ``loss_scale``. A scaler
        stepping this model's optimizer is also found by itself (its first ``scaler.step``)."""
        if not self._active:
            raise RuntimeError("nanwatch: watch_scaler() needs an attached Monitor")
        self._remedies.watch_scaler(scaler)

    def close(self, timeout: float | None = None) -> None:
        """Remove every hook, restore the patched functions, flush the last reports (at most ``timeout``, default
        ``config.reports.close_timeout``). A normal close (nothing raised) sends the final report
        (``final=True``)."""
        if self._active:
            if self._evals.open:  # e.g. the final evaluation, run after the last step
                contained(self.end_eval)
            if self._evals.open_step is not None:  # e.g. the training loop raised inside a step: report it
                contained(self.end_step)
            self._active = False
            _open.discard(self)
        self._timeout.seconds = self.config.reports.close_timeout if timeout is None else timeout
        self._stack.close()

    def guard(self, optimizer: torch.optim.Optimizer) -> WeightGuard:
        """A weight guard: a step in which a site saw a non-finite value does not update the weights. Free for
        fused optimizers, else one host read of the step's flag per optimizer step. Applies even under
        ``guard="off"``, never twice on one optimizer; removed at close. ``attach(model, optimizer=opt)``
        calls it."""
        if not self._active:
            raise RuntimeError("nanwatch: guard() needs an attached Monitor")
        return self._remedies.guard(optimizer)

    # ---- steps -----------------------------------------------------------------------------------
    def step(self, n: int) -> contextlib.AbstractContextManager[Monitor]:
        """Mark one training step; stats of everything inside are reported under step ``n``."""
        self.begin_step(n)
        return window(self, end=self.end_step, mark_raised=self.mark_raised)

    def begin_step(self, n: int) -> None:
        """Open step ``n`` (for callbacks: ``with mon.step(n):``); a step still open is reported first."""
        check_step(n)
        if self._evals.open:  # an evaluation between steps ends when training resumes
            contained(self.end_eval)
        if self._evals.open_step is not None:
            contained(self.end_step)
        self._evals.training(n)
        self._raised = None
        self._handover.ended_by = None  # training went on after an exception it caught (e.g. an OOM retry)
        self._probes.begin_step(n)
        try:
            self.directive_state.at_step_boundary(n)
        except Exception as exc:
            probe_failed(exc)
        self._remedies.at_step_start(n)  # an earlier step's rerun, the carried weights, the sweep's share

    def end_step(self) -> None:
        """Close the open step and hand it to the reporter (no host sync; on the CPU, where it is free, the rerun
        reads the step's flag)."""
        if self._evals.open:  # an evaluation inside the step: reported on its own, first
            contained(self.end_eval)
        n, raised, self._raised = self._evals.open_step, self._raised, None
        self._evals.training(None)
        self._probes.end_step()
        if n is None or not self._active:
            return
        self._rec.fold_compiled(compiled.drain())  # compiled code: counted, not probed
        contained(self._moe.step_end)  # the rollout routes compared (device ops), then forgotten
        self._remedies.at_step_end(n, raised=raised)
        data, state = self._handover.hand_over(n, raised)
        self._remedies.new_step(data, state)  # a rerun decided a step later (an accelerator) decodes them

    def mark_raised(self, exc: BaseException | type[BaseException]) -> None:
        """The open eval window, else the open step, raised ``exc`` (or its type): its report says so, claims
        no coverage, and the collector marks the rank crashed. For integrations that see the exception."""
        kind = (exc if isinstance(exc, type) else type(exc)).__name__[:128]
        self._handover.ended_by = self._handover.ended_by or kind  # not a normal end: no final report
        if not self._evals.mark_raised(kind) and self._evals.open_step is not None:
            self._raised = self._raised or kind

    # ---- evaluations -----------------------------------------------------------------------------
    def evaluating(self, step: int | None = None) -> contextlib.AbstractContextManager[Monitor]:
        """An evaluation: everything inside is one ``stage="eval"`` report, keyed by ``step`` (default: the
        last training step opened, or 0); inside a step too, never in the step's figures or first offender."""
        self.begin_eval(step)
        return window(self, end=self.end_eval, mark_raised=self.mark_raised)

    def begin_eval(self, step: int | None = None) -> None:
        """Open an eval window (for callbacks: ``with mon.evaluating():``); one open is reported first."""
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

    def watch(self, name: str, tensor: torch.Tensor, *, kind: str = "tensor") -> torch.Tensor:
        """Measure any tensor (and its gradient); returns it unchanged. ``name``: the site (1-256 printable
        characters); ``kind``: attention, logits, logprob or tensor. A bad one is only warned about."""
        if self._active and not torch.compiler.is_compiling():
            contained(watch_site, self._probes, name, kind, tensor, self._warn_once)
        return tensor

    def publish_weights(self, version: int, weights: torch.nn.Module | Mapping[str, Any] | None = None, *,
                        gather: bool = False, dtypes: Sequence[str | torch.dtype] | None = None) -> dict[str, str] | None:
        """Post the weight fingerprints (``nanwatch.fingerprint``) of weight ``version`` as the trainer's, for
        the collector to compare with each rollout worker's; ``weights``: a module or state dict (default:
        the monitored model). One host read; a failure only warns. Under FSDP2 pass ``gather=True`` on
        every rank (a collective); else rank 0 posts. ``dtypes``: the rollout copies' dtypes the set also carries
        casts to (default ``MonitorConfig.rollout.dtype``), so a bf16 (fp16, fp8) copy verifies. Returns the
        fingerprints (None if none were made)."""
        cfg = self.config
        return publish_weights(cfg.rollout, self._model() if weights is None else weights, version,
                               run_id=cfg.run_id, collector=cfg.collector, token=cfg.token, rank=self.rank,
                               warn=self._warn_once, incarnation=self.incarnation, gather=gather, dtypes=dtypes,
                               note=self._flow.published)

    def routes(self, routes: Any) -> None:
        """The rollout's MoE routes for the open step: ``R``, an integer tensor ``[batch, seq, n_routers, top_k]``
        of the experts the rollout chose, routers in model order, ``-1`` for none; ``R[:, t]`` is the routing at
        the forward position that produces ``logprobs[:, t]`` (``nanwatch.hooks.moe.routes`` says how vLLM's
        ``routed_experts`` map onto it). They apply to every later forward of the step over inputs of the same
        ``[batch, seq]`` (``routing_replay="apply"``: call before the first forward) and are compared with the
        last training forward's at the step's end. Bad routes are one warning, never an exception."""
        if self._active and not torch.compiler.is_compiling():
            contained(self._moe.give, routes, source="routes()")

    def rlhf(self, *, logprobs: torch.Tensor, ref_logprobs: torch.Tensor | None = None,
             old_logprobs: torch.Tensor | None = None, advantages: torch.Tensor | None = None,
             mask: torch.Tensor | None = None, clip_eps: float = 0.2, kl_optimised: str | None = None,
             rollout_logprobs: torch.Tensor | None = None, rollout_cap: float | None = None,
             input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
             rollout_routes: Any = None) -> None:
        """Ratio, KL (k1, k3), clip-fraction, advantage and logprob health, on the device. ``advantages``: per
        token, or per sequence as GRPO's; ``kl_optimised``: the KL the loss uses (``k1``, ``k3``, ``k3_ratio``).
        ``rollout_logprobs``: the sampler's, of the same tokens, compared with ``logprobs`` (truncation cap
        ``rollout_cap``, default ``config.rollout.cap``); ``input_ids`` (prompt then completion) and
        ``attention_mask`` let a drift be attributed to a module. ``rollout_routes``: the rollout's MoE routes ``R``
        (:meth:`routes`), compared at the step's end with the trainer's over the unmasked tokens."""
        if self._active and not torch.compiler.is_compiling() and rollout_routes is not None:
            contained(self._moe.give, rollout_routes, mask=mask, logprobs=logprobs, rollout_logprobs=rollout_logprobs,
                      source="rlhf(rollout_routes=)")
        if self._active and not torch.compiler.is_compiling():
            contained(self._remedies.keep_rollout, rlhf_probe(
                self._rec, site=self._probes.site, warn=self._warn_once, logprobs=logprobs, mask=mask,
                ref_logprobs=ref_logprobs, old_logprobs=old_logprobs, advantages=advantages, clip_eps=clip_eps,
                kl_optimised=kl_optimised, rollout_logprobs=rollout_logprobs,
                rollout_cap=rollout_cap or self.config.rollout.cap, input_ids=input_ids,
                attention_mask=attention_mask))


def attach(model: torch.nn.Module, *, run_id: str | None = None, collector: str | None = None,
           optimizer: torch.optim.Optimizer | None = None, scaler: Any = None, config: MonitorConfig | None = None,
           **options) -> Monitor:
    """Attach nanwatch to ``model`` and return the Monitor (a context manager that detaches on exit).

    ``optimizer``: guard its weights (``Monitor.guard``) and check its updates; without it, the optimizer
    stepping the model's parameters is found at its first step (``guard=``, ``optimizer_check=``).
    ``scaler``: a GradScaler to watch (``Monitor.watch_scaler``). ``options`` are flat option names
    (``spike_factor=5``: ``MonitorConfig.from_options``; an unknown one is a TypeError); with ``config=``,
    ``run_id``/``collector``/``options`` may only repeat what it says (else a ValueError).
    """
    config = resolve_config(config, run_id=run_id, collector=collector, **options)
    return Monitor(model, config).attach(optimizer=optimizer, scaler=scaler)
