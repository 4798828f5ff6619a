"""What ran inside torch.compile'd graphs, counted without a graph break.

The probes are off while dynamo traces (an eager-only probe would split the graph), so compiled code is
not measured; it is counted instead. A traced probe calls :func:`count`, which mutates a plain module-level
dict: dynamo records that as a side effect and replays it after every run of the graph, so each compiled
forward and each SDPA call in it is counted at run time, at no graph break. The Monitor drains the counts
at step end. The counts are process-wide: with two Monitors attached, the first to end a step takes them.
"""

from __future__ import annotations

__all__ = ["count", "drain", "ran"]

_counts: dict[str, int] = {}


def count(key: str) -> None:
    """Count one compiled event (``forward``, or ``sdpa:<dtype>``); safe to call while dynamo traces."""
    _counts[key] = _counts.get(key, 0) + 1


def ran() -> bool:
    """Whether compiled code ran since the last drain."""
    return bool(_counts)


def drain() -> dict[str, int]:
    """The counts since the last drain, reset."""
    out = dict(_counts)
    _counts.clear()
    return out
