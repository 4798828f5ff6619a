"""TRL's ``GRPOTrainer`` and ``RLOOTrainer``: logprob, ratio and KL health without a subclass.

TRL offers no public hook that sees the per-token tensors (callbacks get no tensors; ``compute_loss_func``
is not used by GRPO), so this adapter wraps two methods on the trainer *instance*, and checks first that
they still are what it was written against (TRL 1.14-1.16). If they changed, it warns loudly and does
nothing: monitoring never breaks training, and a silent wrong figure would be worse than none.

* ``_get_per_token_logps_and_entropies``: its call with ``compute_entropy=True`` is the loss's own
  forward, whose log-probabilities (with grad) are kept for the step;
* ``_compute_loss(model, inputs)``: after it, ``inputs`` holds ``completion_mask``, the per-sequence
  ``advantages``, and, when TRL computed them, ``old_per_token_logps`` (``num_iterations > 1``) and
  ``ref_per_token_logps`` (``beta > 0``). They go to ``Monitor.rlhf``.

In vLLM mode (``use_vllm=True``) ``inputs`` also holds ``sampling_per_token_logps``, vLLM's own logprobs of
the tokens it sampled: they go to ``Monitor.rlhf`` as ``rollout_logprobs`` (the rollout mismatch), with
``rollout_cap`` = TRL's ``vllm_importance_sampling_clip_max`` and the sequences (``input_ids``: prompt then
completion, ``attention_mask``) for attribution. Tested by feeding the ``inputs`` TRL builds through TRL's
own loss path; vLLM itself was not run (it does not run on the CPU).

The KL is labelled as TRL optimises it: k3 = exp(ref - logp) - (ref - logp) - 1, multiplied by the
importance ratio when ``use_bias_correction_kl`` is on (TRL's default), reported as ``kl_k3_ratio_mean``
next to nanwatch's unweighted k1/k3.

``RLOOTrainer`` (TRL 1.x: the same two methods, the same signatures) hands its loss the per-*sequence*
``old_logps`` and ``advantages``, and puts its KL into the reward, not the loss: its reports carry logprob
and advantage health and the non-finite counts; no per-token ratio, clip fraction or KL figure (there is no
per-token tensor of them to read, and a figure made up here would not be the one TRL optimises).
Subclasses of either are covered (``isinstance``); any other TRL trainer gets a loud warning naming it.

TRL's fused LM head never materialises logits (``lm_head.forward`` does not run in the training forward):
the Monitor measures the fused head's ``log_probs`` in their place and says so in the report.
"""

from __future__ import annotations

import inspect
import logging
import threading
import warnings
from typing import Any

import torch

from nanwatch.hooks.facade import Monitor

__all__ = ["COVERED", "SUPPORTED", "instrument"]

log = logging.getLogger("nanwatch")

#: The TRL trainers (and their subclasses) whose loss the adapter reads
COVERED = ("GRPOTrainer", "RLOOTrainer")
#: TRL releases this adapter was written and tested against (the methods it wraps are private)
SUPPORTED = ((1, 14), (1, 16))
_SIGNATURES = {
    "_compute_loss": ("model", "inputs"),
    "_get_per_token_logps_and_entropies": ("model", "input_ids", "attention_mask", "logits_to_keep"),
}


def _fail(reason: str) -> None:
    msg = (f"nanwatch: the TRL adapter is off: {reason}. Logprob, ratio and KL health will be missing "
           "from the reports; attention, logits and gradients are still measured.")
    log.error(msg)
    warnings.warn(msg, RuntimeWarning, stacklevel=3)


def _version(v: str) -> tuple[int, int]:
    parts = v.split(".")
    return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)


def _kl_in_loss(trainer: Any) -> bool:
    """GRPO puts its KL into the loss; RLOO into the reward (the loss has no KL term to label)."""
    import trl

    return isinstance(trainer, trl.GRPOTrainer)


def _rollout_cap(trainer: Any) -> float | None:
    """TRL's own importance-sampling cap (``vllm_importance_sampling_clip_max``, 3.0 by default), so that
    nanwatch's truncated fraction counts what TRL truncates or masks; None (the MonitorConfig's) otherwise."""
    cap = getattr(trainer.args, "vllm_importance_sampling_clip_max", None)
    return float(cap) if isinstance(cap, (int, float)) and cap > 1 else None


