"""Weight syncs, verified: post one side's weight fingerprints of a weight version to the collector, which
compares the trainer's with each rollout worker's (docs/weight_sync.md).

Standard library and the wire schema alone: a rollout worker (vLLM, SGLang, a plain ``generate`` process)
needs no torch.distributed and none of nanwatch's trainer side to post; it computes its fingerprints with
``nanwatch.fingerprint`` on the weights it loaded (or any code that follows its documented formula).

Example usage (the rollout worker, after it loaded weight version 12)::

    from nanwatch.weight_sync import post_weights
    post_weights("http://collector:8000", "grpo-0412", 12, nanwatch.fingerprint(llm_model), worker="vllm-3")

The trainer posts its own with ``Monitor.publish_weights(12)`` (``side="trainer"``, with its weights as cast
to the rollout dtypes and its incarnation). Whichever side arrives second makes the collector compare: equal
sets count ``nanwatch_weight_syncs_verified_total``; any difference counts
``nanwatch_weight_sync_mismatches_total`` and logs an event naming the version, the worker and the first
differing tensors, and ``NanwatchWeightSyncMismatch`` pages. ``nanwatch.fingerprint``'s answer carries each
tensor's dtype and shape, sent along, so that a bf16 copy is compared with the trainer's bf16 cast, and a
dtype or shape no cast explains is named as such (``nanwatch_weight_syncs_unverifiable_total``).
"""

from __future__ import annotations

import http.client
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from nanwatch.addresses import check_collector_url, collector_urls, pick_collector
from nanwatch.tokens import token_from_env
from nanwatch.wire import MAX_INT, RUN_ID_PATTERN, WeightFingerprints

__all__ = ["WeightSyncRefused", "post_weights", "weights_path"]

#: the most of the collector's answer read (it names a few tensors per compared worker)
_MAX_ANSWER = 1 << 20


class WeightSyncRefused(RuntimeError):
    """The collector answered with an error status (``status``; the message holds its detail)."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(f"the collector refused the weight fingerprints ({status}): {detail}")
        self.status = status


def weights_path(run_id: str, version: int) -> str:
    """The endpoint of one weight version of a run."""
    return f"/v1/runs/{run_id}/weights/{version}"


def post_weights(collector: str | Sequence[str], run_id: str, version: int, fingerprints: Mapping[str, str], *,
                 side: Literal["trainer", "rollout"] = "rollout", worker: str = "0", token: str | None = None,
                 timeout_s: float = 10.0, casts: Mapping[str, Mapping[str, str]] | None = None,
                 incarnation: str | None = None) -> dict[str, Any]:
    """Send one side's weight fingerprints of weight ``version`` (``PUT /v1/runs/{run_id}/weights/{version}``)
    and return the collector's answer: ``{"version", "side", "worker", "compared": [{"worker", "verified",
    "differing", "missing", "extra"}...]}`` (a rollout worker's comparison, or every waiting worker's when the
    trainer's set arrives second). ``collector``: a URL, or the shard list a trainer was given (the run's
    shard is picked as the trainer picks it). ``token``: an ingest token, else ``NANWATCH_TOKEN`` (or its
    ``_FILE``). Raises ``ValueError`` for a bad argument, ``WeightSyncRefused`` for a 4xx/5xx answer and
    ``OSError`` when the collector cannot be reached within ``timeout_s``. The dtypes and shapes ride along
    when ``fingerprints`` carries them (``nanwatch.fingerprint``'s answer does: attributes ``dtypes`` and
    ``shapes``); ``casts`` and ``incarnation`` are the trainer's (``Monitor.publish_weights`` sends them; a
    trainer set without the run's incarnation is refused, 409)."""
    if not isinstance(run_id, str) or not re.fullmatch(RUN_ID_PATTERN, run_id):
        raise ValueError(f"run_id {run_id!r} is not valid: use 1-128 of letters, digits and ._:@+=-")
    if isinstance(version, bool) or not isinstance(version, int) or not 0 <= version <= MAX_INT:
        raise ValueError(f"version must be an integer in [0, {MAX_INT}], got {version!r}")
    dtypes, shapes = getattr(fingerprints, "dtypes", None), getattr(fingerprints, "shapes", None)
    body = WeightFingerprints(
        side=side, worker=worker, fingerprints=dict(fingerprints), dtypes=dict(dtypes) if dtypes else None,
        shapes=dict(shapes) if shapes else None, casts={k: dict(v) for k, v in casts.items()} if casts else None,
        incarnation=incarnation).model_dump_json(exclude_none=True).encode()
    url = check_collector_url(pick_collector(collector_urls(collector), run_id))
    token = token if token is not None else token_from_env("NANWATCH_TOKEN")
    headers = {"Content-Type": "application/json", "Accept": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    cls = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
    conn = cls(url.hostname, url.port, timeout=timeout_s)
    try:
        conn.request("PUT", url.path.rstrip("/") + weights_path(run_id, version), body=body, headers=headers)
        resp = conn.getresponse()
        data = resp.read(_MAX_ANSWER)
    finally:
        conn.close()
    if resp.status >= 400:
        raise WeightSyncRefused(resp.status, data[:2000].decode("utf-8", "replace"))
    return json.loads(data)
