"""Installation: build one Monitor's probes for a model (:func:`probes_for`: names and head, no hook yet),
put them on it (:func:`install`) and hand back every handle that takes them off.

What is installed: the attention modules' pre/post hooks, the logits head, the coarse localisation sites,
the root module's hooks (forward count, fingerprint, kept inputs), the rotary embeddings' position ids,
the boundary of a wrapper (DDP, ``torch.compile``), a gradient hook per parameter, a wrapper around
``model.generate``, and the patched attention functions (``nanwatch.hooks.instrument.patching``, routed to the
SDPA probe's body and the scores probe, ``nanwatch.hooks.instrument.sdpa_probe``). Installation is all
or nothing: if any step fails, what was done is undone before the error propagates. The handles are
removed in reverse order (last installed, first removed), as ``contextlib.ExitStack`` does.

A model holds at most one Monitor, counting the modules inside it and those containing it (two monitors
would double-count every site); a second is refused here.

Example usage::

    probes = probes_for(model, config=cfg.measure, rec=rec, directive_state=state, model_ref=weakref.ref(model))
    handles = install(model, probes, outer=wrapper, owner=monitor, config=cfg.measure)
    ...
    for h in reversed(handles):
        h.remove()
"""

from __future__ import annotations

import functools
import inspect
import sys
import warnings
import weakref
from collections.abc import Callable
from functools import partial

import torch

from nanwatch.hooks.config import MeasureConfig
from nanwatch.hooks.instrument import patching, sdpa_probe
from nanwatch.hooks.instrument.module_hooks import ModuleHooks
from nanwatch.hooks.instrument.probes import DirectiveInForce, Probes
from nanwatch.hooks.measure.recorder import Recorder
from nanwatch.hooks.measure.structure import coarse_sites

__all__ = ["RestoreAttr", "attention_modules", "device_of", "install", "probes_for", "user_model"]

#: model -> the Monitor attached to it (weak both ways: a model or Monitor that goes away leaves it)
_attached: weakref.WeakKeyDictionary[torch.nn.Module, object] = weakref.WeakKeyDictionary()


def _module_wrappers() -> tuple[type, ...]:
    """Wrapper classes that hold the user's model as ``.module``: DDP, DataParallel, and, when their library
    is already loaded (a wrapper instance implies it; nanwatch never imports them), FSDP and DeepSpeed's
    engine (HF ``Trainer`` with ``deepspeed=...`` hands the callback a ``DeepSpeedEngine``)."""
    found: list[type] = [torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel]
    for module, name in (("torch.distributed.fsdp", "FullyShardedDataParallel"),
                         ("deepspeed.runtime.engine", "DeepSpeedEngine")):
        cls = getattr(sys.modules.get(module), name, None)
        if isinstance(cls, type):
            found.append(cls)
    return tuple(found)


def user_model(model: torch.nn.Module) -> torch.nn.Module:
    """The user's model inside the wrappers training stacks put around it: DDP, DataParallel, FSDP and
    DeepSpeed's engine (``.module``), ``torch.compile`` (``._orig_mod``), and their combinations (Accelerate
    uses these). Site names are then the user's FQNs, and the output head is found. By type and attribute,
    never by truthiness or ``len()`` (a compiled HF model refuses ``len()``)."""
    wrappers = _module_wrappers()
    seen = set()
    while id(model) not in seen:
        seen.add(id(model))
        if isinstance(model, wrappers) and isinstance(getattr(model, "module", None), torch.nn.Module):
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
            model = model._orig_mod
    return model


def device_of(model: torch.nn.Module) -> torch.device:
    """Where a Monitor's measurements of ``model`` live: its first parameter's device, else the CPU."""
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


class RestoreAttr:
    """A handle that puts an instance attribute back (``model.generate`` while wrapped)."""

    def __init__(self, obj: object, name: str) -> None:
        self._obj, self._name = obj, name

    def remove(self) -> None:
        try:
            delattr(self._obj, self._name)
        except AttributeError:
            pass


class _Claim:
    """The handle that marks ``model`` as monitored by ``owner`` until removed."""

    def __init__(self, model: torch.nn.Module, owner: object) -> None:
        self._model, self._owner = weakref.ref(model), owner
        _attached[model] = owner

    def remove(self) -> None:
        model = self._model()
        if model is not None and _attached.get(model) is self._owner:
            _attached.pop(model, None)


def _refuse_overlap(model: torch.nn.Module) -> None:
    for other in list(_attached):
        if other is model or any(m is model for m in other.modules()) or any(m is other for m in model.modules()):
            raise RuntimeError("nanwatch: this model (or a module inside it, or one containing it) already has a "
                               "Monitor attached; close() it first (two monitors would double-count every site)")


def attention_modules(model: torch.nn.Module, fqns: dict[int, str],
                      is_attention: Callable[[str, torch.nn.Module], bool]) -> list[tuple[str, torch.nn.Module]]:
    """The innermost modules ``is_attention`` accepts, with their site names (a match that contains
    another match is dropped)."""
    hits = [(fqns[id(m)], m) for n, m in model.named_modules() if is_attention(n, m)]
    names = [n for n, _ in hits]
    return [(n, m) for n, m in hits if not any(o.startswith(n + ".") for o in names)]


def _wrap_generate(model: torch.nn.Module, probes: Probes) -> RestoreAttr:
    """Forwards inside ``model.generate()`` (e.g. GRPO's rollouts) belong to the ``generate`` stage."""
    generate = model.generate

    @functools.wraps(generate)
    def generating(*args, **kwargs):
        with probes.generating():
            return generate(*args, **kwargs)

    model.generate = generating
    return RestoreAttr(model, "generate")


