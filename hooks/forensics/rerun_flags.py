"""The differential rerun's decision on an accelerator, without a host read in the step: each step's
non-finite flag travels to the host as the report's values do (``nanwatch.hooks.report.reporter``): one
asynchronous copy into pinned memory and a CUDA event, recorded at the step's end. The rerun decides later,
once the flag has landed, never waiting for it: at the next step start (``event.query()``, non-blocking) or,
if it has not landed by then, at the next optimizer pre-step, while the weights are still those the
faulting step saw (the weight guard skipped its update). Until then the step's kept forwards (by
reference), its record and its values (the device tensor the report's copy was made from, by reference)
are held: one step more, at most :data:`MAX_IN_FLIGHT`.

A flag that lands only after an optimizer update may have run since its step (a pre-step passed while it
was in flight) can no longer be re-run soundly: the weights may have moved. Its incident says
``not_classified`` and why, never a wrong class. A fused optimizer's skipped step counts as a possible
update (its kernels skip on the device; the host cannot tell without a read): conservative, never wrong.

On the CPU the flag is free to read, so the Monitor decides at the step's end (``DifferentialRerun``); the
deferred path runs there only when a test forces it (``DifferentialRerun.defer``), with the same result.

Example usage::

    flags = FlagsInFlight()
    flags.send(41, rec.nonfinite_flag(), kept=kept, weight_guard_on=True, unread_updates=False, mode="none")
    flags.handed_over(data, state)          # the step's values and record, as the report's copy took them
    ...                                     # step 42 starts
    flag = flags.first_set()                # the first landed flag that is set, or None (never waits)
    flags.update_may_run()                  # an optimizer pre-step: the flags still in flight go stale
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from nanwatch.hooks.measure.kept_forward import KeptForward
from nanwatch.hooks.measure.recorder import StepState

__all__ = ["MAX_IN_FLIGHT", "FlagsInFlight", "StepFlag", "landed"]

#: Flags held while in flight; an older one is given up (its step is never classified; counted in
#: ``FlagsInFlight.given_up``). A flag lands within a step or two unless the host runs far ahead.
MAX_IN_FLIGHT = 4


@dataclass(slots=True)
class StepFlag:
    """One step's non-finite flag on its way to the host, and what a rerun of that step needs."""

    step: int
    host: torch.Tensor
    """The flag's host copy (1 float32; pinned on CUDA): meaningful once :func:`landed`."""
    event: Any
    """The CUDA event recorded after the copy (None: the copy was synchronous, a CPU flag)."""
    kept: list[KeptForward]
    weight_guard_on: bool
    unread_updates: bool
    """An optimizer update ran after the optimizer check last read the parameters, before this step."""
    mode: str = "none"
    """The attention path the step ran (the directive in force): its rerun re-runs that path, whatever
    directive applies when it is decided (one asked for on its own report may apply first)."""
    data: torch.Tensor | None = None
    """The step's values on the device (``Recorder.flat()``, by reference) and its record: its decode."""
    state: StepState | None = None
    stale: str = ""
    """Why a rerun of this step is no longer sound ("" while it is)."""


def landed(flag: StepFlag) -> bool:
    """The flag's copy has landed: a non-blocking query of its event (the tests' seam)."""
    return flag.event is None or bool(flag.event.query())


class FlagsInFlight:
    """The flags sent and not yet decided, oldest first. Training thread."""

    def __init__(self, *, landed: Callable[[StepFlag], bool] = landed) -> None:
        self._flags: deque[StepFlag] = deque()
        self._pinned: list[torch.Tensor] = []  # host buffers free for reuse
        #: whether a flag has landed (a seam: a test makes one land late)
        self.landed = landed
        #: flags given up unlanded because more than :data:`MAX_IN_FLIGHT` were in flight
        self.given_up = 0

    def __len__(self) -> int:
        return len(self._flags)

    def send(self, step: int, flag: torch.Tensor, *, kept: list[KeptForward], weight_guard_on: bool,
             unread_updates: bool, mode: str = "none") -> None:
        """Step ``step`` ends: its flag (a 0-d device tensor) starts for the host (device ops only)."""
        cuda = flag.device.type == "cuda"
        if flag.device.type == "meta":  # a model without values (nanwatch bench kernels): counted, never decided
            host = torch.empty(1, dtype=torch.float32, device="meta")
        else:
            host = self._pinned.pop() if self._pinned else torch.empty(1, dtype=torch.float32, pin_memory=cuda)
        host.copy_(flag.reshape(1).to(torch.float32), non_blocking=flag.device.type != "cpu")
        event = None
        if cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(flag.device))
        if len(self._flags) >= MAX_IN_FLIGHT:
            self._flags.popleft()
            self.given_up += 1
        self._flags.append(StepFlag(step, host, event, kept, weight_guard_on, unread_updates, mode))

    def handed_over(self, data: torch.Tensor, state: StepState) -> None:
        """The last step sent was handed to the reporter: its values and record, kept by reference."""
        if self._flags and self._flags[-1].state is None:
            self._flags[-1].data, self._flags[-1].state = data, state

    def first_set(self) -> StepFlag | None:
        """The oldest landed flag that is set, or None; the landed clean ones before it are dropped. Stops at
        the first flag still in flight (steps are decided in order). Never waits."""
        while self._flags and self.landed(self._flags[0]):
            flag = self._flags.popleft()
            if flag.host.is_meta:
                continue
            self._pinned.append(flag.host)
            if flag.host.tolist()[0] != 0:  # sync-ok: a pinned host tensor whose copy's event has completed
                return flag
        return None

    def update_may_run(self, step: int | None) -> None:
        """An optimizer is about to update the weights (its pre-step, in step ``step``): every flag still in
        flight is from before it, and a rerun of its step would no longer see that step's weights."""
        for flag in self._flags:
            if not flag.stale:
                flag.stale = (f"step {flag.step}'s non-finite flag reached the host only after an optimizer update "
                              f"{'of step ' + str(step) + ' ' if step is not None else ''}may have moved the "
                              "weights (it is copied without a host read, and had not landed at that "
                              "optimizer's pre-step): a rerun would not be that step")

    def clear(self) -> None:
        """Decided (the run's first non-finite step): nothing more is held."""
        self._flags.clear()
