"""The Monitor, nanwatch's trainer-side facade: it attaches the probes to a model, marks steps, owns every
handle it registered, and is the public API. The hook bodies live in :mod:`nanwatch.hooks.probes` and
:mod:`nanwatch.hooks.sdpa_probe`, the report assembly in :mod:`nanwatch.hooks.report`; nothing outside
this module touches a Monitor's privates."""

from __future__ import annotations

import atexit
import contextlib
import functools
import inspect
import logging
import os
import time
import typing
import uuid
import warnings
import weakref
from collections.abc import Iterator
from functools import partial

import torch
from pydantic import TypeAdapter, ValidationError

from nanwatch.hooks import compiled, patching
from nanwatch.hooks.config import MonitorConfig
from nanwatch.hooks.directive_state import DirectiveState
from nanwatch.hooks.failsafe import WarnOnce, guarded, probe_failed
from nanwatch.hooks.local_policy import LocalPolicy
from nanwatch.hooks.probes import Probes
from nanwatch.hooks.recorder import Recorder
from nanwatch.hooks.replay import replay
from nanwatch.hooks.report import ReportBuilder, StepContext
from nanwatch.hooks.reporter import Pending, Reporter
from nanwatch.hooks.rlhf import record_rlhf
from nanwatch.hooks.structure import coarse_sites
from nanwatch.hooks.weight_guard import WeightGuard
from nanwatch.wire import MAX_INT, SiteKind, SiteName, StepReport

__all__ = ["Monitor", "attach"]

log = logging.getLogger("nanwatch")
_SITE_KINDS = frozenset(typing.get_args(SiteKind))
_SITE_NAME = TypeAdapter(SiteName)
_attached: weakref.WeakKeyDictionary[torch.nn.Module, Monitor] = weakref.WeakKeyDictionary()


