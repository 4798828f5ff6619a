"""What the differential rerun (``nanwatch.hooks.forensics.rerun``) needs of the probes, kept apart from the
measuring: each training forward's inputs, by reference, while a rerun could need them; and, while the rerun
re-runs a forward, whether each attention call stayed finite (nothing else is measured then).

Its flags change only through its own methods; the probes read them (``Probes.measuring``), the root hook
keeps the inputs (``ModuleHooks.root_pre``) and the SDPA wrapper notes the finite flags
(``nanwatch.hooks.instrument.sdpa_probe``). Training thread.

Example usage::

    tap = RerunTap()
    tap.keep_forward_inputs(True)          # an effective weight guard and rerun on
    ...                                    # the step's training forwards: tap.keep(args, kwargs)
    with tap.rerunning_forward() as finite:
        model(*tap.kept[0].args, **tap.kept[0].kwargs)
    stayed_finite = bool(torch.stack(finite).all())
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from nanwatch.hooks.measure.kept_forward import KeptForward, keep

__all__ = ["RerunTap"]


class RerunTap:
    """The kept forwards of the open step and the rerun's pass through the model."""

    def __init__(self) -> None:
        self._keep_inputs = False
        self._rerunning = False
        self._finite: list[torch.Tensor] = []
        #: this step's training forwards, kept for a rerun while :attr:`keep_inputs`
        self.kept: list[KeptForward] = []

    @property
    def keep_inputs(self) -> bool:
        """Each training forward's inputs are kept for a rerun, in :attr:`kept`."""
        return self._keep_inputs

    def keep_forward_inputs(self, on: bool) -> None:
        """Keep (or stop keeping) each training forward's inputs, from the next forward on."""
        self._keep_inputs = on

    def keep(self, args: tuple, kwargs: dict) -> None:
        """A training forward starts: keep its inputs (references) and RNG state, when asked to."""
        if self._keep_inputs:
            self.kept.append(keep(args, kwargs))

    def clear(self) -> None:
        """A new step: the forwards kept so far belong to the last one."""
        self.kept.clear()

    @property
    def rerunning(self) -> bool:
        """The differential rerun is re-running a forward: attention is routed (the forced path) but nothing
        is measured, except whether each attention call's query and output stayed finite."""
        return self._rerunning

    @contextlib.contextmanager
    def rerunning_forward(self) -> Iterator[list[torch.Tensor]]:
        """Re-run a forward for the rerun; yields the list of device flags (finite or not) that attention
        calls inside add to through :meth:`saw`."""
        finite = self._finite = []
        self._rerunning = True
        try:
            yield finite
        finally:
            self._rerunning = False

    def saw(self, *tensors: torch.Tensor) -> None:
        """Inside :meth:`rerunning_forward`: note whether each of ``tensors`` is finite (device flags)."""
        self._finite += [torch.isfinite(t).all() for t in tensors]
