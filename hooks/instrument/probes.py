"""The probes' side of a Monitor: the small context every hook body and attention wrapper measures into,
and the measuring of one site.

A :class:`Probes` is the one object the hook bodies (``nanwatch.hooks.instrument.module_hooks``) and the
SDPA/softmax wrappers (``nanwatch.hooks.instrument.sdpa_probe``) see. It holds the recorder, the step's
sampling flag, the masks already counted in this forward, the directive state (which attention path runs),
the module names and what the differential rerun needs (:attr:`Probes.rerun`,
``nanwatch.hooks.instrument.rerun_tap``). ``nanwatch.hooks.instrument.install`` builds it (``probes_for``)
and registers the hook bodies; its flags change only through its own methods and context managers
(``enable``, ``generating``, ``begin_step``); no probe reaches into the Monitor.

Sites are named by the innermost instrumented module, tracked with a thread-local stack of
:class:`Frame` s that the attention modules' pre/post hooks maintain.

Three situations change what a probe may do:

* **Activation checkpointing** re-runs a forward inside backward (:func:`recomputing`). That forward was
  measured already, so nothing is counted or measured again; only the logit bound is read there, since
  the saved log-sum-exp exists only then (see ``sdpa_probe``), and a gradient hook is placed for reentrant
  checkpointing, whose first forward ran without grad.
* **torch.compile**: while dynamo traces, probes only count (``nanwatch.hooks.measure.compiled``). When compiled
  code ran in a step, parameter gradients are measured instead (their hooks run outside the graph), and a
  wrapper around the compiled model (``OptimizedModule``, DDP) measures the logits at its boundary.
* **Stages**: a forward belongs to the training step, to an evaluation (eval mode, grad off) or to
  text generation (inside ``generate()``), and its sites say which.
"""

from __future__ import annotations

import contextlib
import threading
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any, Protocol

import torch
from pydantic import TypeAdapter, ValidationError

from nanwatch.hooks.failsafe import contained
from nanwatch.hooks.instrument.rerun_tap import RerunTap
from nanwatch.hooks.measure.recorder import ForwardMeta, Recorder
from nanwatch.wire import SiteKind, SiteName

__all__ = ["DirectiveInForce", "Frame", "Probes", "first_tensor", "local_shard", "pop", "push", "recomputing", "top",
           "watch"]

_SITE_KINDS = frozenset(typing.get_args(SiteKind))
_SITE_NAME = TypeAdapter(SiteName)
_graph_task_id = torch._C._current_graph_task_id
_tls = threading.local()


class DirectiveInForce(Protocol):
    """What the attention wrappers ask of the directive in force: its mode (which attention path runs) and, under
    ``fused``, the call restricted to fused kernels. The Monitor hands in its ``DirectiveState``; the probes
    never import the directive loop that keeps it (it sits above them: it reads the reports they feed)."""

    mode: str

    def fused_call(self, site: str, call: Callable[[], Any], upcast: Callable[[], None]) -> Any: ...


def recomputing() -> bool:
    """True while autograd runs a backward on this thread: a module forward then is activation
    checkpointing re-running it (reentrant or not). Never call it while dynamo traces."""
    return _graph_task_id() != -1


@dataclass(slots=True)
class Frame:
    """One instrumented module's forward in progress."""

    probes: Probes
    site: str
    attention: bool
    sdpa_calls: int = 0


def _stack() -> list[Frame]:
    s = getattr(_tls, "stack", None)
    if s is None:
        s = _tls.stack = []
    return s


def push(frame: Frame) -> None:
    _stack().append(frame)


def pop(frame: Frame | None = None) -> Frame | None:
    s = _stack()
    if not s:
        return None
    if frame is None or s[-1] is frame:
        return s.pop()
    # An exception unwound past an inner module whose post-hook did not run: drop down to ours.
    while s and s[-1] is not frame:
        s.pop()
    return s.pop() if s else None


def top() -> Frame | None:
    s = _stack()
    return s[-1] if s else None


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (what this rank can read without a collective); any other tensor
    as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


