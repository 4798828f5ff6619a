"""The rollout logprobs of a plain HF ``generate()``: what ``Monitor.rlhf(rollout_logprobs=...)`` wants, read
from the output of ``model.generate(..., output_scores=True, return_dict_in_generate=True)`` (and
``output_logits=True`` for the raw distribution). Imports only torch: the output is read by its attributes
(``sequences``, ``scores``, ``logits``), so transformers is not needed here.

Two sets, each ``[B, C]`` for the last ``C`` tokens of ``sequences`` (the generated ones, TRL's completion
convention; ``C = len(output.scores)``):

* ``processed``: log_softmax of ``scores``, the distribution the sampler drew from, after every logits
  processor (temperature, top-k, top-p, repetition penalty...): a token filtered out there is ``-inf``. This
  is the one to pass as ``rollout_logprobs``: it is what the rollout actually sampled from, and what
  importance sampling corrects for.
* ``raw``: log_softmax of ``logits`` (the model's own, before any processor), when the output has them: what
  a trainer that applies none of the processors computes for the same tokens. ``processed - raw`` is the
  sampler's part of the mismatch; left in, nanwatch classifies it as an *offset*.

``mask`` is 1 up to and including the first EOS (TRL's completion mask), and 0 from the first pad token on
when the pad is not an EOS (HF fills a finished sequence with pad). Positions outside the mask hold 0.0 in
both sets, as TRL pads its sampling logprobs: what a finished sequence "drew" after its end is not a rollout
logprob. Everything stays on the device; nothing is read on the host.

Example usage::

    out = model.generate(**batch, do_sample=True, temperature=0.7, max_new_tokens=64,
                         output_scores=True, output_logits=True, return_dict_in_generate=True)
    lp = nanwatch.hooks.rollout_logprobs(out, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    ...
    monitor.rlhf(logprobs=trainer_logprobs, rollout_logprobs=lp.processed, mask=lp.mask, ...)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

__all__ = ["GeneratedLogprobs", "rollout_logprobs"]


class GeneratedLogprobs(NamedTuple):
    """Per-token logprobs of the generated tokens, each ``[B, C]`` (float32) and aligned with
    ``completion_ids`` (the last ``C`` tokens of the sequences)."""

    processed: torch.Tensor  #: under the sampler's distribution (``scores``): pass this as ``rollout_logprobs``
    raw: torch.Tensor | None  #: under the model's own distribution (``logits``); None without ``output_logits``
    mask: torch.Tensor  #: 1 for the completion's tokens (through the first EOS), 0 after (long, as TRL's)
    completion_ids: torch.Tensor  #: the generated tokens, ``[B, C]``


def _token_logprobs(steps: Sequence[torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    """log_softmax of each step's ``[B, V]`` scores, at that step's token; one step at a time, so that no
    ``[B, C, V]`` tensor is ever built."""
    out = [torch.log_softmax(s.float(), dim=-1).gather(-1, tokens[:, i:i + 1].to(s.device))
           for i, s in enumerate(steps)]
    return torch.cat(out, dim=1)


def _ids(value: int | Sequence[int] | None) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def completion_mask(completion_ids: torch.Tensor, eos_token_id: int | Sequence[int] | None = None,
                    pad_token_id: int | None = None) -> torch.Tensor:
    """1 through the first EOS (inclusive, as TRL masks), 0 after it and from the first pad token on (a pad
    that is not an EOS was never generated); all ones when neither id is given."""
    b, c = completion_ids.shape
    index = torch.arange(c, device=completion_ids.device).expand(b, c)
    end = torch.full((b, 1), c, device=completion_ids.device)  # the first position past the completion
    eos = _ids(eos_token_id)
    if eos:
        is_eos = torch.isin(completion_ids, torch.tensor(eos, device=completion_ids.device))
        end = torch.where(is_eos, index + 1, c).amin(dim=1, keepdim=True)
    if pad_token_id is not None and int(pad_token_id) not in eos:
        end = end.minimum(torch.where(completion_ids == int(pad_token_id), index, c).amin(dim=1, keepdim=True))
    return (index < end).long()


def rollout_logprobs(output: Any, sequences: torch.Tensor | None = None, *,
                     eos_token_id: int | Sequence[int] | None = None,
                     pad_token_id: int | None = None) -> GeneratedLogprobs:
    """The generated tokens' logprobs from ``generate(..., output_scores=True, return_dict_in_generate=True)``.

    ``output``: what ``generate`` returned (anything with ``scores`` and, unless ``sequences`` is given,
    ``sequences``; ``logits`` when ``output_logits=True``). ``sequences``: the prompt+completion ids, if not
    ``output.sequences`` (its last ``len(output.scores)`` columns are the completion). ``eos_token_id`` (one
    id or several) and ``pad_token_id`` build the completion mask; pass the tokenizer's (or the
    generation config's). See the module docstring for which set to pass as ``rollout_logprobs``."""
    scores = getattr(output, "scores", None)
    if not scores:
        raise ValueError("rollout_logprobs needs generate(..., output_scores=True, return_dict_in_generate=True)")
    seqs = output.sequences if sequences is None else sequences
    completion = seqs[:, -len(scores):]
    mask = completion_mask(completion, eos_token_id, pad_token_id)
    processed = _token_logprobs(scores, completion).masked_fill(mask == 0, 0.0)
    logits = getattr(output, "logits", None)
    raw = _token_logprobs(logits, completion).masked_fill(mask == 0, 0.0) if logits else None
    return GeneratedLogprobs(processed, raw, mask, completion)
