"""``Monitor.publish_weights``: the trainer's side of a verified weight sync. Fingerprints the weights it
publishes (``nanwatch.hooks.measure.weight_fingerprint``) and posts them to the collector as the trainer's
set of that version (``nanwatch.weight_sync``); each rollout worker posts its own, and the collector
compares them (docs/weight_sync.md).

Monitoring never breaks training: a failure (no collector, a refusal, a timeout, a tensor with no integer
view) is a warning and ``None``, never an exception. The fingerprint reads its values to the host once (one
sync per call, which publishing weights to a rollout engine pays anyway); the post waits at most
``timeout_s``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from nanwatch.hooks.config import MonitorConfig
from nanwatch.hooks.measure.weight_fingerprint import fingerprint
from nanwatch.weight_sync import post_weights

__all__ = ["publish_weights"]


def publish_weights(config: MonitorConfig, weights: torch.nn.Module | Mapping[str, object] | None, version: int, *,
                    rank: int, warn: Callable[[str], None], gather: bool = False,
                    timeout_s: float = 10.0) -> dict[str, str] | None:
    """Fingerprint ``weights`` and post them as the trainer's set of ``version`` (rank 0 posts; with
    ``gather``, every rank joins the gathering of sharded tensors first). Returns the fingerprints on the
    rank that computed them, else None; warns instead of raising."""
    if weights is None:
        warn("publish_weights: the model was garbage-collected; nothing published")
        return None
    if rank != 0 and not gather:
        return None  # replicated weights (DDP): rank 0's are every rank's
    try:
        fps = fingerprint(weights, gather=gather)
    except Exception as exc:
        warn(f"publish_weights: could not fingerprint weight version {version}: {type(exc).__name__}: {exc}")
        return None
    if rank != 0:
        return fps
    if config.collector is None:
        warn("publish_weights: no collector configured: weight fingerprints are not compared")
        return fps
    try:
        post_weights(config.collector, config.run_id, version, fps, side="trainer", worker="trainer",
                     token=config.token, timeout_s=timeout_s)
    except Exception as exc:
        warn(f"publish_weights: weight version {version} not posted: {type(exc).__name__}: {str(exc)[:300]}")
    return fps
