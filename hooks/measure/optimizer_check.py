"""The optimizer check: after an optimizer's step, the parameters it just wrote are read once, on the
device, so that a non-finite value born in the update itself is named at the step it happened.

Why (#17): a pure-fp16 AdamW underflows ``eps`` (1e-8 rounds to 0 in fp16), so where ``exp_avg_sq``
underflows too the update is 0/0 or x/0, and ``optimizer.step()`` writes NaN/Inf into the parameters at
step 0 (measured: all 25 parameters of the tiny Qwen3, on CPU). The forward and backward of that step were
finite, so nothing named it; from step 1 on every site was NaN and the rotating parameter check named a
different parameter each step. A weight guard cannot help (it decides before the update).

When: after every step on the CPU, where it is cheap; on an accelerator after the first step and then one in
``MonitorConfig.weights.optimizer_check_every`` (16), because there it reads every weight, the model's size in bytes
a step (16.4 GB at 8B in bf16). A value an unchecked update writes is not missed: every localising site is
read every step, so the next forward sees the weight at its first use, at the module holding it; the weight
guard skips that step, and the differential rerun reads every parameter once and names the one written
(class ``optimizer``, kind ``param``: ``nanwatch.hooks.forensics.incident_tensors``). :attr:`OptimizerCheck.unread`
tells the rerun that an update ran since the last check.

How: a step post-hook on the optimizer (``Optimizer.register_step_post_hook``: it runs after the real
update, and not at all when the weight guard or a GradScaler skipped the call) takes the parameters that
had a gradient (the ones a ``torch.optim`` optimizer updates) and computes their largest |x| per (device,
dtype): ``torch._foreach_norm(params, ord=inf)``, one multi-tensor kernel on CUDA, or on the CPU one
``aminmax`` each (14x cheaper there, :func:`_largest_abs`); one read of each parameter; the largest
magnitude of a parameter is NaN or Inf exactly when the parameter holds one. The per-parameter values stay
on the device as a :class:`ParamBatch` of the step (no host sync); the report decodes them on the reporter
thread, and only the non-finite ones become sites (kind ``param``, phase ``optimizer``; the first
:data:`MAX_NAMED` in the model's parameter order, the rest counted). Execution order puts the batch where it
was recorded, after the step's forward and backward, so a step whose forward was already non-finite keeps
its forward site as the first offender.

The same values describe the weights the next step starts from: at the next step start they are recorded
again (phase ``forward``, as the rotating parameter check records), so every later step names a non-finite
parameter first, not the attention layer it poisons (no precision remedy is offered for that). A
parameter changed in place since (a checkpoint reload bumps its ``_version``) makes the carried values
stale: they are then dropped.

What is said about it (:class:`NonfiniteParams`, reporter thread): a parameter is told once per *episode*
(from the first optimizer check that finds it non-finite until a check finds it finite again, e.g. after a
restore), in the training log only, and the words say what happened: written by this update ("non-finite
after AdamW.step(): the update wrote it"), or already non-finite before a step that was skipped (the
weight guard's or a GradScaler's: a fused kernel skipped the update but the check still ran), with the step
it first went non-finite when nanwatch saw it ("since step 3, written by SGD.step()", "first seen
non-finite at step 5").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from nanwatch.hooks.failsafe import contained
from nanwatch.hooks.measure.recorder import ParamBatch
from nanwatch.wire import Incident, dtype_name

__all__ = ["MAX_NAMED", "BatchSeen", "NonfiniteParams", "OptimizerCheck", "optimizer_incident",
           "read_batch"]

def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (as ``nanwatch.hooks.instrument.probes.local_shard``; not imported from there:
    ``instrument`` sits above ``measure``)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _largest_abs(group: list[torch.Tensor]) -> torch.Tensor:
    """The largest |x| of each tensor of ``group`` (one device and dtype), NaN where it holds a NaN, stacked:
    ``_foreach_norm(ord=inf)`` (one fused kernel) on an accelerator; on the CPU one ``aminmax`` each, which
    measured 14x cheaper there (0.61 against 8.4 ms a step for a 5.2M-parameter bf16 tiny Qwen3's 47 tensors,
    2-core AMD EPYC, torch 2.13: the foreach norm was 4 % of that model's step)."""
    zero = group[0].new_zeros(())  # an empty parameter holds nothing non-finite (neither op takes one)
    if group[0].device.type == "cpu":
        low, high = zip(*(torch.aminmax(t) if t.numel() else (zero, zero) for t in group), strict=True)
        return torch.maximum(torch.stack(high), -torch.stack(low))
    full = [t for t in group if t.numel()]
    norms = iter(torch._foreach_norm(full, ord=math.inf) if full else ())
    return torch.stack([next(norms) if t.numel() else zero for t in group])


#: Non-finite parameters of one batch named as sites in a report (the rest are counted).
MAX_NAMED = 16


@dataclass(frozen=True, slots=True)
class BatchSeen:
    """A decoded batch: which parameters were non-finite."""

    batch: ParamBatch
    bad: list[tuple[int, bool]]
    """(index in the batch, is NaN) of each non-finite parameter, in the batch's (model) order."""


def read_batch(batch: ParamBatch, values: list[float]) -> BatchSeen:
    """The non-finite parameters of ``batch`` in ``values``, its host copy (reporter thread)."""
    bad = [(i, v != v) for i, v in enumerate(values) if not math.isfinite(v)]
    return BatchSeen(batch, bad)


def optimizer_incident(seen: BatchSeen, *, step: int) -> Incident:
    """The incident of a value born in the optimizer update: no rerun can add to it (the forward and
    backward were finite), and no precision switch helps."""
    b = seen.batch
    first = b.names[seen.bad[0][0]]
    n = len(seen.bad)
    return Incident(
        cls="optimizer", step=step, site=first, phase="optimizer", birth=first, birth_kind="param",
        birth_params={b.names[i][-64:]: 1 for i, _ in seen.bad[:64]},
        note=(f"born in the optimizer update ({b.owner}) at step {step}: {n} parameter{'s' if n != 1 else ''} "
              f"non-finite after step(), forward and backward finite; no precision switch helps (check eps "
              "and the learning rate for the parameters' dtype, and restore the weights)"))


def _parameters(n: int) -> str:
    return f"{n} parameter{'s' if n != 1 else ''}"


class NonfiniteParams:
    """Which parameters are non-finite, since when, and what the log was told: the optimizer checks' words
    (see the module docstring). Reporter thread only.

    Example usage::

        params = NonfiniteParams()
        for line in params.observe(stats.batches, stats.sites, step=5, skipped=True):
            log.warning("nanwatch: %s", line)    # once per episode
    """

    def __init__(self) -> None:
        self._since: dict[str, str] = {}  # parameter name -> since when it is non-finite, in words
        self._told: set[str] = set()  # parameters told in their current episode

    def observe(self, batches: Sequence[BatchSeen], sites: Sequence[Any], *, step: int, skipped: bool) -> list[str]:
        """The lines to tell for one step's decoded batches and sites (``skipped``: the step's update was
        skipped, by the weight guard or a GradScaler, so the parameters it checked were not written)."""
        for s in sites:  # a parameter seen non-finite (the rotating check, the carried values)
            if s.kind == "param" and s.phase != "optimizer" and (s.nan or s.inf):
                self._since.setdefault(s.site, f"first seen non-finite at step {step}")
        lines = []
        for seen in batches:
            b = seen.batch
            bad = [b.names[i] for i, _ in seen.bad]
            for name in set(b.names).difference(bad):  # finite again: the episode is over
                self._since.pop(name, None)
                self._told.discard(name)
            if b.phase == "optimizer":
                new = [n for n in bad if n not in self._told]
                if new:
                    lines.append(self._words(b, new, step=step, skipped=skipped, total=len(bad)))
                    self._told.update(new)
            for name in bad:
                self._since.setdefault(name, f"first seen non-finite at step {step}" if skipped or b.phase != "optimizer"
                                       else f"since step {step}, written by {b.owner}.step()")
        return lines

    def _words(self, b: ParamBatch, new: list[str], *, step: int, skipped: bool, total: int) -> str:
        more = f" (the first {MAX_NAMED} are sites)" if total > MAX_NAMED else ""
        before = [n for n in new if n in self._since]

        def named(names: list[str]) -> str:
            head = ", ".join(f"{n} ({self._since.get(n, f'first seen non-finite at step {step}')})" for n in names[:3])
            return head + (f" and {len(names) - 3} more" if len(names) > 3 else "")

        if skipped:
            return (f"step {step}: {_parameters(len(new))} already non-finite before {b.owner}.step(), which was "
                    f"skipped (it wrote nothing): {named(new)}{more}; restore the weights")
        written = [n for n in new if n not in before]
        parts = []
        if written:
            it = "it" if len(written) == 1 else "them"
            parts.append(f"step {step}: {_parameters(len(written))} non-finite after {b.owner}.step(){more}: the "
                         f"update wrote {it} ({', '.join(written[:3])}{' ...' if len(written) > 3 else ''})")
        if before:
            parts.append(f"{'' if written else f'step {step}: '}{_parameters(len(before))} non-finite before "
                         f"{b.owner}.step() and after it: {named(before)}")
        return "; ".join(parts)


class _Records(Protocol):
    """What the check writes into: ``nanwatch.hooks.measure.recorder.Recorder`` (not imported: it imports this
    module for the batch types)."""

    def param_batch(self, batch: ParamBatch) -> None: ...


class OptimizerCheck:
    """One optimizer's post-step check (see the module docstring); ``remove()`` takes it off.

    ``every``: check after one step in this many, the first included (``MonitorConfig.weights.optimizer_check_every``);
    :attr:`unread` says whether an update ran since the last check.

    Example usage::

        check = OptimizerCheck(opt, rec=rec, names={id(p): n for n, p in model.named_parameters()}, every=16)
        ...                      # every opt.step() records a ParamBatch into the open step
        check.carry()            # at the next step start
        check.remove()
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, rec: _Records, names: dict[int, str],
                 every: int = 1) -> None:
        self.optimizer = optimizer
        self._rec = rec
        self._names = names
        self._owner = type(optimizer).__name__
        self._every = every
        self._steps = 0  # the optimizer's steps seen (post-hook calls)
        #: an update ran after the last read of the parameters (``every`` > 1): what it wrote is unread
        self.unread = False
        self._last: tuple[ParamBatch, list[torch.Tensor], list[int]] | None = None
        #: the parameters of the last check, by id, and what is derived from them alone (their grouping by
        #: device and dtype, names, dtypes, sizes): the same every step unless the set of updated ones changes
        self._layout: tuple[tuple[int, ...], list[list[torch.Tensor]], dict[str, list]] | None = None
        self._handle = optimizer.register_step_post_hook(self._after_step)

    def _after_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if torch.compiler.is_compiling():
            return
        due = self._steps % self._every == 0  # the first step, then one in ``every``
        self._steps += 1
        self.unread = not due  # a fused optimizer's skipped step counts too: conservative, never a wrong class
        if due:
            contained(self._check)

    def _check(self) -> None:
        """Device ops only: the largest |x| of each updated parameter (:func:`_largest_abs`), per (device, dtype)."""
        params = [p for g in self.optimizer.param_groups for p in g["params"]
                  if p.grad is not None and p.is_floating_point()]
        if not params:
            return
        groups, meta = self._layout_of(params)
        parts = [_largest_abs([_local(p).detach() for p in group]) for group in groups]
        batch = ParamBatch(
            pos=0, phase="optimizer", owner=self._owner, names=meta["names"], dtypes=meta["dtypes"],
            numels=meta["numels"],
            values=parts[0] if len(parts) == 1 else torch.cat([x.float().to(parts[0].device) for x in parts]))
        self._rec.param_batch(batch)
        ordered = meta["ordered"]
        self._last = (batch, ordered, [p._version for p in ordered])

    def _layout_of(self, params: list[torch.Tensor]) -> tuple[list[list[torch.Tensor]], dict[str, list]]:
        """``params`` grouped by (device, dtype), and their names, dtypes and sizes in that order: computed
        once per set of updated parameters, not every step."""
        key = tuple(id(p) for p in params)
        if self._layout is None or self._layout[0] != key:
            by: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
            for p in params:
                by.setdefault((p.device, p.dtype), []).append(p)
            groups = list(by.values())
            ordered = [p for group in groups for p in group]
            meta = {"names": [self._names.get(id(p)) or f"{self._owner}.param{i}" for i, p in enumerate(ordered)],
                    "dtypes": [dtype_name(p.dtype) for p in ordered], "numels": [p.numel() for p in ordered],
                    "ordered": ordered}
            self._layout = (key, groups, meta)
        return self._layout[1], self._layout[2]

    def carry(self) -> None:
        """Step start: the last check's values, as the weights this step starts from; kept while the
        parameters are unchanged (a skipped step writes nothing), dropped once one was written since."""
        if self._last is None:
            return
        batch, params, versions = self._last
        if all(p._version == v for p, v in zip(params, versions, strict=True)):
            self._rec.param_batch(dataclasses.replace(batch, phase="forward"))
        else:
            self._last = None

    def remove(self) -> None:
        self._handle.remove()
        self._last = None
