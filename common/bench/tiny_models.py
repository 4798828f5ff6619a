"""Tiny HF causal LMs built from configs (never downloaded): the model of ``nanwatch demo`` and
``nanwatch bench``. torch and transformers are imported inside the builders, so importing this module
costs nothing (the collector side may import it without either).

Example usage::

    model = tiny_qwen3("eager", dtype=torch.float16, num_hidden_layers=2)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["TINY_QWEN3", "tiny_causal_lm", "tiny_qwen3"]

#: The default tiny Qwen3: 2 layers, 4 query / 2 key-value heads of 16 (grouped-query attention).
TINY_QWEN3: dict[str, Any] = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=256)


def tiny_causal_lm(config_cls: type, model_cls: type, *, impl: str = "sdpa", dtype: torch.dtype | None = None,
                   seed: int = 0, **config: Any) -> torch.nn.Module:
    """``model_cls(config_cls(attn_implementation=impl, **config))``, its weights drawn after
    ``torch.manual_seed(seed)`` so that a seed names one model."""
    import torch

    torch.manual_seed(seed)
    model = model_cls(config_cls(attn_implementation=impl, **config))
    return model if dtype is None else model.to(dtype)


def tiny_qwen3(impl: str = "sdpa", *, dtype: torch.dtype | None = None, seed: int = 0,
               **overrides: Any) -> torch.nn.Module:
    """A ``Qwen3ForCausalLM`` of :data:`TINY_QWEN3`, with ``overrides`` applied to the config."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return tiny_causal_lm(Qwen3Config, Qwen3ForCausalLM, impl=impl, dtype=dtype, seed=seed,
                          **{**TINY_QWEN3, **overrides})
