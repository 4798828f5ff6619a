"""Directives on the trainer side: which attention path this rank applies, switched only at step
boundaries, and at the same step on every rank.

Three parts, one job each: the decision (``directive_decision``: pure, what to apply at this step), the
agreement (``directive_agreement``: the one collective, every K steps under torch.distributed) and the
effects (``mode_effects``: what a mode does to the model). :class:`DirectiveState` holds the directive in
force and runs the three at each step boundary.

Directives arrive from the collector (rank 0's poller, see ``Monitor.attach``), from the local rule engine
(``nanwatch.hooks.directives.local_rules``) or from the trainer's own code (``offer``). Under torch.distributed all
ranks agree at the steps ``nanwatch.policy.is_agreement_step`` names, then apply once
``step >= apply_at_step``: every rank evaluates the same rule on the same numbers, so they switch
together, at most K steps after any rank learned of the directive. Outside those steps nothing is
communicated.

Threads: which one owns which field of the trainer side (the one place this is written down).

=================  ======================================================================================
training thread    every hook and Monitor write: Probes and their flags, Recorder.state and its buffers
                   (autograd's per-device threads run gradient hooks too: SlotBuffer locks allocation),
                   here ``mode``/``version``/``revert_after``, the agreement and ModeEffects; ParamSweep;
                   the compiled counts; it copies ``mode``/``version`` into each step's StepContext
reporter thread    a StepState once ``Recorder.swap()`` handed it over; ReportBuilder; LocalRuleEngine;
                   ``on_report``. It *offers* directives and counts clean steps: ``_offered`` and
                   ``_clean_streak`` here, which the training thread reads and resets, sit behind ``_lock``
sender thread      ReportSender's queue consumer and connection (``dropped`` under its own lock)
poller thread      DirectivePoller.latest: one reference, replaced whole, read by the training thread
=================  ======================================================================================

Reporter's pool and counters are behind its Condition, WarnOnce's set behind its lock. The reporter
thread's reads of ``mode``/``version`` (the rule engine's "is one active?") may be a step stale; at worst
it re-offers a version already offered, which ``offer`` then replaces with an equal one: no effect.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator

import torch

from nanwatch.hooks.directives.agreement import RankAgreement, world_size
from nanwatch.hooks.directives.decision import (
    Candidate,
    InForce,
    decide,
    local_candidate,
    newest,
    still_pending,
)
from nanwatch.hooks.directives.mode_effects import ModeEffects
from nanwatch.hooks.measure.recorder import Recorder
from nanwatch.policy import is_agreement_step
from nanwatch.wire import Directive

__all__ = ["DirectiveState"]

log = logging.getLogger("nanwatch")


class DirectiveState:
    """The active directive of one Monitor. ``mode`` and ``version`` go into every report (the ack)."""

    def __init__(self, *, model: Callable[[], torch.nn.Module | None], rec: Recorder, rank: int,
                 check_every: int) -> None:
        """``model`` is a weak reference to the monitored model (switched between eager and SDPA);
        ``rec`` the step's recorder (warnings, and the non-finite flag ``skip_step`` reads);
        ``check_every`` the agreement cadence K under torch.distributed."""
        self._rec = rec
        self._rank = rank
        self._check_every = check_every
        self._effects = ModeEffects(model=model, rec=rec)
        self._agreement = RankAgreement()
        self.mode: str = "none"
        self.version = 0
        self.revert_after: int | None = None
        self._lock = threading.Lock()  # _offered and _clean_streak: reporter thread and training thread
        self._offered: Directive | None = None
        self._clean_streak = 0
        self._revert_next: int | None = None
        self._agreed: Candidate | None = None
        self._poller = None

    # ---- inputs ----------------------------------------------------------------------------------
    def follow(self, poller) -> None:
        """Take directives from ``poller`` (a ``DirectivePoller``, rank 0's); closed with this state."""
        self._poller = poller

    def offer(self, directive: Directive) -> None:
        """Hand a directive over in-process (the local rule engine, tests, the demo, a trainer's own logic)."""
        with self._lock:
            self._offered = directive

    def note_report(self, clean: bool) -> None:
        """Reporter thread: count consecutive clean steps for auto-revert."""
        with self._lock:
            self._clean_streak = self._clean_streak + 1 if clean else 0

    @property
    def clean_streak(self) -> int:
        """Consecutive clean steps reported since the last directive was applied."""
        with self._lock:
            return self._clean_streak

    @property
    def fallbacks(self) -> int:
        """SDPA calls the ``fused`` mode ran in fp32 because no fused kernel fitted."""
        return self._effects.fallbacks

    def close(self) -> None:
        if self._poller is not None:
            self._poller.close()
        self._set_mode("none", self.version)

    # ---- step boundary (training thread) -------------------------------------------------------------
    def _local_candidate(self) -> Candidate:
        """This rank's candidate now. Auto-revert follows rank 0's clean-step streak (the others say 0)."""
        polled = self._poller.latest if self._poller is not None else None
        now = InForce(self.mode, self.version, self.revert_after)
        with self._lock:
            latest, streak = newest(self._offered, polled), self._clean_streak
        if latest is not None and latest.version > self.version:
            self._revert_next = latest.revert_after_clean_steps
        return local_candidate(now, latest, clean_streak=streak, decides_revert=self._rank == 0)

    def at_step_boundary(self, step: int) -> None:
        world = world_size()
        if world == 1:
            cand = self._local_candidate()
        elif is_agreement_step(step, self._check_every):
            cand = self._agreement.agree(self._local_candidate())
        else:
            cand = self._agreed
        if cand is None:
            return
        decision = decide(InForce(self.mode, self.version, self.revert_after), cand, step=step)
        if decision.action == "apply":
            self.revert_after = self._revert_next
            with self._lock:
                self._clean_streak = 0
            self._set_mode(decision.mode, decision.version)
            log.warning("nanwatch: step %d: applying directive v%d mode=%s", step, decision.version, self.mode)
        elif decision.action == "revert":
            log.warning("nanwatch: step %d: %d clean steps, reverting mode %s", step, self.clean_streak,
                        self.mode)
            self._set_mode("none", self.version)
        if world > 1:
            self._agreed = cand if still_pending(cand, version_after=self.version) else None

    # ---- effects -----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def forced(self, mode: str) -> Iterator[None]:
        """Run with ``mode`` for a moment (the differential rerun), then put the directive back."""
        saved = self.mode
        self._set_mode(mode, self.version)
        try:
            yield
        finally:
            self._set_mode(saved, self.version)

    def _set_mode(self, mode: str, version: int) -> None:
        self._effects.switch(mode)
        self.mode, self.version = mode, version

    def should_skip_step(self) -> bool:
        """Directive 'skip_step': True when the current step has seen a non-finite value so far.

        This reads the device buffer, i.e. one host sync, as GradScaler does; it is only paid while that
        directive is active (opt-in). Without the directive it returns False at no cost. Under
        torch.distributed the flag is the job's (one reduction across ranks, ``Recorder.nonfinite_flag(job=True)``):
        every rank calls this under the agreed mode, and every rank gets the same answer."""
        if self.mode != "skip_step":
            return False
        return bool(self._rec.nonfinite_flag(job=True))  # sync-ok: opt-in skip_step directive, once per step

    def fused_call(self, site: str, call, upcast):
        """Run ``call`` restricted to fused kernels; if none fits, fall back to fp32 and say so."""
        return self._effects.fused_call(site, call, upcast)

