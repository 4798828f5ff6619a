"""Spikes before the overflow: a site whose value jumps ``factor``× over its own recent past without turning
non-finite (Megatron-LM's "large grads" and spiky-loss checks, k = 10).

**Where it runs.** On the reporter thread, from the values the step's one asynchronous copy already brought
to the host: each :class:`~nanwatch.wire.SiteStat`'s ``amax`` (a forward site: its output's largest |x|; a
gradient site, pass ``backward``: its gradient's largest |g|; ``mon.watch("loss", loss)``: the loss's |value|).
No device work and no host sync in the training step, and it sees exactly what a device-side flag would
(the same ``amax`` the device buffer holds). Only ``spike_action="skip"`` needs the verdict before the
optimizer step: then the weight guard reads the open step's values on the host once per optimizer step
(:class:`SpikeSkip`), the opt-in's cost.

**The baseline**, per (site, pass): the largest value of that site over its last ``window`` measured steps
(a step in which the site was not measured does not count). A step whose value exceeds ``factor`` × baseline
is a spike. What is ignored: the first ``warmup`` measured steps of each site (initialisation, the first
updates); a baseline of 0 or a non-finite one (nothing to compare with); a non-finite value (that is an
incident already, not a precursor). Every finite value joins the window, spikes included: a site that
jumps and stays there is told once, at the jump, and a value that grows gradually (a learning-rate warm-up
or any schedule that moves values by less than ``factor``× within ``window`` steps) raises its own baseline
and is never a spike. A schedule that multiplies a value by ``factor`` or more from one step to the next is
indistinguishable from a spike, and is reported as one.

Example usage::

    spikes = SpikeDetector(factor=10.0, window=20, warmup=10)
    found = spikes.observe(step, stats.sites)     # [Spike(site=..., phase=..., factor=52.0, ...)]
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence

from nanwatch.hooks.config import SpikesConfig
from nanwatch.hooks.measure.decode import QUIET_KINDS, decode_step
from nanwatch.hooks.measure.recorder import Recorder, StepState
from nanwatch.wire import SiteStat, Spike

__all__ = ["MAX_SPIKES", "SpikeDetector", "SpikeSkip", "spike_observer", "spike_skip"]

#: At most this many spikes per report (the wire's bound), the largest factors.
MAX_SPIKES = 64


class _History:
    """One (site, pass): its last values, and how many steps measured it."""

    __slots__ = ("seen", "values", "last")

    def __init__(self, window: int) -> None:
        self.values: deque[float] = deque(maxlen=window)
        self.seen = 0
        self.last: object = None  # the step (a number) the newest value belongs to (re-observing it replaces it)


class SpikeDetector:
    """The running baselines of one Monitor's sites; one thread only (the reporter's, or the training
    thread's for :class:`SpikeSkip`)."""

    def __init__(self, *, factor: float = 10.0, window: int = 20, warmup: int = 10) -> None:
        self.factor, self.window, self.warmup = factor, window, warmup
        self._sites: dict[tuple[str, str], _History] = {}

    def observe(self, step: object, sites: Iterable[SiteStat]) -> list[Spike]:
        """The spikes of ``step`` among ``sites`` (a training step's), largest factor first, at most
        :data:`MAX_SPIKES`; each finite value then joins its site's window. ``step`` only tells a step seen
        again (the guard's read at a second optimizer step of the same step) from a new one: observed again,
        a step's values replace its own, and it is compared with the steps before it."""
        found = []
        for s in sites:
            if s.kind in QUIET_KINDS or s.stage != "train":
                continue
            spike = self._one(step, s)
            if spike is not None:
                found.append(spike)
        found.sort(key=lambda sp: -sp.factor)
        return found[:MAX_SPIKES]

    def _one(self, step: object, s: SiteStat) -> Spike | None:
        value = s.amax
        if not math.isfinite(value) or value < 0:  # non-finite: an incident, never a spike
            return None
        h = self._sites.get((s.site, s.phase))
        if h is None:
            h = self._sites[(s.site, s.phase)] = _History(self.window)
        again = h.last == step and h.values
        if again:
            h.values.pop()
        else:
            h.seen += 1
        baseline = max(h.values) if h.values else 0.0
        h.values.append(value)
        h.last = step
        if h.seen <= self.warmup or not (math.isfinite(baseline) and baseline > 0):
            return None
        factor = value / baseline
        if factor <= self.factor:
            return None
        return Spike(site=s.site, phase=s.phase, kind=s.kind, value=value, baseline=baseline, factor=factor)


class SpikeSkip:
    """``spike_action="skip"``: the weight guard's question "did the open step spike?", asked before an
    optimizer step. One host read of the open step's values (``Recorder.flat()``) per optimizer step, the
    opt-in's cost (free on a CPU: the ops already ran); decoded and checked against this object's own
    baselines, which see the same values the reporter's do. Training thread."""

    def __init__(self, rec: Recorder, detector: SpikeDetector) -> None:
        self._rec, self.detector = rec, detector
        self.last: list[Spike] = []
        self._state: StepState | None = None  # the step last asked about (held: its identity is the step)
        self._steps = 0

    def __call__(self) -> bool:
        rec = self._rec
        state: StepState = rec.state
        if state.stage != "train":
            return False
        values: Sequence[float] = rec.flat().tolist()  # sync-ok: spike_action="skip", once per optimizer step
        if state is not self._state:
            self._state, self._steps = state, self._steps + 1
        self.last = self.detector.observe(self._steps, decode_step(state, values, slots=rec.buf).sites)
        return bool(self.last)


def spike_observer(spikes: SpikesConfig) -> Callable[[object, Iterable[SiteStat]], list[Spike]] | None:
    """The ``observe`` of fresh running baselines, as ``spikes`` asks for them (None: ``spike_factor=0``,
    spikes off): what the report builder and the job report are handed."""
    if not spikes.factor:
        return None
    return SpikeDetector(factor=spikes.factor, window=spikes.window, warmup=spikes.warmup).observe


def spike_skip(spikes: SpikesConfig, rec: Recorder) -> SpikeSkip | None:
    """``spike_action="skip"``'s check on ``rec``'s open step, with its own baselines, for the weight guards
    (None: not asked, or spikes off)."""
    if spikes.action != "skip" or not spikes.factor:
        return None
    return SpikeSkip(rec, SpikeDetector(factor=spikes.factor, window=spikes.window, warmup=spikes.warmup))
