"""The probes' side of a Monitor: the bodies of the module and gradient hooks, and the small context the
attention wrappers measure into.

A :class:`Probes` is the one object hook bodies and the SDPA/softmax wrappers see. It holds the
recorder, the step's sampling flag, the masks already counted in this forward, the directive state (which
attention path runs) and the module names. The Monitor creates it, registers its methods as hooks, and
turns it on and off; no probe reaches into the Monitor.

Sites are named by the innermost instrumented module, tracked with a thread-local stack of
:class:`Frame` s that the attention modules' pre/post hooks maintain.
"""

from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass
from functools import partial

import torch

from nanwatch.hooks.directive_state import DirectiveState
from nanwatch.hooks.failsafe import guarded
from nanwatch.hooks.fingerprint import position_layout, record_forward_inputs
from nanwatch.hooks.recorder import ForwardMeta, Recorder

__all__ = ["Frame", "Probes", "first_tensor", "pop", "push", "top"]

_is_compiling = torch.compiler.is_compiling
_tls = threading.local()


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


def first_tensor(output) -> torch.Tensor | None:
    """The tensor a module's output stands for: itself, the first of a tuple, or ``.logits``."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    logits = getattr(output, "logits", None)
    return logits if isinstance(logits, torch.Tensor) else None


class Probes:
    """What every probe of one Monitor shares. Hooks registered with its methods do nothing while
    ``active`` is False, and nothing inside ``torch.compile`` tracing (they would add graph breaks)."""

    def __init__(self, *, rec: Recorder, directives: DirectiveState, fqns: dict[int, str], grads: bool,
                 exact_chunk_elems: int, forward_signature: inspect.Signature | None) -> None:
        self.rec = rec
        self.directives = directives
        self.grads = grads
        self.exact_chunk_elems = exact_chunk_elems
        self.active = False
        #: this step computes the exact per-head logit max (``exact_logit_every``)
        self.sampled = False
        self._fqns = fqns
        self._signature = forward_signature
        self._masks_seen: set[tuple[int, int, int]] = set()

    def begin_step(self, *, sampled: bool) -> None:
        self.sampled = sampled
        self._masks_seen.clear()

    def fqn_of(self, module: torch.nn.Module) -> str | None:
        """The module's name in the attached model, or None (not ours, or detached)."""
        return self._fqns.get(id(module)) if self.active else None

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
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            return
        self.rec.tensor(site, kind, "forward", x)
        if self.grads and x.requires_grad and torch.is_grad_enabled():
            x.register_hook(partial(self._grad_hook, site, kind))

    def _grad_hook(self, site: str, kind: str, grad: torch.Tensor) -> None:
        if self.active and grad is not None:
            guarded(self.rec.tensor, site, kind, "backward", grad)

    # ---- module hooks (registered by the Monitor) ----------------------------------------------------
    def attn_pre(self, name: str, module, args) -> None:
        if self.active and not _is_compiling():
            push(Frame(self, name, attention=True))

    def attn_post(self, module, args, output) -> None:
        if _is_compiling():
            return
        fr = pop()
        if fr is None or fr.probes is not self or not self.active or fr.sdpa_calls:
            return  # SDPA already measured this module's attention output
        guarded(self.site, fr.site, "attention", first_tensor(output))

    def output_hook(self, name: str, kind: str, module, args, output) -> None:
        if self.active and not _is_compiling():
            guarded(self.site, name, kind, first_tensor(output))

    def root_pre(self, module, args, kwargs) -> None:
        if self.active and not _is_compiling() and self._signature is not None:
            guarded(record_forward_inputs, self.rec, self._signature, args, kwargs)

    def rotary_pre(self, module, args, kwargs) -> None:
        """HF rotary embeddings see the position ids actually used, also when the model built them."""
        fwd = self.rec.current_forward()
        if not self.active or _is_compiling() or fwd is None or fwd.position_ids != "none":
            return
        pos = args[1] if len(args) > 1 else kwargs.get("position_ids")
        if isinstance(pos, torch.Tensor):
            guarded(position_layout, self.rec, fwd, pos)
