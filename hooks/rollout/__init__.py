"""Rollout agreement, in one room: does the rollout engine (vLLM, SGLang, an HF ``generate`` copy) score the
tokens the trainer scores, and does it hold the trainer's weights? A change to the feature is made here.

Its parts work at different stages of the step's one-way flow, and each imports only what its stage may
(``tests/test_architecture.py``, ``ROOM_STAGES``):

* measure: ``compare`` (Δlogp, k3, ratios, the histogram: rows of ``measure.rlhf``'s, on the device),
  ``generated`` (the rollout logprobs of a plain HF ``generate()``), ``weight_fingerprint`` (the exact,
  portable per-tensor fingerprint, ``nanwatch.fingerprint``; the replica check reads it too);
* forensics: ``attribution`` (which module's precision explains a drift, outside the step);
* report: ``mismatch`` (a step's figures classified: stale weights, jump, shift, drift, offset, outlier
  sequences), ``sync_verdict`` (what the weight sync says, asked of the collector before a classification)
  and ``weight_publish`` (``Monitor.publish_weights``: the trainer's set of a weight version, posted).

The rollout worker's side needs no torch and lives in the root package (``nanwatch.weight_sync``); the
collector's half in ``nanwatch.monitor``. This file imports nothing.
"""

__all__ = ["attribution", "compare", "generated", "mismatch", "sync_verdict", "weight_fingerprint", "weight_publish"]
