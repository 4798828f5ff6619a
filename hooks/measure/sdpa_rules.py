"""Why SDPA refused a fused kernel: PyTorch's backend gates, re-expressed as pure functions of metadata.

``torch._fused_sdp_choice`` says *which* backend runs but not *why* the fused ones were refused. The
gates that decide it live in ATen (``sdp_utils_cpp.{h,cpp}`` for the CPU flash kernel,
``cuda/sdp_utils.cpp`` for flash / mem-efficient / cuDNN, read at the revision matching torch 2.13).
They are restated here, in the same order, so that the first failing gate of each backend becomes a
short human reason. Everything is a function of shapes, strides, dtypes and flags plus a
:class:`DeviceProfile`, never of tensor values, so it costs no host-device sync and the CUDA rules can
be unit-tested on a CPU-only machine with fake metadata.

The port is a reason generator, not the oracle: ``torch._fused_sdp_choice`` stays the source of truth
for the prediction, and a disagreement is reported as such rather than papered over.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nanwatch.wire import dtype_name, is_half

__all__ = [
    "DeviceProfile",
    "Flags",
    "SdpaMeta",
    "TensorMeta",
    "cpu_flash_refusal",
    "cudnn_refusal",
    "efficient_refusal",
    "flash_refusal",
]



@dataclass(frozen=True, slots=True)
class TensorMeta:
    """What the gates read from one tensor: metadata only, so building it never syncs."""

    shape: tuple[int, ...]
    #: None for strided nested tensors, whose per-component strides the dense gates never read.
    stride: tuple[int, ...] | None
    dtype: torch.dtype
    requires_grad: bool = False
    nested: bool = False
    #: Elements, not bytes: the mem-efficient kernel's pointer-alignment gate needs it.
    storage_offset: int = 0

    @classmethod
    def of(cls, t: torch.Tensor) -> TensorMeta:
        nested = t.is_nested
        try:
            stride, offset = tuple(t.stride()), t.storage_offset()
        except RuntimeError:  # strided NestedTensor: no single stride
            stride, offset = None, 0
        return cls(_shape(t), stride, t.dtype, t.requires_grad, nested, offset)

    @property
    def dim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


def _shape(t: torch.Tensor) -> tuple[int, ...]:
    # Ragged dims of nested tensors read as -1: only the nested-only gates look at them, and those read
    # nested sizes (a tensor), so they are deliberately not ported.
    out = []
    for i in range(t.dim()):
        try:
            s = t.size(i)
        except RuntimeError:
            s = -1
        out.append(s if isinstance(s, int) else -1)
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Flags:
    """The global enable switches that ``sdpa_kernel([...])`` and ``torch.backends.cuda.enable_*_sdp`` flip."""

    flash: bool = True
    efficient: bool = True
    math: bool = True
    cudnn: bool = True

    @classmethod
    def current(cls) -> Flags:
        c = torch._C
        return cls(c._get_flash_sdp_enabled(), c._get_mem_efficient_sdp_enabled(),
                   c._get_math_sdp_enabled(), c._get_cudnn_sdp_enabled())


@dataclass(frozen=True, slots=True)
class DeviceProfile:
    """The CUDA facts the gates consult; on a real GPU built by ``sdpa_backend``, in tests by hand."""

    #: Compute capability, e.g. (9, 0) for H100/H200.
    sm: tuple[int, int] = (9, 0)
    #: ``torch.backends.cudnn.version()`` (e.g. 91002 for 9.10.2); None when torch has no cuDNN.
    cudnn_version: int | None = 91002
    #: Whether this torch build compiled the cuDNN frontend with d=256 support (frontend >= 1.24).
    cudnn_frontend_d256: bool = True
    flash_built: bool = True
    efficient_built: bool = True
    #: ``torch.use_deterministic_algorithms(True)`` without ``warn_only``: cuDNN SDPA is refused.
    deterministic_strict: bool = False
    #: FlashAttention-3 switch (``torch._C._get_fa3_sdp_enabled``): widens flash dtypes on sm90+.
    fa3: bool = False


@dataclass(frozen=True, slots=True)
class SdpaMeta:
    """One SDPA call as the gates see it."""

    q: TensorMeta
    k: TensorMeta
    v: TensorMeta
    mask: TensorMeta | None = None
    dropout_p: float = 0.0
    is_causal: bool = False
    enable_gqa: bool = False
    grad_enabled: bool = True
    device_type: str = "cpu"

    @classmethod
    def of(cls, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
           dropout_p: float = 0.0, is_causal: bool = False, enable_gqa: bool = False, *,
           grad_enabled: bool | None = None, device_type: str | None = None) -> SdpaMeta:
        return cls(TensorMeta.of(q), TensorMeta.of(k), TensorMeta.of(v),
                   None if attn_mask is None else TensorMeta.of(attn_mask), float(dropout_p),
                   bool(is_causal), bool(enable_gqa),
                   torch.is_grad_enabled() if grad_enabled is None else grad_enabled,
                   q.device.type if device_type is None else device_type)

    @property
    def training(self) -> bool:
        """ATen's ``input_requires_grad``: some input needs grad and grad mode is on."""
        return self.grad_enabled and (self.q.requires_grad or self.k.requires_grad or self.v.requires_grad)

    @property
    def nested(self) -> bool:
        return self.q.nested or self.k.nested or self.v.nested


