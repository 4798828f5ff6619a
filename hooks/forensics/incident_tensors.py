"""The differential rerun's one read of every parameter and optimizer-state tensor, on the incident path
only: so that a tensor that was already non-finite when the step started is named, without a per-step read
of every weight.

Why here, not every step: every localising site (the embedding, each block, its norms and MLP, each
attention call, the logits, and the gradients into them) is read every step, so a non-finite weight is seen
at its next use, in the next forward, at the module that holds it (the first offender), and the weight guard
skips that step. What is left to say is which tensor, and how it got there: this read answers both, once per
run, instead of the optimizer check's read of every weight after every update (``optimizer_check_every``)
and the rotating sweep's share of every parameter and optimizer-state tensor at each step start
(``param_check_every``), which on an accelerator cost a read of every weight a step (16.4 GB at 8B in bf16)
and ~6 GB a step.

How it got there: when an optimizer update ran after the optimizer check last read the parameters (the
check is amortised on accelerators) and before the step whose forward found the weight non-finite, the
update wrote it: class ``optimizer``, the parameter the birth (kind ``param``), no precision switch helps.
Otherwise (the first step, or a check after every update) the parameter was non-finite before any update
nanwatch saw (a checkpoint, a hand-written value): the rerun goes on, and its drill-down names the module
with the parameter (``data_mask``). A non-finite optimizer-state tensor (an ``exp_avg``) is named in the
note: it reaches the weight at the next update.

Example usage::

    bad = read_tensors(model, optimizers)   # host reads: the incident path, once per run
    if bad.params and unread_updates:
        incident = Incident(cls="optimizer", step=5, **optimizer_birth(bad, step=5, phase="forward"))
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["NonfiniteTensors", "optimizer_birth", "read_tensors", "state_note"]

#: tensors named in an incident at most (``Incident.birth_params`` holds 64)
MAX_NAMED = 64


@dataclass(slots=True)
class NonfiniteTensors:
    """The non-finite parameters (FQN -> non-finite elements) and optimizer-state tensors
    (``optimizer.<param FQN>.<key>``), in the model's order."""

    params: dict[str, int] = field(default_factory=dict)
    state: list[str] = field(default_factory=list)


def _count(t: torch.Tensor) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: this rank's shard
    return int((~torch.isfinite(t.detach())).sum())  # sync-ok: the incident path, once per run


def read_tensors(model: torch.nn.Module, optimizers: list[torch.optim.Optimizer]) -> NonfiniteTensors:
    """Every floating parameter of ``model`` and every floating state tensor of ``optimizers``, read once
    (one host read each: the incident path, once per run)."""
    out = NonfiniteTensors()
    names = {}
    for name, p in model.named_parameters():
        names[id(p)] = name
        if p.is_floating_point() and (n := _count(p)):
            out.params[name] = n
    for opt in optimizers:
        for p, state in opt.state.items():
            for key, v in state.items():
                if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dim() > 0 and _count(v):
                    out.state.append(f"optimizer.{names.get(id(p), '?')}.{key}")
    return out


def _listed(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def state_note(bad: NonfiniteTensors) -> str:
    """The non-finite optimizer-state tensors, in words (they reach the weights at the next update)."""
    return f"optimizer state non-finite: {_listed(bad.state)} (it reaches the weights at the next update)"


def optimizer_birth(bad: NonfiniteTensors, *, step: int, phase: str | None) -> dict[str, Any]:
    """The fields of the incident of a parameter an optimizer update wrote non-finite (``bad.params`` not
    empty), found at the next forward that used it (the step's first offender, the module holding it)
    rather than right after the update: its note, its birth (the first such parameter, kind ``param``) and
    every non-finite parameter with its count."""
    names = list(bad.params)
    n = len(names)
    state = f"; {state_note(bad)}" if bad.state else ""
    note = (f"born in an optimizer update: {n} parameter{'s' if n != 1 else ''} non-finite ({_listed(names)}) "
            f"when step {step}'s {phase or 'forward'} used {'it' if n == 1 else 'them'}, written by an update "
            f"after the optimizer check last read the parameters{state}; no precision switch helps (check eps "
            "and the learning rate for the parameters' dtype, and restore the weights)")
    return {"note": note[:1000], "birth": names[0][-256:], "birth_kind": "param",
            "birth_params": {k[-64:]: v for k, v in list(bad.params.items())[:MAX_NAMED]}}
