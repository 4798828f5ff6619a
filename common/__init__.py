"""nanwatch: numerical-health monitoring for PyTorch training.

``nanwatch.attach`` is the trainer-side entry point, and ``nanwatch.fingerprint`` the weight fingerprint
(``nanwatch.hooks.rollout.weight_fingerprint``); both are imported lazily so that the collector, which
imports ``nanwatch.wire``, never pulls in torch: importing the package imports nothing. The public API is declared in one
place, ``nanwatch.public_api`` (docs/api.md lists it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["attach", "fingerprint", "__version__"]
__version__ = "0.1.0"

if TYPE_CHECKING:  # pragma: no cover
    from nanwatch.hooks import attach, fingerprint


def __getattr__(name: str) -> Any:
    if name in ("attach", "fingerprint"):
        import nanwatch.hooks

        return getattr(nanwatch.hooks, name)
    raise AttributeError(f"module 'nanwatch' has no attribute {name!r}")