# ---- gates shared by several backends (sdp_utils_cpp.h). Each returns the refusal, or None. --------


def _four_d(m: SdpaMeta) -> str | None:
    if not (m.q.dim == m.k.dim == m.v.dim == 4):
        return f"q/k/v must be 4-D (B, H, S, D), got {m.q.dim}/{m.k.dim}/{m.v.dim}-D"
    return None


def _batch_heads(m: SdpaMeta, *, same_kv_heads: bool = True) -> str | None:
    (bq, hq), (bk, hk), (bv, hv) = m.q.shape[:2], m.k.shape[:2], m.v.shape[:2]
    if not bq == bk == bv:
        return f"batch sizes differ (q {bq}, k {bk}, v {bv}); expand them"
    if m.enable_gqa:
        if same_kv_heads and hk != hv:
            return f"enable_gqa: key/value heads differ ({hk} vs {hv})"
        if hq % hk or (not same_kv_heads and hq % hv):
            return f"enable_gqa: kv heads ({hk}/{hv}) do not divide query heads {hq}"
        return None
    if not hq == hk == hv:
        return f"heads differ (q {hq}, k {hk}, v {hv}) and enable_gqa=False"
    return None


def _mask_shape(m: SdpaMeta) -> str | None:
    a = m.mask
    if a is None:
        return None
    if a.requires_grad:
        return "attn_mask requires grad"
    b, h, sq, sk = m.q.shape[0], m.q.shape[1], m.q.shape[2], m.k.shape[2]
    ok = a.dim >= 2 and a.shape[-2] in (sq, 1) and a.shape[-1] in (sk, 1) and (
        a.dim == 2 or (a.dim == 4 and a.shape[0] in (1, b) and a.shape[1] in (1, h)))
    return None if ok else f"attn_mask shape {a.shape} is not 2-D (Sq,Sk) or 4-D (B|1,H|1,Sq|1,Sk|1)"


def _nonzero_seq(m: SdpaMeta) -> str | None:
    if m.q.shape[-2] == 0 or m.k.shape[-2] == 0:
        return "zero-length sequence"
    return None


def _last_stride(m: SdpaMeta, *, ignore_singleton: bool) -> str | None:
    bad = [n for n, t in (("q", m.q), ("k", m.k), ("v", m.v)) if t.stride is not None and t.stride[-1] != 1]
    if bad and ignore_singleton and m.q.shape[-1] == 1:
        bad = []
    # Since 2.13 the CPU kernel accepts a mask whose last dim is strided; the GPU kernels do not.
    if m.device_type != "cpu" and m.mask is not None and m.mask.stride and m.mask.stride[-1] != 1:
        bad.append("attn_mask")
    return f"last-dim stride != 1 on {', '.join(bad)} (call .contiguous())" if bad else None


def _dtypes(m: SdpaMeta, allowed: tuple[torch.dtype, ...]) -> str | None:
    d = m.q.dtype
    if not (d == m.k.dtype == m.v.dtype):
        return f"q/k/v dtypes differ ({d}, {m.k.dtype}, {m.v.dtype})"
    if d not in allowed:
        return f"dtype {dtype_name(d)} not in {{{', '.join(dtype_name(a) for a in allowed)}}}"
    return None


def _first(*checks) -> str | None:
    # Gates run lazily and in ATen's order: a later gate may assume an earlier one (e.g. 4-D) passed.
    for check in checks:
        reason = check()
        if reason:
            return reason
    return None


# ---- CPU (sdp_utils_cpp.cpp: use_flash_attention_cpp) -------------------------------------------


