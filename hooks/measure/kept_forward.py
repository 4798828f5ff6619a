"""What the differential rerun (``nanwatch.hooks.forensics.rerun``) needs of a training forward to re-run it:
references to its arguments (nothing is copied) and the RNG state at its start.

An HF key/value cache among a call's arguments (``past_key_values``, a ``transformers`` ``Cache``) is the one
argument the call itself changes: the model appends this call's keys and values to it. Kept by reference,
a re-run would see the cache as it stood after the call, not before. :func:`freeze` records a cache's state
at the call's start (:class:`CacheAtCall`: per layer, references to its keys and values; a ``DynamicLayer``
grows by ``torch.cat``, so the tensors referenced are never written again) and :func:`thaw` builds a fresh
cache of that state for each re-run. Only the caches of :data:`CACHE_CLASSES`, with the layers of
:data:`LAYER_KINDS`, are recordable; any other cache is passed through by reference and named (``why``)
where a capsule records it. A call without a cache costs one ``isinstance`` per argument.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["CACHE_CLASSES", "LAYER_KINDS", "CacheAtCall", "KeptForward", "build_cache", "freeze", "keep", "thaw"]

#: the cache classes whose state is recorded (and, from a capsule, rebuilt): nothing else is
CACHE_CLASSES = ("transformers.cache_utils:DynamicCache", "transformers.cache_utils:EncoderDecoderCache")
#: a recordable cache's layer classes, by the kind a capsule names them
LAYER_KINDS = {"DynamicLayer": "full", "DynamicSlidingWindowLayer": "sliding"}


@dataclass(slots=True)
class CacheAtCall:
    """An HF cache's state at a call's start. ``state`` (None: not recordable, ``why`` says why):
    ``{"cache": class path, "lazy": bool, "layers": [{"kind", "keys", "values", "window", "seen"}]}`` for
    a ``DynamicCache`` (keys/values None: an empty layer), ``{"cache": ..., "self": state, "cross": state,
    "is_updated": {layer: bool}}`` for an ``EncoderDecoderCache``."""

    cls: str
    original: Any
    state: dict[str, Any] | None = None
    why: str = ""


def _class_path(obj: Any) -> str:
    return f"{type(obj).__module__}:{type(obj).__qualname__}"


def _cache_types() -> tuple[type, ...]:
    cache_utils = sys.modules.get("transformers.cache_utils")  # not loaded: no HF cache can exist
    return (cache_utils.Cache,) if cache_utils is not None and hasattr(cache_utils, "Cache") else ()


def _state(cache: Any) -> tuple[dict[str, Any] | None, str]:
    cls = _class_path(cache)
    if cls not in CACHE_CLASSES:
        return None, f"not a cache class nanwatch records ({', '.join(c.split(':')[1] for c in CACHE_CLASSES)})"
    if cls.endswith(":EncoderDecoderCache"):
        parts = [_state(getattr(cache, a, None)) for a in ("self_attention_cache", "cross_attention_cache")]
        bad = next((why for s, why in parts if s is None), None)
        if bad is not None:
            return None, f"a part of it is {bad}"
        updated = {str(k): bool(v) for k, v in getattr(cache, "is_updated", {}).items()}
        return {"cache": cls, "self": parts[0][0], "cross": parts[1][0], "is_updated": updated}, ""
    layers = []
    for i, layer in enumerate(cache.layers):
        kind = LAYER_KINDS.get(type(layer).__qualname__)
        if kind is None or type(layer).__module__ != "transformers.cache_utils":
            return None, f"layer {i} is a {_class_path(layer)}, not a {' or '.join(LAYER_KINDS)}"
        on = bool(getattr(layer, "is_initialized", False)) and isinstance(getattr(layer, "keys", None), torch.Tensor)
        row: dict[str, Any] = {"kind": kind, "keys": layer.keys if on else None, "values": layer.values if on else None}
        if kind == "sliding":
            row.update(window=int(layer.sliding_window), seen=int(layer.cumulative_length))
        layers.append(row)
    return {"cache": cls, "lazy": getattr(cache, "layer_class_to_replicate", None) is not None, "layers": layers}, ""


def _freeze(x: Any, types: tuple[type, ...]) -> Any:
    if types and isinstance(x, types):
        state, why = _state(x)
        return CacheAtCall(_class_path(x), x, state, why)
    return x


def freeze(args: tuple, kwargs: dict) -> tuple[tuple, dict, bool]:
    """``(args, kwargs, any cache)``: each HF cache among the call's arguments (top level) replaced by its
    :class:`CacheAtCall` now; without a cache, the arguments themselves."""
    types = _cache_types()
    if not types or not any(isinstance(x, types) for x in (*args, *kwargs.values())):
        return args, kwargs, False
    return tuple(_freeze(a, types) for a in args), {k: _freeze(v, types) for k, v in kwargs.items()}, True


def build_cache(state: dict[str, Any], tensor=lambda t: t) -> Any:
    """A fresh cache of a recorded ``state`` (:attr:`CacheAtCall.state`, or a capsule's, its tensors
    through ``tensor``). Builds only :data:`CACHE_CLASSES` and :data:`LAYER_KINDS`; ValueError otherwise."""
    from transformers import cache_utils

    if state.get("cache") not in CACHE_CLASSES:
        raise ValueError(f"{state.get('cache')!r} is not a cache class nanwatch rebuilds")
    if state["cache"].endswith(":EncoderDecoderCache"):
        cache = cache_utils.EncoderDecoderCache(build_cache(state["self"], tensor), build_cache(state["cross"], tensor))
        cache.is_updated = {int(k): bool(v) for k, v in state.get("is_updated", {}).items()}
        return cache
    cache = cache_utils.DynamicCache()  # lazy: a layer is appended at each new layer index
    layers = []
    for row in state["layers"]:
        if row["kind"] not in LAYER_KINDS.values():
            raise ValueError(f"layer kind {row['kind']!r} is not one nanwatch rebuilds")
        layer = (cache_utils.DynamicSlidingWindowLayer(sliding_window=int(row["window"])) if row["kind"] == "sliding"
                 else cache_utils.DynamicLayer())
        if row["keys"] is not None:
            keys, values = tensor(row["keys"]), tensor(row["values"])
            layer.lazy_initialization(keys, values)
            layer.keys, layer.values = keys, values
            if row["kind"] == "sliding":
                layer.cumulative_length = int(row["seen"])
        layers.append(layer)
    cache.layers = layers
    if not state.get("lazy", True):
        cache.layer_class_to_replicate = None  # built from a config: every layer exists up front
    return cache


def thaw(x: Any) -> Any:
    """A fresh cache of a recordable :class:`CacheAtCall`'s state; the original object otherwise."""
    if isinstance(x, CacheAtCall):
        return build_cache(x.state) if x.state is not None else x.original
    return x


@dataclass(slots=True)
class KeptForward:
    """One training forward of the step: its arguments (references; an HF cache as it stood at the call's
    start, rebuilt fresh at each read of :attr:`args` and :attr:`kwargs`) and the RNG state at its start."""

    frozen_args: tuple
    frozen_kwargs: dict
    cpu_rng: torch.Tensor
    cuda_rng: list[torch.Tensor] = field(default_factory=list)
    has_cache: bool = False

    @property
    def args(self) -> tuple:
        return tuple(map(thaw, self.frozen_args)) if self.has_cache else self.frozen_args

    @property
    def kwargs(self) -> dict:
        return {k: thaw(v) for k, v in self.frozen_kwargs.items()} if self.has_cache else self.frozen_kwargs


def keep(args: tuple, kwargs: dict) -> KeptForward:
    """What a forward needs to be re-run later: references to its arguments, and the RNG state now."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    args, kwargs, has_cache = freeze(args, dict(kwargs))
    return KeptForward(args, kwargs, torch.get_rng_state(), cuda, has_cache)
