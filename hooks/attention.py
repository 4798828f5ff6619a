"""The attention probes: a wrapper around ``F.scaled_dot_product_attention`` and a scores probe on
``F.softmax`` (eager attention), both installed only while a Monitor is attached.

HF transformers (``sdpa_attention_forward``) and most model code look ``F.scaled_dot_product_attention``
up at call time, so replacing the attribute is enough; nothing is registered under a new attention name
(that would silently drop HF's padding mask). Sites are named by the innermost instrumented module,
tracked with a thread-local stack that module pre/post hooks maintain.

Under ``torch.compile`` both wrappers are a plain call to the original: the eager-only probes
(backend prediction, grad_fn, saved log-sum-exp, Python bookkeeping) would add graph breaks.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from nanwatch.hooks.guard import probe_failed
from nanwatch.hooks.sdpa_probe import scores_probe, sdpa_call

if TYPE_CHECKING:  # pragma: no cover
    from nanwatch.hooks.monitor import Monitor

__all__ = ["Frame", "drain_compiled_calls", "install", "uninstall", "push", "pop", "top", "owner_of_caller", "is_installed"]

_ORIG_SDPA = F.scaled_dot_product_attention
_ORIG_SOFTMAX = F.softmax
_lock = threading.Lock()
_monitors: list[Monitor] = []
_tls = threading.local()


@dataclass(slots=True)
class Frame:
    """One instrumented module's forward in progress."""

    monitor: Monitor
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


def owner_of_caller(max_depth: int = 8) -> tuple[Monitor, str] | None:
    """For SDPA calls outside any hooked attention module: the nearest ``self`` on the call stack that is
    a module of an attached model. A few frame lookups; only taken on that rare path."""
    f = sys._getframe(2)
    for _ in range(max_depth):
        if f is None:
            return None
        obj = f.f_locals.get("self")
        if isinstance(obj, torch.nn.Module):
            for mon in _monitors:
                name = mon._fqn_of(obj)
                if name is not None:
                    return mon, name
        f = f.f_back
    return None


def _frame_for_call() -> tuple[Monitor, Frame] | None:
    fr = top()
    if fr is not None and fr.attention:
        return fr.monitor, fr
    found = owner_of_caller()
    if found is not None:
        mon, name = found
        return mon, Frame(mon, name, attention=True)
    if fr is not None:
        return fr.monitor, Frame(fr.monitor, fr.site + ".sdpa", attention=True)
    return None


#: SDPA calls that ran inside compiled graphs, by dtype. Dynamo replays this dict update as a side effect
#: after each run of the graph (no graph break), so compiled attention is counted though not probed.
_compiled_calls: dict[str, int] = {}


def drain_compiled_calls() -> dict[str, int]:
    """SDPA calls made inside compiled graphs since the last drain, by dtype (process-wide)."""
    calls = dict(_compiled_calls)
    _compiled_calls.clear()
    return calls


def _sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
          enable_gqa=False, **kwargs):
    if torch.compiler.is_compiling():
        if _monitors:
            dtype = str(query.dtype).removeprefix("torch.")
            _compiled_calls[dtype] = _compiled_calls.get(dtype, 0) + 1
        return _ORIG_SDPA(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                          enable_gqa=enable_gqa, **kwargs)
    if not _monitors:
        return _ORIG_SDPA(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                          enable_gqa=enable_gqa, **kwargs)
    try:
        found = _frame_for_call()
    except Exception as exc:  # monitoring must never break the step
        probe_failed(exc)
        found = None
    if found is None:
        return _ORIG_SDPA(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                          enable_gqa=enable_gqa, **kwargs)
    mon, frame = found
    frame.sdpa_calls += 1
    return sdpa_call(mon, frame, _ORIG_SDPA, query, key, value, attn_mask, dropout_p, is_causal, scale,
                          enable_gqa, kwargs)


def _softmax(input, dim=None, _stacklevel=3, dtype=None):  # noqa: A002 - F.softmax's own signature
    out = _ORIG_SOFTMAX(input, dim, _stacklevel, dtype)
    if torch.compiler.is_compiling() or not _monitors:
        return out
    fr = top()
    if fr is not None and fr.attention and input.dim() == 4 and dim in (-1, 3):
        try:
            scores_probe(fr.monitor, fr, input)
        except Exception as exc:
            probe_failed(exc)
    return out


def is_installed() -> bool:
    return F.scaled_dot_product_attention is _sdpa


def install(monitor: Monitor) -> None:
    with _lock:
        if monitor in _monitors:
            return
        _monitors.append(monitor)
        if len(_monitors) == 1:
            F.scaled_dot_product_attention = _sdpa
            F.softmax = _softmax


def uninstall(monitor: Monitor) -> None:
    with _lock:
        if monitor in _monitors:
            _monitors.remove(monitor)
        if not _monitors:
            F.scaled_dot_product_attention = _ORIG_SDPA
            F.softmax = _ORIG_SOFTMAX