def cpu_flash_refusal(m: SdpaMeta, flags: Flags) -> str | None:
    """Why the CPU flash kernel refuses this call, or None if it accepts it."""
    return _first(
        lambda: None if flags.flash else "disabled (sdpa_kernel without FLASH_ATTENTION, or enable_flash_sdp(False))",
        lambda: "nested tensor inputs" if m.nested else None,
        lambda: f"dropout_p={m.dropout_p:g} > 0 (the CPU kernel has no dropout, even under no_grad)"
        if m.dropout_p > 0 else None,
        lambda: _four_d(m),
        lambda: _batch_heads(m),
        lambda: _mask_shape(m),
        lambda: None if m.q.shape[-1] == m.k.shape[-1] == m.v.shape[-1]
        else f"head_dim differs (q {m.q.shape[-1]}, k {m.k.shape[-1]}, v {m.v.shape[-1]})",
        lambda: _nonzero_seq(m),
        lambda: _last_stride(m, ignore_singleton=False),
        lambda: _dtypes(m, (torch.float32, torch.float64, torch.bfloat16, torch.float16)),
    )


# ---- CUDA (cuda/sdp_utils.cpp: can_use_{flash,mem_efficient,cudnn}_attention) --------------------


def _on_cuda(m: SdpaMeta) -> str | None:
    return None if m.device_type == "cuda" else f"inputs on {m.device_type}, not cuda"


def _sm_in(p: DeviceProfile, lo: tuple[int, int], hi: tuple[int, int], what: str) -> str | None:
    if lo <= p.sm <= hi:
        return None
    return f"{what} needs sm{lo[0]}{lo[1]}..sm{hi[0]}{hi[1]}, device is sm{p.sm[0]}{p.sm[1]}"


