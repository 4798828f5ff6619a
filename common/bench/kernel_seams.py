"""The seams that let ``nanwatch bench kernels`` stand a meta-device model in for a GPU one. Each patches torch
(or the attention function nanwatch wraps), only while counting, and none changes nanwatch's code or what it
launches:

* **autocast**: ``torch.is_autocast_enabled("meta")`` raises (torch keeps no autocast state for meta); it is
  answered False, as on a GPU step without autocast;
* **fused AdamW**: torch refuses ``fused=True`` for meta parameters; ``meta`` is added to the devices it
  accepts (``_fused_adamw_`` has a meta implementation);
* **flash attention**: on meta, SDPA takes the math path (with its fp32 upcast of bf16), which a GPU does not
  at these shapes. The model's SDPA (``F.scaled_dot_product_attention``, and the original that nanwatch's
  wrapper calls) runs the flash kernel's meta implementation instead, with its autograd node and saved
  log-sum-exp, and ``torch._fused_sdp_choice`` answers "flash" for meta tensors, so nanwatch predicts and
  confirms what a GPU would run. Off meta, or with a mask or dropout, the original runs;
* **the reporter's log**: the host copy of a meta step holds zeros (see ``OpCounter``), which the reporter
  thread may fail to decode into a report; its "could not build the report" lines are silenced. The
  reporter thread launches nothing on the device, so nothing counted changes.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
import torch.nn.functional as F

__all__ = ["meta_seams"]


def _flash_on_meta(original):
    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False,
             **kwargs):
        if query.device.type != "meta" or attn_mask is not None or dropout_p or kwargs:
            return original(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa,
                            **kwargs)
        return torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, 0.0, is_causal, False,
                                                                  scale=scale)[0]

    return sdpa


def _flash_choice(*args, **kwargs) -> int:
    from torch.nn.attention import SDPBackend

    return int(SDPBackend.FLASH_ATTENTION)


@contextlib.contextmanager
def meta_seams(device: str) -> Iterator[None]:
    """The seams above, while counting on ``device`` (none unless it is ``meta``)."""
    if torch.device(device).type != "meta":
        yield
        return
    import torch.optim.optimizer as optim_mod

    from nanwatch.hooks.instrument import patching

    autocast, fused = torch.is_autocast_enabled, optim_mod._get_fused_kernels_supported_devices
    sdpa, original = F.scaled_dot_product_attention, patching.ORIGINAL_SDPA
    nw_log = logging.getLogger("nanwatch")
    level = nw_log.level

    def is_autocast_enabled(*args):
        if args and str(args[0]) == "meta":
            return False
        return autocast(*args)

    lib = torch.library.Library("aten", "IMPL")  # a bench-only override, destroyed below
    try:
        with _quiet_override():
            lib.impl("_fused_sdp_choice", _flash_choice, "Meta")
        torch.is_autocast_enabled = is_autocast_enabled
        optim_mod._get_fused_kernels_supported_devices = lambda: [*fused(), "meta"]
        patching.ORIGINAL_SDPA = F.scaled_dot_product_attention = _flash_on_meta(original)
        nw_log.setLevel(logging.CRITICAL)
        yield
    finally:
        torch.is_autocast_enabled = autocast
        optim_mod._get_fused_kernels_supported_devices = fused
        patching.ORIGINAL_SDPA, F.scaled_dot_product_attention = original, sdpa
        nw_log.setLevel(level)
        lib._destroy()


@contextlib.contextmanager
def _quiet_override() -> Iterator[None]:
    """torch warns when a kernel is registered over an existing one: that is the point here."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
