"""Monitoring never breaks training: a probe that fails is logged, warned about and skipped."""

from __future__ import annotations

import logging
import warnings

__all__ = ["guarded", "probe_failed"]

log = logging.getLogger("nanwatch")


def probe_failed(exc: BaseException) -> None:
    log.warning("nanwatch: probe failed and was skipped: %r", exc, exc_info=exc)
    warnings.warn(f"nanwatch: probe failed and was skipped: {exc!r}", RuntimeWarning, stacklevel=3)


def guarded(fn, *args, **kwargs) -> None:
    """Call a probe; any exception becomes a warning."""
    try:
        fn(*args, **kwargs)
    except Exception as exc:
        probe_failed(exc)
