"""Which SDPA backend ran for a call, why not a fused one, and the log-sum-exp it saved.

Three questions the SDPA wrapper asks on every call, each answered without a host-device sync (only
shapes, strides, dtypes, devices, flags and autograd node types are read, never tensor values):

* :func:`predict` asks ``torch._fused_sdp_choice`` (the dispatcher's own selector, ~1 us) before the
  call. When the answer is the math fallback it also says why, from the gates ported in
  :mod:`nanwatch.hooks.measure.sdpa_rules`; that reason is cached by a metadata signature.
* :func:`confirmed_backend` reads the backend that really ran from the output's ``grad_fn`` type, free
  whenever autograd recorded the call.
* :func:`lse_of` hands back the log-sum-exp a fused kernel saved for backward, which bounds the max
  attention logit (rowmax <= lse <= rowmax + log(n_valid)) at no extra cost, and refuses when reading
  it would force an activation-checkpoint recompute.

Example usage::

    backend, reason = predict(q, k, v, attn_mask=mask, is_causal=False)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    ran = confirmed_backend(out) or backend
    lse = lse_of(out)  # a device tensor or None; reduce it on the device
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch
from torch.nn.attention import SDPBackend

from nanwatch.hooks.measure.sdpa_rules import (
    DeviceProfile,
    Flags,
    SdpaMeta,
    cpu_flash_refusal,
    cudnn_refusal,
    efficient_refusal,
    flash_refusal,
)

__all__ = ["CACHE_SIZE", "cache_clear", "confirmed_backend", "device_profile", "explain", "lse_at_recompute",
           "lse_of", "normalize_lse", "predict"]

#: Reasons kept by :func:`predict`. A model has a handful of signatures (layers share one); 4096 bounds the rare
#: workload whose shapes never repeat (e.g. unpadded variable-length batches) to a few hundred KiB.
CACHE_SIZE = 4096

# The int that _fused_sdp_choice returns, read off the enum rather than hard-coded.
_CHOICE = {
    int(SDPBackend.MATH): "math",
    int(SDPBackend.FLASH_ATTENTION): "flash",
    int(SDPBackend.EFFICIENT_ATTENTION): "efficient",
    int(SDPBackend.CUDNN_ATTENTION): "cudnn",
    int(SDPBackend.OVERRIDEABLE): "overrideable",
}

# Autograd node names in torch 2.13 (checked against libtorch_cpu's generated Functions). The math
# path decomposes into matmul/softmax, so it has no node of its own: anything else means math.
_NODE = {
    "ScaledDotProductFlashAttentionForCpuBackward0": "cpu_flash",
    "ScaledDotProductFlashAttentionBackward0": "flash",
    "ScaledDotProductEfficientAttentionBackward0": "efficient",
    "ScaledDotProductCudnnAttentionBackward0": "cudnn",
    "ScaledDotProductFusedAttentionOverrideableBackward0": "overrideable",
}
# Which saved field holds the log-sum-exp: the efficient kernel names its output ``log_sumexp``.
_LSE_FIELD = {
    "cpu_flash": "logsumexp",
    "flash": "logsumexp",
    "efficient": "log_sumexp",
    "cudnn": "logsumexp",
    "overrideable": "logsumexp",
}

_cache: OrderedDict[tuple, str] = OrderedDict()
_cache_lock = threading.Lock()
_sm: dict[int, tuple[int, int]] = {}
_is_compiling = torch.compiler.is_compiling


def predict(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
            dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
            enable_gqa: bool = False) -> tuple[str, str | None]:
    """``(backend, reason)`` for an SDPA call with these arguments, before it runs.

    ``backend`` is a wire ``Backend`` name; ``reason`` is None when a fused kernel was chosen, else why
    each fused kernel refused. Never raises: a failed prediction is ``("unknown", why)``, because
    monitoring must not break the trainer.

    The selector itself is asked on every call and only the reason is cached. Measured on CPU (torch
    2.13), ``_fused_sdp_choice`` costs ~1 us while building and looking up a signature that covers every
    input of the decision costs ~2 us, so a cache of the choice would be slower than the selector
    and could go stale on state the key misses; the reason (~15 us to derive) is worth caching.
    """
    if _is_compiling():
        # Inside a graph the eager selector is not what runs (inductor may pick its own kernel), and
        # calling an eager-only op here would add a graph break.
        return ("compiled", None)
    try:
        idx = torch._fused_sdp_choice(query, key, value, attn_mask, dropout_p, is_causal, scale=scale,
                                      enable_gqa=enable_gqa)
    except RuntimeError as e:
        if "No viable backend" not in str(e) and "No available kernel" not in str(e):
            return ("unknown", f"prediction failed: RuntimeError: {str(e)[:200]}")
        return ("unknown", "no viable backend: " + _reason(query, key, value, attn_mask, dropout_p, is_causal,
                                                           scale, enable_gqa))
    except Exception as e:  # noqa: BLE001 - e.g. NotImplementedError for jagged nested tensors on CPU
        return ("unknown", f"prediction failed: {type(e).__name__}: {str(e)[:200]}")
    name = _CHOICE.get(idx, "unknown")
    if name == "math":
        return ("math", _reason(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa))
    if name == "flash" and query.is_cpu:
        return ("cpu_flash", None)
    return (name, None)


def cache_clear() -> None:
    """Forget every cached reason (tests; or after changing something the key cannot see)."""
    with _cache_lock:
        _cache.clear()


def _reason(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa) -> str:
    try:
        sig = _signature(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa)
    except Exception:  # noqa: BLE001 - subclasses (DTensor, fakes) may refuse a metadata read
        sig = None
    hit = _cache.get(sig) if sig is not None else None
    if hit is not None:
        try:
            _cache.move_to_end(sig)
        except KeyError:  # evicted by another thread between get and move: the answer still stands
            pass
        return hit
    reason = _derive_reason(q, k, v, mask, dropout_p, is_causal, enable_gqa)
    if sig is not None:
        with _cache_lock:
            _cache[sig] = reason
            if len(_cache) > CACHE_SIZE:
                _cache.popitem(last=False)
    return reason


def _signature(q, k, v, mask, dropout_p, is_causal, scale, enable_gqa) -> tuple | None:
    # Everything any gate reads, and nothing else: shapes, dtypes, last-dim strides, storage offset
    # modulo the widest alignment any kernel needs (8 elements), requires_grad under grad mode, and the
    # global switches sdpa_kernel() flips. None means "do not cache" (nested: the gates read sizes).
    if q.is_nested or k.is_nested or v.is_nested:
        return None
    c = torch._C
    sig = (
        q.device,
        q.dtype, q.shape, q.stride()[-1] == 1, q.storage_offset() % 8,
        k.dtype, k.shape, k.stride()[-1] == 1, k.storage_offset() % 8,
        v.dtype, v.shape, v.stride()[-1] == 1, v.storage_offset() % 8,
        None if mask is None else (mask.dtype, mask.shape, mask.stride()[-1] == 1, mask.requires_grad),
        float(dropout_p), bool(is_causal), scale is None, bool(enable_gqa),
        torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad),
        c._get_flash_sdp_enabled(), c._get_mem_efficient_sdp_enabled(), c._get_math_sdp_enabled(),
        c._get_cudnn_sdp_enabled(), c._get_overrideable_sdp_enabled(),
    )
    if q.is_cuda:
        # The CUDA gates also read FA3 and deterministic mode; the CPU gate does not.
        sig += (c._get_fa3_sdp_enabled(), torch.are_deterministic_algorithms_enabled()
                and not torch.is_deterministic_algorithms_warn_only_enabled())
    return sig


def explain(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
            dropout_p: float = 0.0, is_causal: bool = False, enable_gqa: bool = False) -> dict[str, str | None]:
    """Each fused backend of this device mapped to its refusal (None: it would accept the call).

    Empty for devices whose rules are not ported (anything but CPU and NVIDIA CUDA).
    """
    m = SdpaMeta.of(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    flags = Flags.current()
    if m.device_type == "cpu":
        return {"cpu_flash": cpu_flash_refusal(m, flags)}
    if m.device_type == "cuda" and torch.version.hip is None:
        p = device_profile(query.device)
        return {"flash": flash_refusal(m, p, flags), "efficient": efficient_refusal(m, p, flags),
                "cudnn": cudnn_refusal(m, p, flags)}
    return {}


def _derive_reason(q, k, v, mask, dropout_p, is_causal, enable_gqa) -> str:
    try:
        refusals = explain(q, k, v, mask, dropout_p, is_causal, enable_gqa)
    except Exception as e:  # noqa: BLE001 - a reason is a nicety; never fail the call over it
        return f"fused kernels refused (reason unavailable: {type(e).__name__})"
    if not refusals:
        return f"fused kernels refused on {q.device.type} (its rules are not ported)"
    if all(r is not None and r.startswith("disabled") for r in refusals.values()):
        return "fused kernels disabled by sdpa_kernel([...]) or torch.backends.cuda.enable_*_sdp(False)"
    return "; ".join(f"{name}: {r or 'refused by torch for a reason this port does not model'}"
                     for name, r in refusals.items())


def device_profile(device: torch.device) -> DeviceProfile:
    """The CUDA facts the gates consult, for a real device (compute capability cached per index)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _sm:
        props = torch.cuda.get_device_properties(index)
        _sm[index] = (props.major, props.minor)
    cudnn = torch.backends.cudnn
    return DeviceProfile(
        sm=_sm[index],
        cudnn_version=cudnn.version() if cudnn.is_available() else None,
        flash_built=torch.backends.cuda.is_flash_attention_available(),
        deterministic_strict=torch.are_deterministic_algorithms_enabled()
        and not torch.is_deterministic_algorithms_warn_only_enabled(),
        fa3=torch._C._get_fa3_sdp_enabled(),
    )


