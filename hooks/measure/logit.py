"""Max attention logit: the exact per-head maximum, computed in bounded-memory chunks.

The cheap every-step figure is the bound from a fused kernel's saved log-sum-exp (rowmax <= lse <=
rowmax + log(n_valid)); this module gives the exact value for sampled steps, and for the math path,
where no log-sum-exp is saved. It costs about one attention forward, so it never runs every step.
"""

from __future__ import annotations

import math

import torch

__all__ = ["exact_max_logit"]


def _as_4d(x: torch.Tensor) -> torch.Tensor:
    # SDPA takes (N..., H, L, E) or (N..., L, E); fold the leading dims into one batch dim.
    if x.dim() == 3:
        return x.unsqueeze(1)
    return x.reshape(-1, *x.shape[-3:])


@torch.no_grad()
def exact_max_logit(
    query: torch.Tensor,
    key: torch.Tensor,
    *,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    chunk_elems: int = 1 << 24,
) -> torch.Tensor:
    """Per-head max of ``scale * q.k + mask`` over unmasked positions, as a float32 tensor of shape [H].

    Query rows are processed in chunks so that at most about ``chunk_elems`` scores exist at once.
    Grouped-query attention (fewer key heads than query heads) is handled by grouping, not by copying K.
    A head whose every position is masked reports -inf.
    """
    q = _as_4d(query.detach()).float()
    k = _as_4d(key.detach()).float()
    batch, hq, n_q, dim = q.shape
    hk, n_k = k.shape[1], k.shape[2]
    if hq % hk:
        raise ValueError(f"query heads ({hq}) must be a multiple of key heads ({hk})")
    groups = hq // hk
    scale = 1.0 / math.sqrt(dim) if scale is None else scale
    kt = k.transpose(-1, -2).unsqueeze(2)  # [B, Hk, 1, D, S]
    mask = None if attn_mask is None else attn_mask.detach()
    rows = max(1, chunk_elems // max(1, batch * hq * n_k))
    best = torch.full((hq,), -math.inf, dtype=torch.float32, device=q.device)
    for start in range(0, n_q, rows):
        stop = min(n_q, start + rows)
        qc = q[:, :, start:stop].reshape(batch, hk, groups, stop - start, dim)
        s = torch.matmul(qc, kt).mul_(scale).reshape(batch, hq, stop - start, n_k)
        if is_causal:  # SDPA's is_causal is aligned top-left: row i sees keys 0..i
            r = torch.arange(start, stop, device=q.device).unsqueeze(1)
            c = torch.arange(n_k, device=q.device).unsqueeze(0)
            s.masked_fill_(c > r, -math.inf)
        if mask is not None:
            m = mask if mask.shape[-2] == 1 else mask[..., start:stop, :]
            if m.dtype == torch.bool:
                s.masked_fill_(~m, -math.inf)
            else:
                s.add_(m.float())
        best = torch.maximum(best, s.amax(dim=(0, 2, 3)))
    return best