def _head(model: torch.nn.Module, cfg: MeasureConfig) -> torch.nn.Module | None:
    """The model's output head (HF's ``get_output_embeddings``), when logits are measured."""
    head = model.get_output_embeddings() if cfg.logits and hasattr(model, "get_output_embeddings") else None
    return head if isinstance(head, torch.nn.Module) else None


def _fallback_sites(model: torch.nn.Module, probes: Probes, hooks: ModuleHooks, hook) -> None:
    """A model with no attention module, no logits head and no decoder block (a plain ``nn.Sequential`` MLP):
    nothing recognised would see a non-finite value, and the weight guard would let the step through. Its
    output (both passes), the direct parts of a root ``nn.Sequential`` (the module of birth), and every
    parameter's gradient, every step, are read instead; said once, at attach."""
    fqns = probes.fqns
    parts = [(fqns[id(m)], m) for m in model.children()] if isinstance(model, torch.nn.Sequential) else []
    for site, mod in [*parts, (fqns[id(model)], model)]:
        hook(mod.register_forward_hook(partial(hooks.output_hook, site, "module"), always_call=True))
        probes.mark_coarse(mod, site, "module")  # an SDPA call it makes itself is then ``<site>.sdpa``
    hooks.every_param_grad = True
    warnings.warn(f"nanwatch: no attention module, logits head or decoder block found in {type(model).__name__}: "
                  f"detecting non-finite values at its output{' and its ' + str(len(parts)) + ' parts' if parts else ''} "
                  "(forward and backward) and at every parameter's gradient instead. Pass is_attention= to name "
                  "attention modules, or mon.watch(name, tensor) for any other tensor.", RuntimeWarning, stacklevel=6)


def probes_for(model: torch.nn.Module, *, config: MeasureConfig, rec: Recorder,
               directive_state: DirectiveInForce, model_ref: Callable[[], torch.nn.Module | None]) -> Probes:
    """The Probes of one Monitor on ``model`` (the user's, inside any wrapper): its module names and output
    head, read once; no hook is registered (that is :func:`install`)."""
    # the root's FQN is "": name it by its class so a root that is itself attention gets a site name
    fqns = {id(m): name or type(m).__name__ for name, m in model.named_modules()}
    head = _head(model, config)
    return Probes(rec=rec, directive_state=directive_state, fqns=fqns, grads=config.grads,
                  exact_every=config.exact_logit_every, exact_chunk_elems=config.exact_logit_chunk_elems,
                  model=model_ref, head=fqns.get(id(head)) if head is not None else None)


def install(model: torch.nn.Module, probes: Probes, *, outer: torch.nn.Module | None, owner: object,
            config: MeasureConfig) -> list:
    """Install ``probes`` (built by :func:`probes_for`) on ``model`` for ``owner`` (a Monitor; ``outer``: the
    wrapper the user handed in, if any); returns the handles, in installation order."""
    _refuse_overlap(model)
    handles: list = []
    try:
        _register(model, outer, config, probes, handles.append)
        handles.append(_Claim(model, owner))
        handles.append(probes.enable())
        handles.append(patching.install(probes, patching.Route(sdpa_probe.sdpa_call, sdpa_probe.scores_probe)))
    except BaseException:
        for h in reversed(handles):
            h.remove()
        raise
    return handles


def _register(model, outer, cfg: MeasureConfig, probes: Probes, hook) -> None:
    fqns = probes.fqns
    head = _head(model, cfg) if probes.head is not None else None
    head_name = probes.head
    signature = inspect.signature(model.forward) if cfg.fingerprint else None
    hooks = ModuleHooks(probes, forward_signature=signature)
    attn = attention_modules(model, fqns, cfg.is_attention)
    for name, mod in attn:
        hook(mod.register_forward_pre_hook(partial(hooks.attn_pre, name)))
        hook(mod.register_forward_hook(hooks.attn_post, always_call=True))
    if head_name is not None:
        hook(head.register_forward_hook(partial(hooks.output_hook, head_name, "logits"), always_call=True))
    coarse = []
    if cfg.coarse:
        skip = {id(m) for _, m in attn} | ({id(head)} if head_name is not None else set())
        coarse = coarse_sites(model, fqns, skip)
        for site, kind, mod in coarse:
            hook(mod.register_forward_hook(partial(hooks.output_hook, site, kind), always_call=True))
            probes.mark_coarse(mod, site, kind)
    if cfg.coarse and not attn and head_name is None and not coarse:
        _fallback_sites(model, probes, hooks, hook)
    elif not attn:
        warnings.warn("nanwatch: no attention module found by class name (*Attention, *Attn, *DeltaNet); SDPA "
                      "calls are still caught, eager attention is not. Pass is_attention= to name your attention "
                      "modules.", RuntimeWarning, stacklevel=5)
    hook(model.register_forward_pre_hook(hooks.root_pre, with_kwargs=True))
    hook(model.register_forward_hook(hooks.root_post, with_kwargs=True))
    if cfg.fingerprint:
        for mod in model.modules():
            if type(mod).__name__.endswith("RotaryEmbedding"):
                hook(mod.register_forward_pre_hook(hooks.rotary_pre, with_kwargs=True))
    if outer is not None and outer is not model:  # DDP, torch.compile: the boundary runs in eager
        hook(outer.register_forward_pre_hook(hooks.boundary_pre))
        hook(outer.register_forward_hook(hooks.boundary_post))
    # Parameter gradients: measured only in steps where compiled code ran (hooks.param_grad), since
    # their hooks run outside the graph; otherwise one early return per parameter and micro-batch.
    for name, param in model.named_parameters():
        if param.requires_grad:
            hook(param.register_hook(partial(hooks.param_grad, name)))
    if callable(getattr(model, "generate", None)):
        hook(_wrap_generate(model, probes))
