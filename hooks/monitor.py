"""The Monitor: attaches the probes to a model, marks steps, and owns every handle it registered."""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import re
import time
import typing
import uuid
import warnings
import weakref
from collections.abc import Iterator
from functools import partial

import torch

from nanwatch.hooks import attention
from nanwatch.hooks.config import MonitorConfig
from nanwatch.hooks.directives import DirectiveState
from nanwatch.hooks.fingerprint import position_layout, record_forward_inputs
from nanwatch.hooks.guard import guarded, probe_failed
from nanwatch.hooks.recorder import Recorder
from nanwatch.hooks.reporter import Pending, Reporter
from nanwatch.hooks.rlhf import decode_rlhf, record_rlhf
from nanwatch.wire import SiteKind, StepReport

__all__ = ["Monitor", "attach"]

log = logging.getLogger("nanwatch")
_SITE_KINDS = frozenset(typing.get_args(SiteKind))
_SITE_NAME = re.compile(r"^[^\x00-\x1f\x7f]{1,256}$")
_attached: weakref.WeakKeyDictionary[torch.nn.Module, Monitor] = weakref.WeakKeyDictionary()


def _dist_rank_world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def _contains(outer: torch.nn.Module, inner: torch.nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


def _first_tensor(output) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    logits = getattr(output, "logits", None)
    return logits if isinstance(logits, torch.Tensor) else None


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
        self._model = weakref.ref(model)
        rank, world = _dist_rank_world()
        self.rank = config.rank if config.rank is not None else rank
        self.world_size = config.world_size if config.world_size is not None else world
        self.incarnation = uuid.uuid4().hex[:12]
        try:
            device = next(model.parameters()).device
        except StopIteration:
            device = torch.device("cpu")
        self.rec = Recorder(device)
        self._handles: list = []
        self._fqns: dict[int, str] = {}
        self._active = False
        self._seq = 0
        self._sampled = False
        self._masks_seen: set[tuple[int, int, int]] = set()
        self._warned: set[str] = set()
        self.directives = DirectiveState(self)
        self._sender = None
        self._reporter = Reporter(self._build_report, on_report=self._deliver,
                                  max_pending=config.max_pending_reports)

    # ---- attach / detach -------------------------------------------------------------------------
    def __enter__(self) -> Monitor:
        if not self._active:
            self.attach()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def attach(self) -> Monitor:
        """Register every probe; on any failure, undo what was done and re-raise (the model is left as
        it was)."""
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
                self.directives.start_polling(self.config.collector, self.config.token)
        except BaseException:
            self._active = True
            self.close(timeout=1.0)
            raise
        return self

    def _register(self, model: torch.nn.Module) -> None:
        # the root's FQN is "": name it by its class so a root that is itself attention gets a site name
        self._fqns = {id(m): name or type(m).__name__ for name, m in model.named_modules()}
        attn = self._attention_modules(model)
        if not attn:
            warnings.warn("nanwatch: no attention module found by class name (*Attention, *Attn, "
                          "*DeltaNet); SDPA calls are still caught, eager attention is not. Pass "
                          "is_attention= to name your attention modules.", RuntimeWarning, stacklevel=4)
        for name, mod in attn:
            self._handles.append(mod.register_forward_pre_hook(partial(self._attn_pre, name)))
            self._handles.append(mod.register_forward_hook(self._attn_post, always_call=True))
        if self.config.logits:
            head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
            if isinstance(head, torch.nn.Module) and id(head) in self._fqns:
                self._handles.append(head.register_forward_hook(
                    partial(self._output_hook, self._fqns[id(head)], "logits"), always_call=True))
        if self.config.fingerprint:
            self._sig = inspect.signature(model.forward)
            self._handles.append(model.register_forward_pre_hook(self._root_pre, with_kwargs=True))
            for mod in model.modules():
                if type(mod).__name__.endswith("RotaryEmbedding"):
                    self._handles.append(mod.register_forward_pre_hook(self._rotary_pre, with_kwargs=True))
        _attached[model] = self
        self._active = True
        attention.install(self)

    def _attention_modules(self, model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
        hits = [(self._fqns[id(m)], m) for n, m in model.named_modules() if self.config.is_attention(n, m)]
        names = [n for n, _ in hits]
        # innermost only: drop a match that contains another match
        return [(n, m) for n, m in hits if not any(o.startswith(n + ".") for o in names)]

    def close(self, timeout: float = 10.0) -> None:
        """Remove every hook, restore the patched functions, flush the last reports (bounded wait)."""
        if not self._active:
            self._reporter.close(timeout)  # never attached (or already closed): just the thread
            return
        self._active = False
        for h in self._handles:
            h.remove()
        self._handles.clear()
        attention.uninstall(self)
        model = self._model()
        if model is not None and _attached.get(model) is self:
            _attached.pop(model, None)
        self.directives.close()
        self._reporter.close(timeout)
        if self._sender is not None:
            self._sender.close(timeout_s=timeout)

    def _fqn_of(self, module: torch.nn.Module) -> str | None:
        return self._fqns.get(id(module)) if self._active else None

    # ---- steps -----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def step(self, n: int) -> Iterator[Monitor]:
        """Mark one training step; stats of everything inside are reported under step ``n``."""
        self._begin(n)
        try:
            yield self
        finally:
            guarded(self._end, n)

    def _begin(self, n: int) -> None:
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"nanwatch: step numbers are integers >= 0, got {n!r}")
        every = self.config.exact_logit_every
        self._sampled = bool(every) and n % every == 0
        self._masks_seen.clear()
        try:
            self.directives.at_step_boundary(n)
        except Exception as exc:
            probe_failed(exc)

    def _end(self, n: int) -> None:
        if not self._active:
            return
        for dtype, calls in attention.drain_compiled_calls().items():
            # compiled attention: counted, not probed (no site, backend or finiteness inside the graph)
            self.rec.sdpa("<compiled>", "compiled", "compiled", False, dtype, "", None, calls=calls)
        state = self.rec.swap()
        buf = self.rec.buf
        host = self._reporter.host_buffer(buf.data.numel(), buf.device)
        if host is None:
            log.warning("nanwatch: reporter is %d steps behind; dropped the report for step %d",
                        self.config.max_pending_reports, n)
        else:
            buf.snapshot_into(host)
            event = None
            if buf.device.type == "cuda":
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(buf.device))
            ctx = (state, self.directives.mode, self.directives.version, time.time())
            self._reporter.submit(Pending(self._seq, n, host, buf.size, event, ctx))
            self._seq += 1
        buf.reset()

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
        if kind not in _SITE_KINDS or not _SITE_NAME.match(name or ""):
            self._warn_once(f"watch({name!r}, kind={kind!r}) ignored: the name must be 1-256 printable "
                            f"characters and kind one of {sorted(_SITE_KINDS)}")
            return tensor
        guarded(self._site, name, kind, tensor)
        return tensor

    def rlhf(self, *, logprobs: torch.Tensor, ref_logprobs: torch.Tensor | None = None,
             old_logprobs: torch.Tensor | None = None, advantages: torch.Tensor | None = None,
             mask: torch.Tensor | None = None, clip_eps: float = 0.2) -> None:
        """Ratio, KL (k1, k3), clip-fraction, advantage and logprob health, on the device."""
        if not self._active or torch.compiler.is_compiling():
            return
        guarded(self._site, "rlhf.logprobs", "logprob", logprobs)
        guarded(record_rlhf, self.rec, logprobs=logprobs, ref_logprobs=ref_logprobs,
                      old_logprobs=old_logprobs, advantages=advantages, mask=mask, clip_eps=clip_eps)

    # ---- hook bodies -----------------------------------------------------------------------------
    def _site(self, site: str, kind: str, x: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            return
        self.rec.tensor(site, kind, "forward", x)
        if self.config.grads and x.requires_grad and torch.is_grad_enabled():
            x.register_hook(partial(self._grad_hook, site, kind))

    def _grad_hook(self, site: str, kind: str, grad: torch.Tensor) -> None:
        if self._active and grad is not None:
            guarded(self.rec.tensor, site, kind, "backward", grad)

    def _attn_pre(self, name: str, module, args) -> None:
        if self._active and not torch.compiler.is_compiling():
            attention.push(attention.Frame(self, name, attention=True))

    def _attn_post(self, module, args, output) -> None:
        if torch.compiler.is_compiling():
            return
        fr = attention.pop()
        if fr is None or fr.monitor is not self or not self._active or fr.sdpa_calls:
            return  # SDPA already measured this module's attention output
        guarded(self._site, fr.site, "attention", _first_tensor(output))

    def _output_hook(self, name: str, kind: str, module, args, output) -> None:
        if self._active and not torch.compiler.is_compiling():
            guarded(self._site, name, kind, _first_tensor(output))

    def _root_pre(self, module, args, kwargs) -> None:
        if self._active and not torch.compiler.is_compiling():
            guarded(record_forward_inputs, self.rec, self._sig, args, kwargs)

    def _rotary_pre(self, module, args, kwargs) -> None:
        """HF rotary embeddings see the position ids actually used, also when the model built them."""
        fwd = self.rec.current_forward()
        if not self._active or torch.compiler.is_compiling() or fwd is None or fwd.position_ids != "none":
            return
        pos = args[1] if len(args) > 1 else kwargs.get("position_ids")
        if isinstance(pos, torch.Tensor):
            guarded(position_layout, self.rec, fwd, pos)

    # ---- reporting (reporter thread) ---------------------------------------------------------------
    def _build_report(self, pending: Pending, values: list[float]) -> StepReport:
        state, mode, version, t = pending.context
        sites, sdpa, logits, prints, first = self.rec.decode(state, values)
        warns = list(state.warnings)
        for f in prints:
            if f.cross_doc_leak:
                warns.append(f"forward {f.forward}: packed sequences (position_ids restart) ran with plain "
                             "causal attention: documents attend across boundaries (HF builds a cache when "
                             "use_cache is left True in training; pass use_cache=False)")
        if state.forwards and not state.sdpa and not any(s.kind == "attention" for s in sites):
            if self._compiled():
                warns.append("no attention was measured in this step: it ran inside torch.compile'd code, "
                             "where nanwatch's eager probes are off (see README, 'torch.compile')")
            else:
                warns.append("no attention ran in this step: check is_attention= and that the model calls "
                             "torch.nn.functional.scaled_dot_product_attention at call time")
        for w in warns:
            self._warn_once(w)
        self.directives.note_report(first is None)

        return StepReport(
            run_id=self.config.run_id, rank=self.rank, world_size=self.world_size,
            incarnation=self.incarnation, seq=pending.seq, step=pending.step, time=t,
            sites=sites, sdpa=sdpa, logits=logits, fingerprints=prints,
            rlhf=decode_rlhf(self.rec.getter(values)) if state.rlhf else None,
            attention_mode=mode, directive_version=version,
            first_offender=first[0] if first else None, first_offender_phase=first[1] if first else None,
            dropped_reports=self.dropped_reports, warnings=warns[:64])

    def _compiled(self) -> bool:
        """Whether compiled code may have run the attention: a submodule compiled in place
        (``module.compile()``), or any graph compiled by dynamo in this process (``torch.compile(model)``
        wraps the model, so the module itself carries no mark)."""
        model = self._model()
        if model is not None and any(getattr(m, "_compiled_call_impl", None) is not None
                                     for m in model.modules()):
            return True
        from torch._dynamo.utils import counters

        return counters["stats"]["unique_graphs"] > 0

    def _warn_once(self, message: str) -> None:
        head = message.split(":", 1)[-1]
        if head not in self._warned:
            self._warned.add(head)
            log.warning("nanwatch: %s", message)
            warnings.warn(f"nanwatch: {message}", RuntimeWarning, stacklevel=2)

    def _deliver(self, report: StepReport) -> None:
        if self._sender is not None:
            self._sender.submit(report)
        if self.config.on_report is not None:
            self.config.on_report(report)


def attach(model: torch.nn.Module, *, run_id: str, collector: str | None = None,
           config: MonitorConfig | None = None, **options) -> Monitor:
    """Attach nanwatch to ``model`` and return the Monitor (a context manager that detaches on exit).

    ``options`` are MonitorConfig fields (``grads=``, ``exact_logit_every=``, ``rank=``, ...).
    """
    if config is None:
        config = MonitorConfig(run_id=run_id, collector=collector, **options)
    return Monitor(model, config).attach()
