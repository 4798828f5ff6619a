"""The one walk up the Python call stack: find the nearest ``self`` that answers a question.

Two places need it, both rare paths: an SDPA call made outside any hooked attention module is routed to
the Monitor whose model made it (``nanwatch.hooks.instrument.patching``), and the HF callback finds the Trainer that
fires its event (callbacks are not handed the trainer). Standard library only.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TypeVar

__all__ = ["nearest_self"]

T = TypeVar("T")


def nearest_self(answer: Callable[[object], T | None], *, skip: int, max_depth: int) -> T | None:
    """The first non-None ``answer(self)`` over the ``self`` locals of up to ``max_depth`` frames, starting
    ``skip`` frames above the caller (0: the caller's own frame); None if no frame answers. A few frame
    lookups, no more."""
    f = sys._getframe(skip + 1)
    for _ in range(max_depth):
        if f is None:
            return None
        obj = f.f_locals.get("self")
        if obj is not None:
            found = answer(obj)
            if found is not None:
                return found
        f = f.f_back
    return None
