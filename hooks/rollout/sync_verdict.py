"""What the weight sync says of the rollout's weights, asked of the collector before a rollout mismatch is
classified (#36): a mismatch that stale weights explain is never a drift or an offset, and a jump with
verified weights is not blamed on the sync. Reporter thread, host side.

The collector holds the verdicts (``GET /v1/runs/{run_id}/weights``: the latest version the trainer
published, each rollout worker's latest posted and verified version, its latest comparison's outcome and its
lag, docs/weight_sync.md). They come to three states:

* ``stale``: a worker's latest compared fingerprints mismatched the trainer's, or it lags (two or more
  published versions behind its latest verified one, or one it posted nothing for past the collector's wait):
  the rollout sampled with other weights than the trainer's, whatever the mismatch's pattern looks like;
* ``verified``: every worker verified the latest published version;
* ``pending``: no worker is stale, but one has not verified the latest version yet (its set may still be on
  its way: the trainer can publish the next version before the reporter classifies this step); the classifier
  asks again at the next step, a few times, before it decides without;
* ``untracked``: nothing to go on (no collector, no weights published, no worker posts fingerprints, a set
  the collector could not verify, or the question failed): the mismatch's pattern alone decides, as before.

Asked only when a pattern is a candidate for an event (a few steps in a run); a failure is a warning (once) and
``untracked``, never an exception into the reporter.
"""

from __future__ import annotations

import json
import logging
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from nanwatch.hooks.report.transport import KeepAliveHttp

__all__ = ["SyncVerdict", "SyncVerdicts", "UNTRACKED", "verdict_of"]

log = logging.getLogger("nanwatch")

_TIMEOUT_S = 2.0  # the reporter thread waits at most this for an answer


@dataclass(frozen=True, slots=True)
class SyncVerdict:
    """The weight sync's state for a classification: ``state``, the version it speaks of (``None``: none),
    ``detail`` (a sentence for the event's evidence) and ``key`` (the same stale cause gives the same key, so it
    is reported once)."""

    state: Literal["verified", "stale", "pending", "untracked"]
    version: int | None = None
    detail: str = ""
    key: str = ""


UNTRACKED = SyncVerdict("untracked")


def verdict_of(view: Mapping[str, Any]) -> SyncVerdict:
    """The verdict of a ``GET /v1/runs/{run_id}/weights`` answer (module docstring)."""
    latest = view.get("latest_published")
    workers: Mapping[str, Mapping[str, Any]] = view.get("workers") or {}
    if latest is None:
        return SyncVerdict("untracked", detail="no weight version was published to verify against")
    if not workers:
        return SyncVerdict("untracked", latest, f"the trainer published weight version {latest}, but no rollout "
                           "worker posted fingerprints, so the rollout's weights are unverified")
    for name, w in sorted(workers.items()):
        if w.get("outcome") == "mismatch":
            return SyncVerdict("stale", latest, f"rollout worker {name}'s weight fingerprints of version "
                               f"{w.get('latest_posted')} differ from the trainer's", key=f"mismatch:{name}")
    for name, w in sorted(workers.items()):
        if w.get("lag", 0) > 0:
            verified = w.get("latest_verified")
            since = "none verified yet" if verified is None else f"its latest verified is version {verified}"
            return SyncVerdict("stale", latest, f"rollout worker {name} is {w['lag']} weight version(s) behind the "
                               f"trainer's latest ({latest}; {since}, its latest posted {w.get('latest_posted')})",
                               key=f"lag:{name}")
    for name, w in sorted(workers.items()):
        if w.get("outcome") == "unverifiable":
            return SyncVerdict("untracked", latest, f"rollout worker {name}'s weights could not be verified (a dtype "
                               "or shape no published cast explains)")
    behind = sorted(k for k, w in workers.items() if w.get("latest_verified") is None or w["latest_verified"] < latest)
    if behind:
        return SyncVerdict("pending", latest, f"rollout worker {behind[0]} has not verified weight version {latest} "
                           f"yet ({len(behind)} of {len(workers)} workers)")
    return SyncVerdict("verified", latest, f"weights verified: every rollout worker ({len(workers)}) loaded version "
                       f"{latest} as the trainer published it")


class SyncVerdicts:
    """Asks the collector (``url``) for the run's weight-sync verdict. Reporter thread only.

    Example usage::

        verdicts = SyncVerdicts("http://collector:8000", "grpo-0412", token=None)
        verdicts().state                      # "verified", "stale" or "untracked"
    """

    def __init__(self, url: str, run_id: str, *, token: str | None) -> None:
        self._http = KeepAliveHttp(url, token, _TIMEOUT_S)
        self._path = f"/v1/runs/{urllib.parse.quote(run_id, safe='')}/weights"
        self._warned = False

    def __call__(self) -> SyncVerdict:
        try:
            status, body, _ = self._http.request("GET", self._path)
            if status == 404:
                return UNTRACKED  # the run posted no weight set
            if status != 200:
                raise OSError(f"HTTP {status}: {body[:200]!r}")
            return verdict_of(json.loads(body))
        except Exception as exc:
            if not self._warned:
                self._warned = True
                log.warning("nanwatch: could not ask the collector for the weight sync's verdicts (%s: %s): the "
                            "rollout mismatch is classified by its pattern alone", type(exc).__name__, exc)
            return UNTRACKED

    def close(self) -> None:
        self._http.close()