def _rollout(inputs: dict[str, Any], cap: float | None) -> dict[str, Any]:
    """The rollout's logprobs when TRL has them (vLLM mode's ``sampling_per_token_logps``, NaN where vLLM
    could not score a token: counted by the Monitor, not replaced), with the sequences as the loss's forward
    saw them (prompt then completion, TRL's concatenation) so that attribution can re-run them; nothing
    otherwise."""
    sampling = inputs.get("sampling_per_token_logps")
    if sampling is None:
        return {}
    return dict(rollout_logprobs=sampling, rollout_cap=cap,
                input_ids=torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1),
                attention_mask=torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1))


class _Instrumented:
    def __init__(self, trainer: Any, monitor: Monitor) -> None:
        self._trainer = trainer
        local = threading.local()
        get_logps, compute_loss = trainer._get_per_token_logps_and_entropies, trainer._compute_loss
        beta = float(getattr(trainer, "beta", 0.0) or 0.0)
        bias_corrected = bool(getattr(trainer.args, "use_bias_correction_kl", False))
        kl = None if beta == 0.0 or not _kl_in_loss(trainer) else ("k3_ratio" if bias_corrected else "k3")
        cap = _rollout_cap(trainer)

        def logps(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
            out = get_logps(model, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
            if kwargs.get("compute_entropy"):  # only the loss's own forward asks for the entropy
                local.logps = out[0]
            return out

        def loss(model, inputs):
            local.logps = None
            value = compute_loss(model, inputs)
            lp = local.logps
            if lp is not None:
                mask = inputs.get("completion_mask")
                if mask is not None and inputs.get("tool_mask") is not None:
                    mask = mask * inputs["tool_mask"]
                monitor.rlhf(logprobs=lp, old_logprobs=inputs.get("old_per_token_logps"),
                             ref_logprobs=inputs.get("ref_per_token_logps"), advantages=inputs.get("advantages"),
                             mask=mask, kl_optimised=kl, **_rollout(inputs, cap))
            return value

        trainer._get_per_token_logps_and_entropies = logps
        trainer._compute_loss = loss

    def remove(self) -> None:
        for name in _SIGNATURES:
            self._trainer.__dict__.pop(name, None)


def _covered() -> tuple[type, ...]:
    """The TRL trainer classes the adapter covers, as this TRL has them."""
    import trl

    return tuple(c for c in (getattr(trl, name, None) for name in COVERED) if isinstance(c, type))


def instrument(trainer: Any, monitor: Monitor) -> _Instrumented | None:
    """Wrap a TRL ``GRPOTrainer`` or ``RLOOTrainer`` instance, or a subclass's (other TRL trainers are left
    alone, loudly). Returns a handle whose ``remove()`` undoes it, or None (with a loud warning) when this
    TRL is not one the adapter knows."""
    try:
        import trl
    except ImportError:
        return None
    covered = _covered()
    if not isinstance(trainer, covered):  # a subclass is one (most users subclass)
        trl_base = next((c for c in type(trainer).__mro__ if c.__module__.startswith("trl.")), None)
        if trl_base is not None:  # PPO, DPO, SFT...: their per-token tensors are not where GRPO's are
            _fail(f"{type(trainer).__name__} is TRL's {trl_base.__name__}, and the adapter covers "
                  f"{' and '.join(COVERED)} and their subclasses only (call Monitor.rlhf(...) from your loss "
                  "for the same figures)")
        return None
    version = _version(trl.__version__)
    if not SUPPORTED[0] <= version <= SUPPORTED[1]:
        _fail(f"TRL {trl.__version__} is outside the tested {SUPPORTED[0]}..{SUPPORTED[1]}")
        return None
    for name, expected in _SIGNATURES.items():
        method = getattr(type(trainer), name, None)
        params = tuple(inspect.signature(method).parameters)[1:] if method is not None else ()
        if params[: len(expected)] != expected:
            base = next(c.__name__ for c in covered if isinstance(trainer, c))
            _fail(f"{base}.{name} is not ({', '.join(expected)}, ...) in TRL {trl.__version__}")
            return None
    return _Instrumented(trainer, monitor)
