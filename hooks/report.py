"""Report assembly, on the reporter thread: a step's host-side record plus its decoded device values become
one :class:`~nanwatch.wire.StepReport`, with the warnings a user must see (cross-document leak, no
attention measured) attached and told once."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from nanwatch.hooks.failsafe import WarnOnce
from nanwatch.hooks.recorder import Recorder, StepState
from nanwatch.hooks.reporter import Pending
from nanwatch.hooks.rlhf import decode_rlhf
from nanwatch.wire import StepReport

__all__ = ["ReportBuilder", "StepContext"]


@dataclass(frozen=True, slots=True)
class StepContext:
    """What the training thread knew at step end, handed to the reporter thread with the copy."""

    state: StepState
    mode: str
    directive_version: int
    time: float


class ReportBuilder:
    """Builds the StepReports of one Monitor (one rank, one incarnation)."""

    def __init__(self, *, run_id: str, rank: int, world_size: int, incarnation: str, rec: Recorder,
                 model: Callable[[], torch.nn.Module | None], warn: WarnOnce,
                 dropped_reports: Callable[[], int]) -> None:
        self._ids = dict(run_id=run_id, rank=rank, world_size=world_size, incarnation=incarnation)
        self._rec = rec
        self._model = model
        self._warn = warn
        self._dropped = dropped_reports

    def build(self, pending: Pending, values: list[float]) -> StepReport:
        ctx: StepContext = pending.context
        state = ctx.state
        sites, sdpa, logits, prints, first = self._rec.decode(state, values)
        warns = list(state.warnings)
        for f in prints:
            if f.cross_doc_leak:
                warns.append(f"forward {f.forward}: packed sequences (position_ids restart) ran with plain "
                             "causal attention: documents attend across boundaries (HF builds a cache when "
                             "use_cache is left True in training; pass use_cache=False)")
        if state.forwards and not state.sdpa and not any(s.kind == "attention" for s in sites):
            if self._compiled():
                warns.append("no attention was measured in this step: it ran inside torch.compile'd code, "
                             "where nanwatch's eager probes are off (see README, 'torch.compile')")
            else:
                warns.append("no attention ran in this step: check is_attention= and that the model calls "
                             "torch.nn.functional.scaled_dot_product_attention at call time")
        for w in warns:
            self._warn(w)
        return StepReport(
            **self._ids, seq=pending.seq, step=pending.step, time=ctx.time,
            sites=sites, sdpa=sdpa, logits=logits, fingerprints=prints,
            rlhf=decode_rlhf(self._rec.getter(values)) if state.rlhf else None,
            attention_mode=ctx.mode, directive_version=ctx.directive_version,
            first_offender=first[0] if first else None, first_offender_phase=first[1] if first else None,
            dropped_reports=self._dropped(), warnings=warns[:64])

    def _compiled(self) -> bool:
        """Whether compiled code may have run the attention: a submodule compiled in place
        (``module.compile()``), or any graph compiled by dynamo in this process (``torch.compile(model)``
        wraps the model, so the module itself carries no mark)."""
        model = self._model()
        if model is not None and any(getattr(m, "_compiled_call_impl", None) is not None
                                     for m in model.modules()):
            return True
        from torch._dynamo.utils import counters

        return counters["stats"]["unique_graphs"] > 0
