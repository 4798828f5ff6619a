"""Directives on the trainer side: which attention path this rank applies, switched only at step
boundaries, and at the same step on every rank.

Rank 0 long-polls the collector on a background thread; any rank's local policy may offer a directive too.
Under torch.distributed, every K steps all ranks agree on (version, mode, apply_at_step, revert) through
one small int64 all-reduce (MAX) on a CPU (gloo) group, never on the GPU, so agreeing costs no device sync;
then they apply once ``step >= apply_at_step``. Since every rank evaluates the same rule on the same
numbers, they switch together, at most K steps after rank 0 (or any rank) learned of the directive.
Outside those K-step points nothing is communicated.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from nanwatch.hooks.recorder import Recorder
from nanwatch.wire import MODES, Directive

__all__ = ["DirectiveState"]

log = logging.getLogger("nanwatch")
_FUSED = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]


def _dist_group_size() -> int:
    d = torch.distributed
    return d.get_world_size() if d.is_available() and d.is_initialized() else 1


class DirectiveState:
    """The active directive of one Monitor. ``mode`` and ``version`` go into every report (the ack)."""

    def __init__(self, *, model: Callable[[], torch.nn.Module | None], rec: Recorder, rank: int,
                 check_every: int) -> None:
        """``model`` is a weak reference to the monitored model (switched between eager and SDPA);
        ``rec`` the step's recorder (warnings, and the non-finite count ``skip_step`` reads)."""
        self._model = model
        self._rec = rec
        self._rank = rank
        self._check_every = check_every
        self.mode: str = "none"
        self.version = 0
        self.revert_after: int | None = None
        self.clean_streak = 0
        self._offered: Directive | None = None
        self._agreed: tuple[int, int, int, int] | None = None
        self._revert_next: int | None = None
        self._poller = None
        self._prev_impl: str | None = None
        self._cpu_group = None
        self.fallbacks = 0

    # ---- inputs ----------------------------------------------------------------------------------
    def start_polling(self, url: str, run_id: str, token: str | None) -> None:
        if self._rank != 0:
            return  # rank 0 polls; the others learn through the broadcast
        from nanwatch.hooks.transport import DirectivePoller

        self._poller = DirectivePoller(url, run_id, token=token)

    def offer(self, directive: Directive) -> None:
        """Hand a directive over in-process (tests, the demo, or a trainer's own logic)."""
        self._offered = directive

    def note_report(self, clean: bool) -> None:
        """Reporter thread: count consecutive clean steps for auto-revert."""
        self.clean_streak = self.clean_streak + 1 if clean else 0

    def close(self) -> None:
        if self._poller is not None:
            self._poller.close()
        self._set_mode("none", self.version)

    # ---- step boundary -------------------------------------------------------------------------------
    def _local_candidate(self) -> tuple[int, int, int, int]:
        """(version, mode index, apply_at_step, revert_flag) as this rank sees it now. Auto-revert follows
        rank 0's clean-step streak (the others say 0), so one rank's streak decides for all."""
        newest = self._offered
        polled = self._poller.latest if self._poller is not None else None
        if polled is not None and (newest is None or polled.version > newest.version):
            newest = polled
        if newest is not None and newest.version > self.version:
            self._revert_next = newest.revert_after_clean_steps
            return newest.version, MODES.index(newest.mode), newest.apply_at_step, 0
        revert = int(self._rank == 0 and self.mode != "none" and self.revert_after is not None
                     and self.clean_streak >= self.revert_after)
        return self.version, MODES.index(self.mode), 0, revert

    def at_step_boundary(self, step: int) -> None:
        world = _dist_group_size()
        if world == 1:
            cand = self._local_candidate()
        elif step % self._check_every == 0:
            cand = self._agree()
        else:
            cand = self._agreed
        if cand is None:
            return
        version, mode_idx, apply_at, revert = cand
        if version > self.version and step >= apply_at:
            self.revert_after = self._revert_next
            self.clean_streak = 0
            self._set_mode(MODES[mode_idx], version)
            log.warning("nanwatch: step %d: applying directive v%d mode=%s", step, version, self.mode)
        elif revert and self.mode != "none":
            log.warning("nanwatch: step %d: %d clean steps, reverting mode %s", step, self.clean_streak,
                        self.mode)
            self._set_mode("none", self.version)
        if world > 1:
            self._agreed = None if (version, revert) == (self.version, 0) else cand

    def _agree(self) -> tuple[int, int, int, int]:
        """One all-reduce (MAX) of four int64 on the host, over gloo: the only collective nanwatch issues,
        once every K steps. Every rank calls it at the same step (step % K == 0), so the first call can
        create the CPU group (a collective call on all ranks) when the default group is not gloo."""
        d = torch.distributed
        if d.get_backend() != "gloo" and self._cpu_group is None:
            self._cpu_group = d.new_group(backend="gloo")
        t = torch.tensor(self._local_candidate(), dtype=torch.int64)
        d.all_reduce(t, op=d.ReduceOp.MAX, group=self._cpu_group)
        return tuple(int(x) for x in t.tolist())  # sync-ok: a CPU tensor (gloo), no device sync

    # ---- effects -----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def forced(self, mode: str) -> Iterator[None]:
        """Run with ``mode`` for a moment (the differential replay), then put the directive back."""
        saved = self.mode
        self._set_mode(mode, self.version)
        try:
            yield
        finally:
            self._set_mode(saved, self.version)

    def _set_mode(self, mode: str, version: int) -> None:
        # fp32/fused act inside the SDPA wrapper, so an HF model running eager attention is routed
        # through SDPA for them too; the previous implementation comes back when the mode ends.
        model = self._model()
        wants_sdpa = mode in ("fp32", "fused", "eager_to_sdpa")
        if not wants_sdpa and self._prev_impl is not None and model is not None:
            model.set_attn_implementation(self._prev_impl)
            self._prev_impl = None
        if wants_sdpa and self._prev_impl is None and model is not None:
            impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
            if impl == "eager" and hasattr(model, "set_attn_implementation"):
                self._prev_impl = impl
                model.set_attn_implementation("sdpa")
        self.mode, self.version = mode, version

    def should_skip_step(self) -> bool:
        """Directive 'skip_step': True when the current step has seen a non-finite value so far.

        This reads the device buffer, i.e. one host sync, as GradScaler does; it is only paid while that
        directive is active (opt-in). Without the directive it returns False at no cost."""
        if self.mode != "skip_step":
            return False
        return bool(self._rec.nonfinite_flag())  # sync-ok: opt-in skip_step directive, once per step

    def fused_call(self, site: str, call, upcast):
        """Run ``call`` restricted to fused kernels; if none fits, fall back to fp32 and say so."""
        try:
            with sdpa_kernel(_FUSED):
                return call()
        except RuntimeError as exc:
            self.fallbacks += 1
            msg = f"directive 'fused': no fused kernel fits at {site}; ran fp32 instead"
            if self._rec.warn(msg):
                log.warning("nanwatch: %s (%s)", msg, str(exc).splitlines()[0] if str(exc) else exc)
            upcast()
            return call()
