"""What an attention mode does to the model: the effects of a directive, apart from deciding it.

``fp32``/``fused``/``eager_to_sdpa`` act inside the SDPA wrapper, so an HF model running eager attention is
routed through SDPA while one of them is active and gets its own implementation back when it ends;
``fused`` restricts SDPA to the fused kernels and falls back to fp32, saying so, where none fits.
Training thread only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from nanwatch.hooks.measure.recorder import Recorder

__all__ = ["ModeEffects"]

log = logging.getLogger("nanwatch")
_FUSED = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]
_VIA_SDPA = frozenset({"fp32", "fused", "eager_to_sdpa"})


class ModeEffects:
    """The model-side effects of the active mode on one model (held weakly)."""

    def __init__(self, *, model: Callable[[], torch.nn.Module | None], rec: Recorder) -> None:
        self._model = model
        self._rec = rec
        self._prev_impl: str | None = None
        #: SDPA calls the ``fused`` mode ran in fp32 because no fused kernel fitted
        self.fallbacks = 0

    def switch(self, mode: str) -> None:
        """Route the model's attention as ``mode`` needs (HF's eager implementation through SDPA, or back)."""
        model = self._model()
        wants_sdpa = mode in _VIA_SDPA
        if not wants_sdpa and self._prev_impl is not None and model is not None:
            model.set_attn_implementation(self._prev_impl)
            self._prev_impl = None
        if wants_sdpa and self._prev_impl is None and model is not None:
            impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
            if impl == "eager" and hasattr(model, "set_attn_implementation"):
                self._prev_impl = impl
                model.set_attn_implementation("sdpa")

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
