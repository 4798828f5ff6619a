"""Deprecated: use ``nanwatch.hooks.integrations.transformers`` (same names, re-exported here)."""

import warnings

from nanwatch.hooks.integrations.transformers import NanwatchCallback

__all__ = ["NanwatchCallback"]

warnings.warn("nanwatch.integrations.transformers is deprecated: import NanwatchCallback from "
              "nanwatch.hooks.integrations.transformers", DeprecationWarning, stacklevel=2)
