"""Small real models for nanwatch's own tests and examples. Nothing in the product imports this module."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Mixer", "TinyNet"]


class Mixer(nn.Module):
    """Self-attention by another name: it calls ``F.scaled_dot_product_attention`` itself, and its class
    name matches none of nanwatch's attention patterns, so its site comes from the caller's FQN."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, d))


class TinyNet(nn.Module):
    """Embedding, two residual Mixer blocks, a head: the smallest language-model-shaped net."""

    def __init__(self, vocab: int = 64, dim: int = 32) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList([Mixer(dim), Mixer(dim)])
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(input_ids)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)
