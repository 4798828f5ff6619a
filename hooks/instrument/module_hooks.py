"""The bodies of the hooks ``nanwatch.hooks.instrument.install`` registers on a model's modules and
parameters: attention modules (pre/post), output sites (the logits head, the coarse sites), the root
module (forward count, fingerprint, kept inputs, the fused head), HF rotary embeddings (position ids), a
wrapper's boundary (DDP, ``torch.compile``) and each parameter's gradient.

Each body reads the shared :class:`~nanwatch.hooks.instrument.probes.Probes` (is it measuring, which stage,
which site) and measures through it; the only state of its own is whether the logits head ran in the
current forward. Under dynamo tracing a body only counts (``nanwatch.hooks.measure.compiled``): no graph
break.

Example usage::

    hooks = ModuleHooks(probes, forward_signature=inspect.signature(model.forward))
    model.register_forward_pre_hook(hooks.root_pre, with_kwargs=True)
"""

from __future__ import annotations

import inspect

import torch

from nanwatch.hooks.failsafe import contained
from nanwatch.hooks.instrument.probes import Frame, Probes, first_tensor, local_shard, pop, push, recomputing
from nanwatch.hooks.measure import compiled
from nanwatch.hooks.measure.inputs import position_layout, record_forward_inputs

__all__ = ["ModuleHooks"]

_is_compiling = torch.compiler.is_compiling


class ModuleHooks:
    """The hook bodies of one Monitor's probes (registered by ``install``; removed with their handles)."""

    def __init__(self, probes: Probes, *, forward_signature: inspect.Signature | None) -> None:
        self._probes = probes
        self._signature = forward_signature
        self._head_seen = False  # the logits head's own hook ran in the current forward
        #: read every parameter's gradient every step, not only after compiled code: a model with no attention,
        #: logits or block site has nothing else that sees a value born in backward (``install``'s fallback)
        self.every_param_grad = False

    # ---- attention modules -----------------------------------------------------------------------
    def attn_pre(self, name: str, module, args) -> None:
        if _is_compiling():
            compiled.count("attention")  # dynamo re-applies this after each run of the graph: no graph break
        elif self._probes.active:
            push(Frame(self._probes, name, attention=True))

    def attn_post(self, module, args, output) -> None:
        if _is_compiling():
            return
        p = self._probes
        fr = pop()
        if fr is None or fr.probes is not p or not p.measuring or fr.sdpa_calls:
            return  # SDPA already measured this module's attention output
        if recomputing():
            p.rec.cover(recomputed=1)
        else:  # a module-level attention site (eager softmax, linear attention): no logit figure is owed
            p.rec.cover(attention=1, probed=1)
        contained(p.site, fr.site, "attention", first_tensor(output))  # in a recompute: the grad hook only

    # ---- outputs -----------------------------------------------------------------------------------
    def output_hook(self, name: str, kind: str, module, args, output) -> None:
        """A module's output as a site: the logits head, and the coarse localisation sites (the embedding,
        each decoder block and its parts, MoE routers and experts, the final norm), every step."""
        p = self._probes
        if p.measuring and not _is_compiling():
            if kind == "logits":
                self._head_seen = True
                if p.stage() == "train" and not recomputing():
                    p.rec.cover(logits=True)
            contained(p.site, name, kind, first_tensor(output))

    # ---- the root module ---------------------------------------------------------------------------
    def root_pre(self, module, args, kwargs) -> None:
        if _is_compiling():
            compiled.count("forward")  # dynamo re-applies this after each run of the graph: no graph break
            return
        p = self._probes
        if not p.measuring or recomputing():
            return
        self._head_seen = False
        stage = p.stage()
        p.forward_starts(stage)
        train = stage == "train"
        p.rec.cover(forwards=1, train=train)
        if train:
            p.rerun.keep(args, kwargs)
        if self._signature is not None and stage != "generate":
            contained(record_forward_inputs, p.rec, self._signature, args, kwargs)

    def root_post(self, module, args, kwargs, output) -> None:
        """A head that never materialises logits (TRL's fused LM head returns log-probabilities from the
        hidden states and the head's weight): measure what it returned instead, and say so."""
        p = self._probes
        if not p.measuring or _is_compiling() or self._head_seen or p.head is None or recomputing():
            return
        log_probs = getattr(output, "log_probs", None)
        if isinstance(log_probs, torch.Tensor):
            if p.stage() == "train":
                p.rec.cover(logits=True)
            p.rec.warn(f"the output head ran fused (e.g. TRL's fused LM head): no logits were materialised, "
                       f"so its log-probabilities are measured instead, at {p.head}.log_probs")
            contained(p.site, p.head + ".log_probs", "logprob", log_probs)

    def rotary_pre(self, module, args, kwargs) -> None:
        """HF rotary embeddings see the position ids actually used, also when the model built them."""
        p = self._probes
        if not p.measuring or _is_compiling() or recomputing() or p.stage() == "generate":
            return
        fwd = p.rec.current_forward()
        if fwd is None or fwd.position_ids != "none":
            return
        pos = args[1] if len(args) > 1 else kwargs.get("position_ids")
        if isinstance(pos, torch.Tensor):
            contained(position_layout, p.rec, fwd, pos)

    # ---- around compiled code ----------------------------------------------------------------------
    def boundary_pre(self, module, args) -> None:
        """A wrapper (``torch.compile``'s OptimizedModule, DDP) is about to run the model."""
        if not _is_compiling():
            self._head_seen = False

    def boundary_post(self, module, args, output) -> None:
        """The wrapper returned: if the head's own hook did not run (it was inside a compiled graph),
        measure the logits here, at the boundary, in eager."""
        p = self._probes
        if p.active and not _is_compiling() and not self._head_seen and p.head is not None:
            self.output_hook(p.head, "logits", module, args, output)

    def param_grad(self, name: str, grad: torch.Tensor) -> None:
        """A parameter's gradient (its hook runs outside any compiled graph). Measured in steps where compiled
        code ran, when the activations could not be, and every step in a model with no other backward site."""
        p = self._probes
        if not p.active or grad is None or not (self.every_param_grad or compiled.ran()):
            return
        contained(p.rec.tensor, name, "tensor", "backward", local_shard(grad), "train")
