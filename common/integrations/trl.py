"""Deprecated: use ``nanwatch.hooks.integrations.trl`` (same names, re-exported here)."""

import warnings

from nanwatch.hooks.integrations.trl import SUPPORTED, instrument

__all__ = ["SUPPORTED", "instrument"]

warnings.warn("nanwatch.integrations.trl is deprecated: import from nanwatch.hooks.integrations.trl",
              DeprecationWarning, stacklevel=2)
