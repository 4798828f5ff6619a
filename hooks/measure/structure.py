"""Where to put the coarse localisation sites: a pure reading of the model's module tree.

A NaN born between two attention layers used to be blamed on the next one. With a site at the output of
every decoder block (the residual stream) and of each of its direct parts (attention, MLP or MoE block,
norms), plus the input embedding and the final norm, the first offender is the part where the value
first appeared; MoE blocks add their router (its logits also give a logit max) and experts. The drill-down
on the incident (``nanwatch.hooks.forensics.rerun``) then pins the exact module and parameter.

Decoder blocks are the modules HF names in ``_no_split_modules``; otherwise the elements of the longest
``ModuleList`` of same-class modules.
"""

from __future__ import annotations

import re

import torch

__all__ = ["coarse_sites"]

_MLP = re.compile(r"(mlp|moe|feedforward|ffn|sparse)", re.IGNORECASE)
_NORM = re.compile(r"norm", re.IGNORECASE)
_ROUTER = re.compile(r"(router|gate)$", re.IGNORECASE)
_EXPERTS = re.compile(r"(experts?|shared_expert)$", re.IGNORECASE)


def _blocks(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    names = set(getattr(model, "_no_split_modules", None) or ())
    found = [(n, m) for n, m in model.named_modules() if n and type(m).__name__ in names]
    if found:
        return found
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 1
             and len({type(x) for x in m}) == 1]
    if not lists:
        return []
    name, longest = max(lists, key=lambda nm: len(nm[1]))
    return [(f"{name}.{i}", m) for i, m in enumerate(longest)]


def _kind(name: str, module: torch.nn.Module) -> str:
    cls = type(module).__name__
    if _NORM.search(cls):
        return "norm"
    if _MLP.search(cls) or _MLP.search(name.rsplit(".", 1)[-1]) or hasattr(module, "experts"):
        return "mlp"
    return "module"


def coarse_sites(model: torch.nn.Module, fqns: dict[int, str], skip: set[int]) -> list[tuple[str, str, torch.nn.Module]]:
    """``(site, kind, module)`` for every coarse site, in no particular order (execution order comes
    from the hooks). ``skip``: ids of modules measured already (attention, the output head)."""
    out: list[tuple[str, str, torch.nn.Module]] = []

    def add(module: torch.nn.Module, kind: str) -> None:
        if id(module) not in skip and id(module) in fqns:
            out.append((fqns[id(module)], kind, module))
            skip.add(id(module))

    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if isinstance(embed, torch.nn.Module):
        add(embed, "embedding")
    blocks = _blocks(model)
    parents = set()
    for name, block in blocks:
        add(block, "block")
        parents.add(name.rsplit(".", 2)[0] if name.count(".") >= 2 else "")
        for child_name, child in block.named_children():
            kind = _kind(child_name, child)
            add(child, kind)
            if kind == "mlp":  # MoE: the router's logits and the experts' output
                for part_name, part in child.named_children():
                    if _ROUTER.search(part_name) or "Router" in type(part).__name__:
                        add(part, "router")
                    elif _EXPERTS.search(part_name):
                        add(part, "expert")
    # the final norm: a norm beside the blocks' list (HF: model.norm)
    for parent in parents:
        prefix = f"{parent}." if parent else ""
        for name, module in model.named_modules():
            if name.startswith(prefix) and name.count(".") == prefix.count(".") and _NORM.search(type(module).__name__):
                add(module, "norm")
    return out
