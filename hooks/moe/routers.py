"""Where a model's MoE routers are: a pure reading of its module tree, once, at attach.

transformers 5.x gives every MoE family one router contract: a module with ``top_k`` and ``num_experts`` whose
forward returns ``(router_logits [tokens, experts], routing_weights [tokens, top_k], selected_experts [tokens,
top_k])``, beside a sibling ``experts`` module called as ``experts(hidden, selected_experts, routing_weights)``.
Qwen3-MoE and Qwen2-MoE (``*TopKRouter`` at ``mlp.gate``), Mixtral and OLMoE (``*TopKRouter`` at ``mlp.gate``),
DeepSeek-V3 (``DeepseekV3TopkRouter`` at ``mlp.gate``, sigmoid scores with a grouped top-k) and GPT-OSS
(``GptOssTopKRouter`` at ``mlp.router``, softmax over the top-k logits) all keep it (read from the installed
transformers' modeling files). A module that has the attributes but breaks the contract at run time is warned
about once and left alone (``nanwatch.hooks.moe.taps``).

Routers are numbered in model order (``named_modules``), which is the order of ``R``'s router axis.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["Router", "experts_input", "find_routers"]


@dataclass(frozen=True, slots=True)
class Router:
    """One MoE router: its site name, its place on ``R``'s router axis, and its sibling experts module."""

    name: str
    index: int
    module: torch.nn.Module
    experts: int
    top_k: int
    #: the module that receives the routes (``experts(hidden, selected_experts, weights)``), if found
    experts_module: torch.nn.Module | None
    #: DeepSeek-V3's sigmoid scores (renormalised, scaled) rather than a softmax over the logits
    sigmoid: bool = False
    scale: float = 1.0


def _experts(module: torch.nn.Module) -> int | None:
    for attr in ("num_experts", "num_local_experts", "n_routed_experts"):
        n = getattr(module, attr, None)
        if isinstance(n, int) and n > 0:
            return n
    return None


def _is_router(module: torch.nn.Module) -> bool:
    cls = type(module).__name__
    top_k = getattr(module, "top_k", None)
    weight = getattr(module, "weight", None)
    return ("Router" in cls and isinstance(top_k, int) and top_k > 0 and _experts(module) is not None
            and isinstance(weight, torch.Tensor) and weight.dim() == 2)


def find_routers(model: torch.nn.Module) -> list[Router]:
    """Every MoE router of ``model``, in model order (``R``'s router axis), with its experts module."""
    parents = {id(child): parent for parent in model.modules() for child in parent.children()}
    found = []
    for name, module in model.named_modules():
        if not _is_router(module):
            continue
        parent = parents.get(id(module))
        experts = getattr(parent, "experts", None) if parent is not None else None
        found.append(Router(
            name=name or type(module).__name__, index=len(found), module=module, experts=_experts(module),
            top_k=module.top_k, experts_module=experts if isinstance(experts, torch.nn.Module) else None,
            sigmoid=hasattr(module, "e_score_correction_bias"),
            scale=float(getattr(module, "routed_scaling_factor", 1.0) or 1.0)))
    return found


def experts_input(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The routes an experts module was called with: ``experts(hidden, selected_experts, weights)``, by
    position or by the name transformers' families give it."""
    idx = args[1] if len(args) > 1 else kwargs.get("top_k_index", kwargs.get("router_indices"))
    return idx if isinstance(idx, torch.Tensor) and idx.dim() == 2 and not idx.is_floating_point() else None
