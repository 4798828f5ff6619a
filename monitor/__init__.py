"""nanwatch.monitor: the collector service. Never imports torch.

The package imports nothing itself: ``create_app`` and the settings are loaded on first use, so that a
leaf that needs no web stack (``store``, ``state``, ``ledger``, ``metric_table``...) imports with its
own dependencies only (pydantic, and prometheus_client where it renders metrics).

Example usage::

    from nanwatch.monitor import Settings, create_app
    app = create_app(Settings(db_path="nanwatch.db", rank_ttl_s=60))
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["Rule", "Settings", "create_app", "get_settings"]

if TYPE_CHECKING:  # pragma: no cover
    from nanwatch.monitor.app import create_app
    from nanwatch.monitor.settings import Rule, Settings, get_settings

#: public name -> the module that defines it
_HOMES = {"create_app": "nanwatch.monitor.app", "Rule": "nanwatch.monitor.settings",
          "Settings": "nanwatch.monitor.settings", "get_settings": "nanwatch.monitor.settings"}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'nanwatch.monitor' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(home), name)
