"""nanwatch.hooks: trainer-side instrumentation. Never imports the web stack.

``attach(model, run_id=...)`` returns a :class:`Monitor`; see its docstring for an example.
``rollout_logprobs(generate_output)``: the rollout logprobs of a plain HF ``generate()``, for
``Monitor.rlhf(rollout_logprobs=...)`` (``nanwatch.hooks.rollout.generated``). ``record_routes(model)``: the MoE
routes a plain HF rollout took, for ``Monitor.rlhf(rollout_routes=...)`` (``nanwatch.hooks.moe.routes``).

The names below are imported lazily (module ``__getattr__``, as in the root package), so that importing a
leaf such as ``nanwatch.hooks.report.transport`` runs this file without pulling in torch: each leaf costs only its
own dependencies, as its docstring says.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["Monitor", "MonitorConfig", "attach", "fingerprint", "record_routes", "rollout_logprobs"]

#: public name -> the module that defines it
_HOMES = {"Monitor": "nanwatch.hooks.facade", "attach": "nanwatch.hooks.facade",
          "MonitorConfig": "nanwatch.hooks.config", "rollout_logprobs": "nanwatch.hooks.rollout.generated",
          "fingerprint": "nanwatch.hooks.rollout.weight_fingerprint", "record_routes": "nanwatch.hooks.moe.routes"}

if TYPE_CHECKING:  # pragma: no cover
    from nanwatch.hooks.config import MonitorConfig
    from nanwatch.hooks.facade import Monitor, attach
    from nanwatch.hooks.moe.routes import record_routes
    from nanwatch.hooks.rollout.generated import rollout_logprobs
    from nanwatch.hooks.rollout.weight_fingerprint import fingerprint


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'nanwatch.hooks' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
