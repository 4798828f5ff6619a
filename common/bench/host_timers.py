"""Where nanwatch's time goes on the training thread, by entry point: a clock around each function through
which nanwatch runs inside a training step, added up while :func:`timing` is active (``nanwatch bench
profile --timers``).

A whole-step difference on a shared machine moves by several milliseconds between rounds; these clocks
do not: each reads only the time spent inside nanwatch (device ops included, on a CPU where they run
inline). What they miss: the reporter thread (measured apart, by its own CPU clock) and what that thread
takes from the training thread (a core, the GIL). Each clock costs about a microsecond a call.

The hook bodies are bound when a Monitor attaches, so :func:`timing` must be entered before ``attach``.
"""

from __future__ import annotations

import contextlib
import importlib
import time
from collections.abc import Iterator

__all__ = ["ENTRY_POINTS", "timing"]

#: (module, class or None, function, what runs there): the training thread's ways into nanwatch in a step.
ENTRY_POINTS: tuple[tuple[str, str | None, str, str], ...] = (
    ("nanwatch.hooks.instrument.sdpa_probe", None, "_after_sdpa",
     "attention calls: the query and output reads, the logit bound, the backend record"),
    ("nanwatch.hooks.instrument.module_hooks", "ModuleHooks", "output_hook",
     "output sites: the logits, the embedding and the coarse sites (forward reads, gradient hooks placed)"),
    ("nanwatch.hooks.instrument.probes", "Probes", "_grad_hook", "gradient reads (backward)"),
    ("nanwatch.hooks.instrument.module_hooks", "ModuleHooks", "param_grad",
     "parameter-gradient hooks (idle unless compiled code ran)"),
    ("nanwatch.hooks.instrument.module_hooks", "ModuleHooks", "root_pre",
     "the model's forward start: count, kept inputs, input fingerprint"),
    ("nanwatch.hooks.instrument.module_hooks", "ModuleHooks", "rotary_pre", "rotary embeddings: position ids"),
    ("nanwatch.hooks.instrument.module_hooks", "ModuleHooks", "attn_pre", "attention modules' pre-hooks"),
    ("nanwatch.hooks.instrument.module_hooks", "ModuleHooks", "attn_post", "attention modules' post-hooks"),
    ("nanwatch.hooks.facade", "Monitor", "begin_step",
     "step start: the rotating parameter sweep, the last update's carry, directives"),
    ("nanwatch.hooks.facade", "Monitor", "rlhf", "rlhf(): the RLHF and rollout statistics"),
    ("nanwatch.hooks.measure.optimizer_check", "OptimizerCheck", "_check",
     "the optimizer check: every updated parameter read"),
    ("nanwatch.hooks.remedies.weight_guard", None, "job_flag", "the weight guard's flag"),
    ("nanwatch.hooks.facade", "Monitor", "end_step",
     "step end: the rerun's flag, flattening, the slot buffer copy, the hand-over"),
)


def _clocked(fn, seconds: dict[str, float], key: str):
    def clocked(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            seconds[key] += time.perf_counter() - t

    return clocked


@contextlib.contextmanager
def timing() -> Iterator[dict[str, float]]:
    """Clock every entry point while inside; yields the seconds per entry point (``module.function`` or
    ``Class.function``), which the caller may reset between rounds. Everything is restored on exit."""
    seconds: dict[str, float] = {}
    undo = []
    try:
        for module_name, cls_name, fn_name, _ in ENTRY_POINTS:
            module = importlib.import_module(module_name)
            owner = getattr(module, cls_name) if cls_name else module
            key = f"{cls_name or module_name.rsplit('.', 1)[1]}.{fn_name}"
            seconds[key] = 0.0
            original = owner.__dict__[fn_name] if cls_name else getattr(module, fn_name)
            setattr(owner, fn_name, _clocked(original, seconds, key))
            undo.append((owner, fn_name, original))
        yield seconds
    finally:
        for owner, fn_name, original in reversed(undo):
            setattr(owner, fn_name, original)