def _dist_rank_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def _contains(outer: torch.nn.Module, inner: torch.nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


def user_model(model: torch.nn.Module) -> torch.nn.Module:
    """The user's model inside the wrappers training stacks put around it: DDP and DataParallel
    (``.module``), ``torch.compile`` (``._orig_mod``), and their combinations (Accelerate uses these).
    Site names are then the user's FQNs, and the output head is found."""
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
            model = model._orig_mod
    return model


class _Restore:
    """A handle that puts an instance attribute back (``model.generate`` while wrapped)."""

    def __init__(self, obj: object, name: str) -> None:
        self._obj, self._name = obj, name

    def remove(self) -> None:
        try:
            delattr(self._obj, self._name)
        except AttributeError:
            pass


_open: weakref.WeakSet[Monitor] = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    """A run that dies with an exception still reports the step it died in (bounded wait)."""
    for mon in list(_open):
        try:
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
    """

    def __init__(self, model: torch.nn.Module, config: MonitorConfig) -> None:
        self.config = config
        self._outer = weakref.ref(model)
        model = user_model(model)
        self._model = weakref.ref(model)
        rank, world = _dist_rank_world()
        self.rank = config.rank if config.rank is not None else rank
        self.world_size = config.world_size if config.world_size is not None else world
        self.incarnation = uuid.uuid4().hex[:12]
        try:
            device = next(model.parameters()).device
        except StopIteration:
            device = torch.device("cpu")
        self._rec = Recorder(device)
        self._handles: list = []
        self._active = False
        self._open_step: int | None = None
        self._warn_once = WarnOnce()
        self.directives = DirectiveState(model=self._model, rec=self._rec, rank=self.rank,
                                         check_every=config.directive_check_every)
        self._probes: Probes | None = None
        self._device = device
        self._guards: list[WeightGuard] = []
        self._sweep_at = 0  # the rotating parameter check's place
        self._sweep: list[tuple[str, torch.Tensor]] = []  # what it rotates over, listed once per full cycle
        self._incident_done = False
        wants_local = config.policy == "local" or (config.policy == "auto" and not config.collector)
        self._policy = LocalPolicy(run_id=config.run_id, directives=self.directives,
                                   logit_tau=config.logit_tau) if wants_local else None
        self._sender = None
        self._builder = ReportBuilder(run_id=config.run_id, rank=self.rank, world_size=self.world_size,
                                      incarnation=self.incarnation, rec=self._rec, warn=self._warn_once,
                                      dropped_reports=lambda: self.dropped_reports,
                                      expects_logits=lambda: self._probes is not None and self._probes.head is not None,
                                      agree_every=config.directive_check_every if self.world_size > 1 else None)
        self._reporter = Reporter(self._build_report, on_report=self._deliver,
                                  max_pending=config.max_pending_reports)

    # ---- attach / detach -------------------------------------------------------------------------
    def __enter__(self) -> Monitor:
        if not self._active:
            self.attach()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def attach(self, *, optimizer: torch.optim.Optimizer | None = None) -> Monitor:
        """Register every probe (and guard ``optimizer``'s weights); on any failure, undo what was done and
        re-raise (the model is left as it was)."""
        model = self._model()
        if model is None:
            raise RuntimeError("nanwatch: the model was garbage-collected before attach")
        for other in list(_attached):
            if other is model or _contains(other, model) or _contains(model, other):
                self._reporter.close()
                raise RuntimeError("nanwatch: this model (or a module inside it, or one containing it) "
                                   "already has a Monitor attached; close() it first (two monitors would "
                                   "double-count every site)")
        try:
            self._register(model)
            if self.config.collector:
                from nanwatch.hooks.transport import ReportSender

                self._sender = ReportSender(self.config.collector, token=self.config.token)
                if self.config.policy in ("auto", "collector"):
                    self.directives.start_polling(self.config.collector, self.config.run_id, self.config.token)
            if optimizer is not None:
                self.guard(optimizer)
        except BaseException:
            self._active = True
            self.close(timeout=1.0)
            raise
        return self

    def _register(self, model: torch.nn.Module) -> None:
        cfg = self.config
        # the root's FQN is "": name it by its class so a root that is itself attention gets a site name
        fqns = {id(m): name or type(m).__name__ for name, m in model.named_modules()}
        head = model.get_output_embeddings() if cfg.logits and hasattr(model, "get_output_embeddings") else None
        head_name = fqns.get(id(head)) if isinstance(head, torch.nn.Module) else None
        probes = self._probes = Probes(
            rec=self._rec, directives=self.directives, fqns=fqns, grads=cfg.grads,
            exact_chunk_elems=cfg.exact_logit_chunk_elems,
            forward_signature=inspect.signature(model.forward) if cfg.fingerprint else None,
            model=self._model, head=head_name)
        hook = self._handles.append
        attn = self._attention_modules(model, fqns)
        if not attn:
            warnings.warn("nanwatch: no attention module found by class name (*Attention, *Attn, "
                          "*DeltaNet); SDPA calls are still caught, eager attention is not. Pass "
                          "is_attention= to name your attention modules.", RuntimeWarning, stacklevel=4)
        for name, mod in attn:
            hook(mod.register_forward_pre_hook(partial(probes.attn_pre, name)))
            hook(mod.register_forward_hook(probes.attn_post, always_call=True))
        if head_name is not None:
            hook(head.register_forward_hook(partial(probes.output_hook, head_name, "logits"), always_call=True))
        if cfg.coarse:
            skip = {id(m) for _, m in attn} | ({id(head)} if head_name is not None else set())
            for site, kind, mod in coarse_sites(model, fqns, skip):
                hook(mod.register_forward_hook(partial(probes.output_hook, site, kind), always_call=True))
                probes.coarse_ids.add(id(mod))
        hook(model.register_forward_pre_hook(probes.root_pre, with_kwargs=True))
        hook(model.register_forward_hook(probes.root_post, with_kwargs=True))
        if cfg.fingerprint:
            for mod in model.modules():
                if type(mod).__name__.endswith("RotaryEmbedding"):
                    hook(mod.register_forward_pre_hook(probes.rotary_pre, with_kwargs=True))
        outer = self._outer()
        if outer is not None and outer is not model:  # DDP, torch.compile: the boundary runs in eager
            hook(outer.register_forward_pre_hook(probes.boundary_pre))
            hook(outer.register_forward_hook(probes.boundary_post))
        # Parameter gradients: measured only in steps where compiled code ran (probes.param_grad), since
        # their hooks run outside the graph; otherwise one early return per parameter and micro-batch.
        for name, param in model.named_parameters():
            if param.requires_grad:
                hook(param.register_hook(partial(probes.param_grad, name)))
        if callable(getattr(model, "generate", None)):
            hook(self._wrap_generate(model, probes))
        _attached[model] = self
        self._active = probes.active = True
        _open.add(self)
        patching.install(probes)

    @staticmethod
    def _wrap_generate(model: torch.nn.Module, probes: Probes) -> _Restore:
        """Forwards inside ``model.generate()`` (e.g. GRPO's rollouts) belong to the ``generate`` stage."""
        generate = model.generate

        @functools.wraps(generate)
        def generating(*args, **kwargs):
            probes.generating += 1
            try:
                return generate(*args, **kwargs)
            finally:
                probes.generating -= 1

        model.generate = generating
        return _Restore(model, "generate")

    def _attention_modules(self, model: torch.nn.Module, fqns: dict[int, str]) -> list[tuple[str, torch.nn.Module]]:
        hits = [(fqns[id(m)], m) for n, m in model.named_modules() if self.config.is_attention(n, m)]
        names = [n for n, _ in hits]
        # innermost only: drop a match that contains another match
        return [(n, m) for n, m in hits if not any(o.startswith(n + ".") for o in names)]

    def close(self, timeout: float = 10.0) -> None:
        """Remove every hook, restore the patched functions, flush the last reports (bounded wait)."""
        if not self._active:
            self._reporter.close(timeout)  # never attached (or already closed): just the thread
            return
        if self._open_step is not None:  # e.g. the training loop raised inside a step: report it
            guarded(self.end_step)
        self._active = False
        _open.discard(self)
        if self._probes is not None:
            self._probes.active = False
            patching.uninstall(self._probes)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        model = self._model()
        if model is not None and _attached.get(model) is self:
            _attached.pop(model, None)
        self.directives.close()
        self._reporter.close(timeout)
        if self._sender is not None:
            self._sender.close(timeout_s=timeout)

    def guard(self, optimizer: torch.optim.Optimizer, *, sync: bool = False) -> WeightGuard:
        """Protect the weights: a step in which a monitored site saw a non-finite value does not update
        them. Free (no host sync) for fused optimizers; others need ``sync=True`` (one sync per step) or
        the ``skip_step`` directive (see ``nanwatch.hooks.weight_guard``). Removed when the Monitor closes.

        Example usage::

            opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
            mon = nanwatch.attach(model, run_id="r", optimizer=opt)   # or mon.guard(opt)
        """
        if not self._active:
            raise RuntimeError("nanwatch: guard() needs an attached Monitor")
        g = WeightGuard(optimizer, rec=self._rec, directives=self.directives, sync=sync, warn=self._warn_once)
        self._guards.append(g)
        self._handles.append(g)
        replay_on = self.config.replay if self.config.replay is not None else self._device.type == "cpu"
        self._probes.keep_inputs = bool(replay_on and g.effective)
        return g

    # ---- steps -----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def step(self, n: int) -> Iterator[Monitor]:
        """Mark one training step; stats of everything inside are reported under step ``n``."""
        self.begin_step(n)
        try:
            yield self
        finally:
            guarded(self.end_step)

    def begin_step(self, n: int) -> None:
        """Open step ``n`` (for callbacks; ``with mon.step(n):`` is the same). A step still open is
        reported first."""
        if not isinstance(n, int) or not 0 <= n <= MAX_INT:
            raise ValueError(f"nanwatch: step numbers are integers from 0 to {MAX_INT}, got {n!r}")
        if self._open_step is not None:
            guarded(self.end_step)
        self._open_step = n
        every = self.config.exact_logit_every
        if self._probes is not None:
            self._probes.begin_step(sampled=bool(every) and n % every == 0)
        try:
            self.directives.at_step_boundary(n)
        except Exception as exc:
            probe_failed(exc)
        if self.config.param_check_every and self._probes is not None:
            guarded(self._check_params)

    def _check_params(self) -> None:
        """This step's share of the parameters and optimizer state (all of them every
        ``param_check_every`` steps), before any forward: one aminmax each. The list is built again at the
        start of each full cycle (new optimizer state, a changed model), not every step."""
        if self._sweep_at >= len(self._sweep):
            self._sweep, self._sweep_at = self._sweep_tensors(), 0
        tensors = self._sweep
        if not tensors:
            return
        share = -(-len(tensors) // self.config.param_check_every)
        start, self._sweep_at = self._sweep_at, self._sweep_at + share
        self._probes.check_tensors(tensors[start : start + share])

    def _sweep_tensors(self) -> list[tuple[str, torch.Tensor]]:
        model = self._model()
        if model is None:
            return []
        tensors = [(name, p) for name, p in model.named_parameters()]
        names = {id(p): name for name, p in tensors}
        for g in self._guards:
            for p, state in g.optimizer.state.items():
                tensors += [(f"optimizer.{names.get(id(p), '?')}.{k}", v) for k, v in state.items()
                            if isinstance(v, torch.Tensor) and v.dim() > 0]
        return [(name, t) for name, t in tensors if t.is_floating_point()]

    def end_step(self) -> None:
        """Close the open step and hand it to the reporter (no host sync)."""
        n, self._open_step = self._open_step, None
        if n is None or not self._active:
            return
        counts = compiled.drain()  # compiled code: counted, not probed (nothing inside a graph is measured)
        sdpa_calls = 0
        for key, calls in counts.items():
            if key.startswith("sdpa:"):
                sdpa_calls += calls
                self._rec.sdpa("<compiled>", "compiled", "compiled", False, key.removeprefix("sdpa:"), "", None,
                               calls=calls)
        # an attention module may call SDPA (both counted) or not (eager attention): count each call once
        attention = max(sdpa_calls, counts.get("attention", 0))
        self._rec.cover(compiled_forwards=counts.get("forward", 0), attention=attention, compiled=attention)
        if self._probes.keep_inputs and not self._incident_done:
            guarded(self._classify, n)
        data = self._rec.flat()
        ctx = StepContext(self._rec.swap(), self.directives.mode, self.directives.version, time.time())
        if not self._reporter.capture(data, n, ctx):
            log.warning("nanwatch: reporter is %d steps behind; dropped the report for step %d",
                        self.config.max_pending_reports, n)

    def _classify(self, n: int) -> None:
        """Replay mode: read this step's non-finite flag (the one host read it costs) and, the first time
        it is set, classify the step by a differential replay before anything else moves."""
        if not bool(self._rec.nonfinite_flag()):  # sync-ok: replay mode (free on the CPU; opt-in on GPU)
            return
        self._incident_done = True
        rec = self._rec
        values = rec.flat().tolist()  # sync-ok: once per run, to find the first offender
        _, _, _, prints, first = rec.decode(rec.state, values)
        c = rec.state.coverage
        rec.state.incident = replay(
            model=self._model(), probes=self._probes, directives=self.directives, kept=list(self._probes.kept),
            step=n, site=first[0] if first else None, phase=first[1] if first else None,
            masked_rows=sum(f.fully_masked_rows for f in prints), guarded=any(g.effective for g in self._guards),
            compiled=bool(c.compiled_forwards or c.compiled_calls), rank=self.rank)
        log.warning("nanwatch: step %d: first non-finite step classified %s (%s)", n, rec.state.incident.cls,
                    rec.state.incident.note)

    def last_report(self, timeout: float | None = 10.0) -> StepReport | None:
        """The latest completed StepReport, waiting (up to ``timeout``) for the last step's copy."""
        return self._reporter.last_report(timeout)

    def should_skip_step(self) -> bool:
        """With the opt-in ``skip_step`` directive active: True if this step saw a non-finite value, so
        the trainer can skip ``optimizer.step()``. Costs one host sync then; free otherwise."""
        return self.directives.should_skip_step()

    @property
    def dropped_reports(self) -> int:
        return self._reporter.dropped + (self._sender.dropped if self._sender is not None else 0)

    # ---- public probes ---------------------------------------------------------------------------
    def watch(self, name: str, tensor: torch.Tensor, *, kind: str = "tensor") -> torch.Tensor:
        """Measure any tensor (and its gradient, if it requires grad); returns it unchanged.

        ``name`` becomes the site (1-256 printable characters); ``kind`` is one of attention, logits,
        logprob, tensor. A bad name or kind is a warning and the tensor is not measured: it must not
        cost the whole step's report."""
        if not self._active or torch.compiler.is_compiling():
            return tensor
        try:
            _SITE_NAME.validate_python(name)
            ok = kind in _SITE_KINDS
        except ValidationError:
            ok = False
        if not ok:
            self._warn_once(f"watch({name!r}, kind={kind!r}) ignored: the name must be 1-256 printable "
                            f"characters and kind one of {sorted(_SITE_KINDS)}")
            return tensor
        guarded(self._probes.site, name, kind, tensor)
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
        if kl_optimised not in (None, "k1", "k3", "k3_ratio"):
            self._warn_once(f"rlhf(kl_optimised={kl_optimised!r}) ignored: use 'k1', 'k3' or 'k3_ratio'")
            kl_optimised = None
        if (advantages is not None and mask is not None and advantages.dim() == 1 and mask.dim() == 2
                and advantages.shape[0] == mask.shape[0]):
            advantages = advantages.unsqueeze(1).expand_as(mask)
        guarded(self._probes.site, "rlhf.logprobs", "logprob", logprobs)
        guarded(record_rlhf, self._rec, logprobs=logprobs, ref_logprobs=ref_logprobs,
                old_logprobs=old_logprobs, advantages=advantages, mask=mask, clip_eps=clip_eps,
                kl_optimised=kl_optimised)

    # ---- reporter thread ---------------------------------------------------------------------------
    def _build_report(self, pending: Pending, values: list[float]) -> StepReport:
        report = self._builder.build(pending, values)
        self.directives.note_report(report.first_offender is None)
        if self._policy is not None:
            self._policy.observe(report)
        return report

    def _deliver(self, report: StepReport) -> None:
        if self._sender is not None:
            self._sender.submit(report)
        if self.config.on_report is not None:
            self.config.on_report(report)


def attach(model: torch.nn.Module, *, run_id: str, collector: str | None = None,
           optimizer: torch.optim.Optimizer | None = None, config: MonitorConfig | None = None,
           **options) -> Monitor:
    """Attach nanwatch to ``model`` and return the Monitor (a context manager that detaches on exit).

    ``optimizer``: guard its weights (``Monitor.guard``). ``options`` are MonitorConfig fields
    (``grads=``, ``exact_logit_every=``, ``rank=``, ``policy=``, ...).
    """
    if config is None:
        config = MonitorConfig(run_id=run_id, collector=collector, **options)
    return Monitor(model, config).attach(optimizer=optimizer)
