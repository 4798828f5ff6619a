"""Monitoring never breaks training: a probe that fails is logged, warned about and skipped, and a
condition worth telling the user is told once, not once per step."""

from __future__ import annotations

import logging
import threading
import warnings

__all__ = ["WarnOnce", "contained", "probe_failed"]

log = logging.getLogger("nanwatch")


def probe_failed(exc: BaseException) -> None:
    log.warning("nanwatch: probe failed and was skipped: %r", exc, exc_info=exc)
    warnings.warn(f"nanwatch: probe failed and was skipped: {exc!r}", RuntimeWarning, stacklevel=3)


def contained(fn, *args, **kwargs) -> None:
    """Call a probe; any exception it raises is contained: it becomes a warning, never the trainer's error."""
    try:
        fn(*args, **kwargs)
    except Exception as exc:
        probe_failed(exc)


class WarnOnce:
    """Log and ``warnings.warn`` a message the first time its text (after the first ``:``, so that a
    step or forward number in front does not make it new) is seen; called from the training thread and
    the reporter thread alike."""

    def __init__(self) -> None:
        self._seen: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, message: str) -> None:
        head = message.split(":", 1)[-1]
        with self._lock:
            if head in self._seen:
                return
            self._seen.add(head)
        log.warning("nanwatch: %s", message)
        warnings.warn(f"nanwatch: {message}", RuntimeWarning, stacklevel=2)