def confirmed_backend(out: torch.Tensor) -> str | None:
    """The backend that produced ``out``, from its autograd node; None when autograd recorded nothing.

    Pass SDPA's own output: a view or op applied after it replaces the node and reads as ``math``.
    """
    fn = out.grad_fn
    if fn is None:
        return None
    return _NODE.get(type(fn).__name__, "math")


def lse_of(out: torch.Tensor) -> torch.Tensor | None:
    """The log-sum-exp of the scaled logits that a fused kernel saved for backward, or None.

    None when ``out`` has no fused SDPA node, and also whenever the saved tensor went through
    saved-tensor hooks: non-reentrant activation checkpointing installs such hooks, and unpacking
    through them re-runs the checkpointed forward. Both the hooks active now (inside the checkpointed
    region) and the hook recorded on the saved tensor itself (after it) are checked, without unpacking.
    """
    fn = out.grad_fn
    backend = _NODE.get(type(fn).__name__) if fn is not None else None
    if backend is None:
        return None
    if torch._C._autograd._top_saved_tensors_default_hooks(True) is not None:
        return None
    field = _LSE_FIELD[backend]
    raw = getattr(fn, "_raw_saved_" + field, None)
    if raw is None or raw.unpack_hook is not None:
        return None
    return normalize_lse(getattr(fn, "_saved_" + field), out)