def _gemm_alignment(m: SdpaMeta, p: DeviceProfile) -> int:
    # minimum_gemm_alignment: tensor cores on sm80+, or sm70+ in half precision, want 128-bit rows.
    half = is_half(m.q.dtype)
    use_tc = p.sm[0] >= 8 or (p.sm[0] >= 7 and half)
    align = 4 if p.sm[0] >= 8 else 1
    return max(align, 128 // (16 if half else 32)) if use_tc else align


def flash_refusal(m: SdpaMeta, p: DeviceProfile, flags: Flags) -> str | None:
    """Why CUDA FlashAttention-2 refuses this call, or None if it accepts it."""
    d = m.q.shape[-1] if m.q.dim else 0
    low = (torch.float16, torch.bfloat16) if p.sm[0] >= 8 else (torch.float16,)
    dtypes = (torch.float8_e4m3fn, *low) if p.sm[0] >= 9 and p.fa3 else low
    return _first(
        lambda: None if p.flash_built else "torch was built without flash attention",
        lambda: None if flags.flash else "disabled (sdpa_kernel without FLASH_ATTENTION, or enable_flash_sdp(False))",
        lambda: _on_cuda(m),
        lambda: _four_d(m),
        lambda: "attn_mask given (flash takes only is_causal)" if m.mask is not None else None,
        lambda: None if m.q.shape[-1] == m.k.shape[-1] == m.v.shape[-1] and d <= 256
        else f"head_dim must match across q/k/v and be <= 256 (q {d}, k {m.k.shape[-1]}, v {m.v.shape[-1]})",
        lambda: _sm_in(p, (8, 0), (12, 1), "flash"),
        lambda: _flash_train_head_dim(m, p, d),
        lambda: f"is_causal with Sq {m.q.shape[-2]} != Sk {m.k.shape[-2]}"
        if m.is_causal and not m.nested and m.q.shape[-2] != m.k.shape[-2] else None,
        lambda: _dtypes(m, dtypes),
        lambda: None if m.nested else _batch_heads(m),
        lambda: None if m.nested else _nonzero_seq(m),
        lambda: None if m.nested else _last_stride(m, ignore_singleton=True),
    )


def _flash_train_head_dim(m: SdpaMeta, p: DeviceProfile, d: int) -> str | None:
    consumer = (8, 6) <= p.sm <= (8, 9) or (12, 0) <= p.sm <= (12, 1)
    if not (m.training and consumer) or d <= 192 or (m.dropout_p == 0 and d > 224):
        return None
    return f"training with head_dim {d} (dropout {m.dropout_p:g}) unsupported on sm{p.sm[0]}{p.sm[1]}"


def efficient_refusal(m: SdpaMeta, p: DeviceProfile, flags: Flags) -> str | None:
    """Why the CUDA memory-efficient (CUTLASS) kernel refuses this call, or None if it accepts it."""
    align = _gemm_alignment(m, p)
    dtypes = (torch.float16, torch.float32, torch.bfloat16) if p.sm[0] >= 8 else (torch.float16, torch.float32)
    return _first(
        lambda: None if p.efficient_built else "torch was built without mem-efficient attention",
        lambda: None if flags.efficient
        else "disabled (sdpa_kernel without EFFICIENT_ATTENTION, or enable_mem_efficient_sdp(False))",
        lambda: _on_cuda(m),
        lambda: _sm_in(p, (5, 0), (12, 1), "mem-efficient"),
        lambda: _four_d(m),
        lambda: _efficient_head_dim(m, align),
        lambda: _efficient_alignment(m, p, align),
        lambda: "nested inputs while training" if m.nested and m.training else None,
        lambda: None if m.nested else _nonzero_seq(m),
        lambda: None if m.nested else _last_stride(m, ignore_singleton=False),
        lambda: None if m.nested else _batch_heads(m),
        lambda: _dtypes(m, dtypes),
    )


def _efficient_head_dim(m: SdpaMeta, align: int) -> str | None:
    dq, dk, dv = m.q.shape[-1], m.k.shape[-1], m.v.shape[-1]
    if dq != dk:
        return f"q/k head_dim differ ({dq} vs {dk})"
    if dq <= 0 or dv <= 0 or dq % align or dv % align:
        return f"head_dim {dq}/{dv} (qk/v) not a multiple of {align}"
    return None


def _efficient_alignment(m: SdpaMeta, p: DeviceProfile, align: int) -> str | None:
    if m.nested or p.sm[0] < 8:
        return None
    bad = [n for n, t in (("q", m.q), ("k", m.k), ("v", m.v)) if t.numel and t.storage_offset % align]
    return f"storage offset of {', '.join(bad)} not {align}-element aligned (a sliced view)" if bad else None


def cudnn_refusal(m: SdpaMeta, p: DeviceProfile, flags: Flags) -> str | None:
    """Why cuDNN attention refuses this call, or None if it accepts it."""
    v = p.cudnn_version
    if v is None:
        return "torch was built without cuDNN attention"
    if v < 90000:
        return f"cuDNN {v} older than 9.0"
    return _first(
        lambda: f"dropout unsupported on cuDNN {v} (9.11-9.13)" if m.dropout_p > 0 and 91100 < v < 91400 else None,
        lambda: None if flags.cudnn else "disabled (sdpa_kernel without CUDNN_ATTENTION, or enable_cudnn_sdp(False))",
        lambda: "nested tensor inputs (experimental, off by default)" if m.nested else None,
        lambda: _on_cuda(m),
        lambda: _four_d(m),
        lambda: "torch.use_deterministic_algorithms(True): cuDNN SDPA is not deterministic"
        if p.deterministic_strict else None,
        lambda: _dtypes(m, (torch.float16, torch.bfloat16) if p.sm[0] >= 8 else (torch.float16,)),
        lambda: _mask_shape(m),
        lambda: _sm_in(p, (8, 0), (12, 1), "cuDNN"),
        lambda: None if m.dropout_p * 16 == int(m.dropout_p * 16)
        else f"dropout_p={m.dropout_p:g} not a multiple of 1/16",
        lambda: _nonzero_seq(m),
        lambda: _last_stride(m, ignore_singleton=True),
        lambda: _batch_heads(m, same_kv_heads=False),
        lambda: _cudnn_shapes(m, p, v),
    )


def _cudnn_shapes(m: SdpaMeta, p: DeviceProfile, v: int) -> str | None:
    b, h, sq, dqk = m.q.shape
    sk, dv = m.k.shape[2], m.v.shape[3]
    if b > 65535 or h > 65535:
        return f"batch {b} or heads {h} > 65535"
    sm90_10x = p.sm == (9, 0) or p.sm[0] == 10
    d256 = sm90_10x and not (p.sm == (10, 7) and v <= 92500) and v > 92200 and p.cudnn_frontend_d256
    limit = 256 if d256 else 192 if sm90_10x and v >= 91100 and (dqk, dv) == (192, 128) else 128
    if dqk > limit or dv > limit:
        return f"head_dim {dqk}/{dv} (qk/v) > {limit} on sm{p.sm[0]}{p.sm[1]} with cuDNN {v}"
    if dqk % 8 or dv % 8:
        return f"head_dim {dqk}/{dv} (qk/v) not a multiple of 8"
    if sk == 1:
        return "key/value sequence length 1"
    if m.dropout_p and sq == 1:
        return "query sequence length 1 with dropout"
    if d256 and m.training and not (max(dqk, dv) <= 128 or (dqk, dv) in ((192, 128), (256, 256))):
        return f"backward unsupported for head_dim {dqk}/{dv} (qk/v)"
    return None
