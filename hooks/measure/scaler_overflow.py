"""A dynamic loss scaler's two slots, and what they mean once decoded: the scaler's ``found_inf`` and its scale
(written by ``nanwatch.hooks.remedies.loss_scaling``'s watch), and :func:`handled_by_scaler`, the pure check that
tells an overflow the scaler handled (normal operation, #18) from an incident. Both the report (``scaler_overflow``
of a rank's and a job's report) and the rerun (no rerun for a handled overflow) read them, so they sit below both.
"""

from __future__ import annotations

from collections.abc import Iterable

from nanwatch.hooks.measure.figures import figure
from nanwatch.hooks.measure.recorder import StepState
from nanwatch.wire import SiteStat

__all__ = ["LOSS_SCALE", "SCALER_FOUND", "handled_by_scaler", "loss_scaling"]

#: The max slot holding 1 when a watched scaler found inf/NaN gradients in the step (any optimizer).
SCALER_FOUND = ("scaler", "found_inf")
#: The scaler's scale at the step's end (assigned, not accumulated): the report's ``loss_scale``, a job's the
#: lowest of its ranks' (a collapsing scale is the incident).
LOSS_SCALE = figure("loss_scale", how="last", across="min")


def loss_scaling(state: StepState) -> bool:
    """The step ran under a watched, enabled GradScaler (its watch wrote the scale at the step's end): the report
    carries ``loss_scale`` and ``scaler_overflow`` (None without one)."""
    return LOSS_SCALE.path in state.figures


def handled_by_scaler(found_inf: bool, sites: Iterable[SiteStat]) -> bool:
    """The step's non-finite values were dynamic loss scaling at work: the scaler found inf/NaN gradients
    and every non-finite training site was a gradient (backward). A non-finite forward value (activations,
    logits, the loss), parameter or optimizer output makes it a real incident."""
    return found_inf and all(s.phase == "backward" for s in sites if s.stage == "train" and (s.nan or s.inf))
