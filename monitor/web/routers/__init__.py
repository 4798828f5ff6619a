"""One APIRouter per concern. Imported lazily, so that importing one router (or a helper beside them)
costs only that router's dependencies."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["directives", "health", "metrics", "reports", "runs", "weights"]


def __getattr__(name: str) -> ModuleType:
    if name in __all__:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
