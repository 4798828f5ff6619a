"""nanwatch.integrations: the old import path of the framework integrations, kept so that existing
imports still work. The code lives in :mod:`nanwatch.hooks.integrations` (its folder is ``hooks/``);
each module here re-exports its namesake there and says so with a DeprecationWarning."""

__all__: list[str] = []