class _Disable:
    """The handle :meth:`Probes.enable` returns: ``remove()`` turns that Probes' hooks off."""

    def __init__(self, probes: Probes) -> None:
        self._probes = probes

    def remove(self) -> None:
        self._probes.disable()


def first_tensor(output) -> torch.Tensor | None:
    """The tensor a module's output stands for: itself, the first of a tuple, or ``.logits``."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    logits = getattr(output, "logits", None)
    return logits if isinstance(logits, torch.Tensor) else None



def watch(probes: Probes, name: str, kind: str, x: torch.Tensor, warn: Callable[[str], None]) -> None:
    """``Monitor.watch``: measure ``x`` as site ``name`` if the name and kind are valid; else warn and
    measure nothing (a bad argument must not cost the step's report)."""
    try:
        _SITE_NAME.validate_python(name)
        ok = kind in _SITE_KINDS
    except ValidationError:
        ok = False
    if not ok:
        warn(f"watch({name!r}, kind={kind!r}) ignored: the name must be 1-256 printable characters and "
             f"kind one of {sorted(_SITE_KINDS)}")
        return
    probes.site(name, kind, x)


class Probes:
    """What every probe of one Monitor shares. Hooks registered with its methods do nothing while it is
    not ``active`` (see :meth:`enable`), and nothing inside ``torch.compile`` tracing (they would add graph
    breaks). Its flags are its own: others change them through the methods and context managers below."""

    def __init__(self, *, rec: Recorder, directive_state: DirectiveInForce, fqns: dict[int, str], grads: bool,
                 exact_every: int, exact_chunk_elems: int, model: Callable[[], torch.nn.Module | None],
                 head: str | None) -> None:
        self.rec = rec
        self.directive_state = directive_state
        self.grads = grads
        self.exact_chunk_elems = exact_chunk_elems
        self._exact_every = exact_every  # ``exact_logit_every``: a step whose number it divides is sampled
        #: the module names of the model (``id(module)`` -> FQN), read once at construction
        self.fqns = fqns
        #: what the differential rerun needs: kept forward inputs, and its own pass through the model
        self.rerun = RerunTap()
        self._active = False
        #: this step computes the exact per-head logit max (``exact_logit_every``)
        self.sampled = False
        #: the output head's site name, when the model has one (its logits are expected every step)
        self.head = head
        self._generating = 0  # depth inside ``generate()`` (generate may nest)
        self._model = model
        self._masks_seen: set[tuple[int, int, int]] = set()
        #: modules whose output is a coarse site (``nanwatch.hooks.measure.structure``)
        self.coarse_ids: set[int] = set()
        #: each coarse site's kind, by name
        self.coarse_kinds: dict[str, str] = {}
        self._in_step = False  # a training step is open (between ``begin_step`` and ``end_step``)
        #: told the stage of each model forward that starts outside any training step (``outside_step``)
        self._outside: Callable[[str], None] | None = None

    # ---- flags, owned here --------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        """Attached: hooks measure (between :meth:`enable` and its handle's ``remove()``)."""
        return self._active

    def enable(self) -> _Disable:
        """Turn the hooks on; the returned handle's ``remove()`` turns them off (with the other handles)."""
        self._active = True
        return _Disable(self)

    def disable(self) -> None:
        """Turn the hooks off (every hook returns at once from then on)."""
        self._active = False

    @contextlib.contextmanager
    def generating(self) -> Iterator[None]:
        """Forwards inside belong to the ``generate`` stage (``model.generate()``, which may nest)."""
        self._generating += 1
        try:
            yield
        finally:
            self._generating -= 1

    @property
    def measuring(self) -> bool:
        """Hooks measure: attached and stepping, and not inside the differential rerun (which routes
        attention but measures nothing)."""
        return self._active and not self.rerun.rerunning

    def end_step(self) -> None:
        """The training step closed: forwards from now on are announced (``outside_step``) until the next
        :meth:`begin_step`."""
        self._in_step = False

    def outside_step(self, callback: Callable[[str], None] | None) -> None:
        """Call ``callback(stage)`` when a model forward starts outside any training step (before anything of
        it is measured): the Monitor opens an evaluation's own report for an eval forward there, so an
        evaluation run between steps is never charged to the next one."""
        self._outside = callback

    def forward_starts(self, stage: str) -> None:
        """The root hook: a model forward of ``stage`` starts; outside a training step, it is announced."""
        if not self._in_step and self._outside is not None:
            contained(self._outside, stage)

    def new_window(self) -> None:
        """The recorder switched records (an eval window opened or closed): forward indices start afresh, so
        the masks counted so far no longer identify a forward."""
        self._masks_seen.clear()

    def mark_coarse(self, module: torch.nn.Module, site: str, kind: str) -> None:
        """``module``'s output is the coarse site ``site`` of ``kind``: an SDPA call it makes itself is named
        ``<site>.sdpa``, and the differential rerun's drill-down knows its kind."""
        self.coarse_ids.add(id(module))
        self.coarse_kinds[site] = kind

    def begin_step(self, step: int) -> None:
        """Training step ``step`` opens (sampled: it computes the exact per-head logit max, every
        ``exact_logit_every`` steps)."""
        self._in_step = True
        self.sampled = bool(self._exact_every) and step % self._exact_every == 0
        self._masks_seen.clear()
        self.rerun.clear()

    def stage(self) -> str:
        """The stage of the forward running now: ``generate`` (inside ``generate()``), ``eval`` (the model in
        eval mode and grad off, as every evaluation loop runs it), else ``train``. Eval mode alone is not
        evaluation: RL trainers often train with ``model.eval()`` to turn dropout off, and that training must
        keep its first offender."""
        if self._generating:
            return "generate"
        model = self._model()
        return "train" if model is None or model.training or torch.is_grad_enabled() else "eval"

    # ---- naming ----------------------------------------------------------------------------------------
    def fqn_of(self, module: torch.nn.Module) -> str | None:
        """The module's name in the attached model, or None (not ours, or detached)."""
        return self.fqns.get(id(module)) if self._active else None

    def sdpa_site_of(self, module: torch.nn.Module) -> str | None:
        """The site of an SDPA call made by ``module`` outside any attention module: its name, with
        ``.sdpa`` when the module's own output is a coarse site already (a block that is its own
        attention), so the two measurements do not share a name."""
        name = self.fqn_of(module)
        return name + ".sdpa" if name is not None and id(module) in self.coarse_ids else name

    def mask_is_new(self, fwd: ForwardMeta, mask: torch.Tensor) -> bool:
        """True the first time this mask is seen in this forward: every layer gets the same mask, and its
        fully masked rows are counted once."""
        key = (fwd.index, mask.data_ptr(), mask._version)
        if key in self._masks_seen:
            return False
        self._masks_seen.add(key)
        return True

    # ---- measuring a site ----------------------------------------------------------------------------
    def site(self, site: str, kind: str, x: torch.Tensor | None) -> None:
        """Measure ``x`` (forward) and, through a tensor hook, the gradient flowing back into it."""
        if not isinstance(x, torch.Tensor) or not x.is_floating_point() or not self.measuring:
            return
        stage = self.stage()
        if recomputing():  # measured in the first forward; reentrant checkpointing gets its grad hook here
            if self.grads and x.requires_grad:
                x.register_hook(partial(self._grad_hook, site, kind, stage))
            return
        self.rec.tensor(site, kind, "forward", x, stage)
        if self.grads and x.requires_grad and torch.is_grad_enabled():
            x.register_hook(partial(self._grad_hook, site, kind, stage))

    def _grad_hook(self, site: str, kind: str, stage: str, grad: torch.Tensor) -> None:
        if self._active and grad is not None:
            contained(self.rec.tensor, site, kind, "backward", grad, stage)

    def check_tensors(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Step start: floating parameters or optimizer state, read once (forward order first, so that a
        tensor already non-finite before the step is named before any activation it poisons)."""
        if not self._active:
            return
        for name, t in tensors:  # read at each step: a wrapper may swap a parameter's .data between steps
            contained(self.rec.tensor, name, "param", "forward", local_shard(t).detach(), "train")
        self.rec.cover(params_checked=len(tensors))
