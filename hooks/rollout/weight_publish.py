"""``Monitor.publish_weights``: the trainer's side of a verified weight sync. Fingerprints the weights it
publishes (``nanwatch.hooks.rollout.weight_fingerprint``) and posts them to the collector as the trainer's
set of that version (``nanwatch.weight_sync``); each rollout worker posts its own, and the collector
compares them (docs/weight_sync.md).

Dtypes: a rollout copy usually holds the weights in another dtype (bf16 from an fp32 trainer), and a
fingerprint is of the bits; so the set also carries ``casts``, the floating tensors' fingerprints as cast to
each rollout dtype (``MonitorConfig.rollout.dtype`` by default, or ``dtypes=``) the way a loader casts
(``.to(dtype)``): the collector compares each rollout tensor with the trainer's value for its dtype. That is
one more fingerprint pass (and one cast tensor alive at a time) per dtype, per publish. The set carries the
Monitor's incarnation too: the collector takes a trainer set only from the incarnation that posts the run's
reports, so a rollout worker cannot stand in for the trainer.

Monitoring never breaks training: a failure (no collector, a refusal, a timeout, a tensor with no integer
view) is a warning and ``None``, never an exception. The fingerprint reads its values to the host once (one
sync per call, which publishing weights to a rollout engine pays anyway); the post waits at most
``timeout_s``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from nanwatch.hooks.config import RolloutConfig
from nanwatch.hooks.rollout.weight_fingerprint import fingerprint_with_casts
from nanwatch.weight_sync import post_weights

__all__ = ["publish_weights"]


def publish_weights(rollout: RolloutConfig, weights: torch.nn.Module | Mapping[str, object] | None, version: int, *,
                    run_id: str, collector: str | None, token: str | None, rank: int, warn: Callable[[str], None], incarnation: str, gather: bool = False,
                    dtypes: Sequence[str | torch.dtype] | None = None, timeout_s: float = 10.0,
                    note: Callable[[int, list[str]], None] | None = None) -> dict[str, str] | None:
    """Fingerprint ``weights``, natively and as cast to each of ``dtypes`` (default: the rollout
    section's ``dtype``), and post them as the trainer's set of ``version`` with ``incarnation`` (rank 0 posts;
    with ``gather``, every rank joins the gathering of sharded tensors first). Returns the native
    fingerprints on the rank that computed them, else None; warns instead of raising. ``note``: told the
    version and the cast dtypes once rank 0 fingerprinted them (the Monitor's local record)."""
    if weights is None:
        warn("publish_weights: the model was garbage-collected; nothing published")
        return None
    if rank != 0 and not gather:
        return None  # replicated weights (DDP): rank 0's are every rank's
    try:
        wanted = [d if isinstance(d, torch.dtype) else getattr(torch, str(d).removeprefix("torch."))
                  for d in (dtypes if dtypes is not None else (rollout.dtype,))]
        if not all(isinstance(d, torch.dtype) and d.is_floating_point for d in wanted):
            raise ValueError(f"dtypes must name floating torch dtypes, got {list(dtypes or ())!r}")
        fps, casts = fingerprint_with_casts(weights, wanted, gather=gather)
    except Exception as exc:
        warn(f"publish_weights: could not fingerprint weight version {version}: {type(exc).__name__}: {exc}")
        return None
    if rank != 0:
        return fps
    if note is not None:
        note(version, list(casts))
    if collector is None:
        warn("publish_weights: no collector configured: weight fingerprints are not compared")
        return fps
    try:
        answer = post_weights(collector, run_id, version, fps, side="trainer", worker="trainer",
                              token=token, timeout_s=timeout_s, casts=casts, incarnation=incarnation)
    except Exception as exc:
        warn(f"publish_weights: weight version {version} not posted: {type(exc).__name__}: {str(exc)[:300]}")
        return fps
    if not answer.get("bound", True):
        warn("publish_weights: a weight version was posted before this trainer's first report reached the "
             "collector: it is compared once that report arrives")
    return fps