@torch.no_grad()
def lse_at_recompute(out: torch.Tensor) -> torch.Tensor | None:
    """The saved log-sum-exp of a call that activation checkpointing is re-running in backward.

    In the first forward, non-reentrant checkpointing packs saved tensors away (reading them would
    recompute), so :func:`lse_of` refuses. In the recompute the kernel saves its log-sum-exp again, and
    checkpointing's recomputation hook keeps it as it is (its unpack hook is the identity); reentrant
    checkpointing recomputes with no hook at all. Either way it is free to read here, and nothing here
    saves a tensor, which would break checkpointing's count of saved tensors."""
    fn = out.grad_fn
    backend = _NODE.get(type(fn).__name__) if fn is not None else None
    if backend is None:
        return None
    field = _LSE_FIELD[backend]
    raw = getattr(fn, "_raw_saved_" + field, None)
    if raw is None:
        return None
    hook = raw.unpack_hook
    if hook is not None and "_recomputation_hook" not in getattr(hook, "__qualname__", ""):
        return None  # some other saved-tensor hook (offloading...): unpacking could cost a copy
    return normalize_lse(getattr(fn, "_saved_" + field), out)


def normalize_lse(lse: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """A saved log-sum-exp as ``[..., H, L]`` with exactly the output's L query rows.

    cuDNN saves its softmax statistics as ``[B, H, L, 1]``; the CUTLASS (efficient) kernel rounds the
    query axis up to a multiple of 32. Flash and CPU flash already save ``[B, H, L]``."""
    if lse.dim() == out.dim() and lse.shape[-1] == 1:
        lse = lse.squeeze(-1)
    if out.dim() >= 2 and lse.shape[-1] > out.shape[-2]:
        lse = lse[..., : out.shape[-2]]
    return lse
