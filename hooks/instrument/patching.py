"""The patched functions: a wrapper around ``F.scaled_dot_product_attention`` and a scores probe on
``F.softmax`` (eager attention), both installed only while a Monitor is attached.

HF transformers (``sdpa_attention_forward``) and most model code look ``F.scaled_dot_product_attention``
up at call time, so replacing the attribute is enough; nothing is registered under a new attention name
(that would silently drop HF's padding mask). Each call is routed to the :class:`Probes` of the
Monitor whose module made it: the innermost instrumented module on the frame stack, else the nearest
module of an attached model on the Python call stack. What a routed call runs (the SDPA probe's body and
the eager scores probe, ``nanwatch.hooks.instrument.sdpa_probe``) is handed to :func:`install` with the Probes:
this module patches and routes, the probe measures.

Under ``torch.compile`` both wrappers are a plain call to the original: the eager-only probes
(backend prediction, grad_fn, saved log-sum-exp, Python bookkeeping) would add graph breaks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from nanwatch.hooks.failsafe import probe_failed
from nanwatch.hooks.instrument.probes import Frame, Probes, top
from nanwatch.hooks.measure import compiled
from nanwatch.hooks.measure.call_stack import nearest_self
from nanwatch.wire import dtype_name

__all__ = ["ORIGINAL_SDPA", "ORIGINAL_SOFTMAX", "Route", "install", "is_installed", "uninstall"]

#: The functions nanwatch wraps, as torch defines them; restored when the last Monitor detaches.
ORIGINAL_SDPA = F.scaled_dot_product_attention
ORIGINAL_SOFTMAX = F.softmax
_lock = threading.Lock()
_installed: list[Probes] = []


class Route(NamedTuple):
    """What a call routed to one Probes runs: ``sdpa(probes, frame, original, q, k, v, mask, dropout,
    is_causal, scale, enable_gqa, kwargs)`` in place of the SDPA call, ``scores(probes, frame, scores)``
    after an eager attention's softmax."""

    sdpa: Callable[..., Any]
    scores: Callable[[Probes, Frame, torch.Tensor], None]


_routes: dict[Probes, Route] = {}  # each installed Probes' route


def _site_of(obj: object) -> tuple[Probes, str] | None:
    """``obj``'s SDPA site, if it is a module of an attached model, with that model's Probes."""
    if isinstance(obj, torch.nn.Module):
        for probes in _installed:
            name = probes.sdpa_site_of(obj)
            if name is not None:
                return probes, name
    return None


def _owner_of_caller(max_depth: int = 8) -> tuple[Probes, str] | None:
    """For SDPA calls outside any hooked attention module: the nearest ``self`` on the call stack that is
    a module of an attached model, starting at ``_sdpa``'s frame (two above this one)."""
    return nearest_self(_site_of, skip=2, max_depth=max_depth)


def _frame_for_call() -> Frame | None:
    fr = top()
    if fr is not None and fr.attention:
        return fr
    found = _owner_of_caller()
    if found is not None:
        probes, name = found
        return Frame(probes, name, attention=True)
    if fr is not None:
        return Frame(fr.probes, fr.site + ".sdpa", attention=True)
    return None


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
          enable_gqa=False, **kwargs):
    frame = None
    if torch.compiler.is_compiling():
        if _installed:  # counted, not probed: see nanwatch.hooks.measure.compiled
            compiled.count("sdpa:" + dtype_name(query.dtype))
    elif _installed:
        try:
            frame = _frame_for_call()
        except Exception as exc:  # monitoring must never break the step
            probe_failed(exc)
    route = _routes.get(frame.probes) if frame is not None else None  # None: its Monitor detached meanwhile
    if frame is None or route is None:
        return ORIGINAL_SDPA(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                             enable_gqa=enable_gqa, **kwargs)
    frame.sdpa_calls += 1
    return route.sdpa(frame.probes, frame, ORIGINAL_SDPA, query, key, value, attn_mask, dropout_p, is_causal,
                      scale, enable_gqa, kwargs)


def _softmax(input, dim=None, _stacklevel=3, dtype=None):  # noqa: A002 - F.softmax's own signature
    out = ORIGINAL_SOFTMAX(input, dim, _stacklevel, dtype)
    if torch.compiler.is_compiling() or not _installed:
        return out
    fr = top()
    route = _routes.get(fr.probes) if fr is not None else None
    if route is not None and fr.attention and input.dim() == 4 and dim in (-1, 3):
        try:
            route.scores(fr.probes, fr, input)
        except Exception as exc:
            probe_failed(exc)
    return out


def is_installed() -> bool:
    return F.scaled_dot_product_attention is _sdpa


class _Uninstall:
    """The handle :func:`install` returns: ``remove()`` stops routing to its Probes."""

    def __init__(self, probes: Probes) -> None:
        self._probes = probes

    def remove(self) -> None:
        uninstall(self._probes)


def install(probes: Probes, route: Route) -> _Uninstall:
    """Route attention calls to ``probes`` too, each running ``route`` (the first install patches ``F``); the
    handle undoes it."""
    with _lock:
        if probes not in _installed:
            _installed.append(probes)
            _routes[probes] = route
            if len(_installed) == 1:
                F.scaled_dot_product_attention = _sdpa
                F.softmax = _softmax
    return _Uninstall(probes)


def uninstall(probes: Probes) -> None:
    """Stop routing to ``probes``; the last uninstall restores ``F``'s own functions."""
    with _lock:
        if probes in _installed:
            _installed.remove(probes)
            _routes.pop(probes, None)
        if not _installed:
            F.scaled_dot_product_attention = ORIGINAL_SDPA
            F.softmax = ORIGINAL_SOFTMAX
