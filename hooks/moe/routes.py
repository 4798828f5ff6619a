"""Rollout routes: what ``R`` is, how it lines up with a forward, and how to record it from a plain HF rollout.

``R`` is an integer tensor ``[batch, seq, n_routers, top_k]`` of the expert ids the rollout engine chose, routers
in model order (``nanwatch.hooks.moe.routers``); ``-1`` marks a position with no route (padding). ``R[:, t]`` is
the routing at the forward position that produces ``logprobs[:, t]``. Against a trainer forward over ``S_f``
positions, an ``R`` of ``S`` columns covers the positions ``S_f - 1 - S .. S_f - 2`` (the causal shift: the last
position produces no logprob), or all of them when ``S == S_f``. So both layouts line up by themselves: routes of
the completion only (``[B, C]``, as ``logprobs``), and routes of every position the rollout ran (``[B, P + C - 1]``,
what vLLM returns and :func:`record_routes` gives): the last token sampled never ran a forward.

vLLM (``enable_return_routed_experts=True``) returns, per completion, ``CompletionOutput.routed_experts``: an
int32 array ``[num_tokens - 1, num_hidden_layers, top_k]`` read from its KV slots
(``vllm/v1/core/sched/scheduler.py``, ``_get_routed_experts``; ``routed_experts_capturer.py``): row ``p`` is the
routing of position ``p`` of prompt + completion. Stack the completions of a batch, left-aligned as the
trainer's ``input_ids`` are (pad with ``-1``), keep the layers that have a router (``R = routed[:, :,
moe_layers]``: a model with dense layers, such as DeepSeek-V3's first three, has rows for them), and pass it
whole, or its completion columns ``[P - 1, P + C - 1)``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from nanwatch.hooks.moe.routers import Router, experts_input, find_routers

__all__ = ["RouteRecorder", "check_routes", "offset", "record_routes", "spread"]


def offset(s_fwd: int, s: int) -> int | None:
    """The first forward position a tensor of ``s`` columns covers in a forward over ``s_fwd`` positions (the
    causal shift), or None when it cannot line up (longer than the forward)."""
    if s == s_fwd:
        return 0
    return s_fwd - 1 - s if 0 < s < s_fwd else None


def spread(x: torch.Tensor, s_fwd: int, fill: float | int = 0) -> torch.Tensor | None:
    """``x`` (``[B, S, ...]``) placed at its forward positions in a ``[B, s_fwd, ...]`` tensor, ``fill``
    elsewhere (device ops only), or None when it cannot line up."""
    off = offset(s_fwd, x.shape[1])
    if off is None:
        return None
    if off == 0 and x.shape[1] == s_fwd:
        return x
    out = torch.full((x.shape[0], s_fwd, *x.shape[2:]), fill, dtype=x.dtype, device=x.device)
    out[:, off : off + x.shape[1]] = x
    return out


def check_routes(routes: object, routers: list[Router], device: torch.device) -> tuple[torch.Tensor | None, str | None]:
    """``routes`` as a long tensor on ``device`` (ids outside ``[0, experts)`` become -1, no route), or None and
    why it cannot be used: not a 4-D integer tensor, another number of routers or top-k, ids out of range
    (checked on the host where ``routes`` is a host tensor, for free; on a device, they are masked instead:
    reading them would be a sync)."""
    if not routers:
        return None, "the model has no MoE router nanwatch recognises (transformers' *TopKRouter contract)"
    try:
        r = torch.as_tensor(routes)
    except Exception as exc:  # a list of ragged rows, an object array
        return None, f"not a tensor ({type(exc).__name__}: {exc})"
    if r.dim() != 4 or r.dtype.is_floating_point or r.dtype == torch.bool:
        return None, (f"shape {tuple(r.shape)} dtype {r.dtype}: expected an integer tensor [batch, seq, n_routers, "
                      f"top_k]")
    n, k = len(routers), routers[0].top_k
    if r.shape[2] != n or r.shape[3] != k:
        return None, (f"shape {tuple(r.shape)}: this model has {n} routers of top_k {k}, expected "
                      f"[batch, seq, {n}, {k}]")
    experts = torch.tensor([x.experts for x in routers]).view(1, 1, n, 1)
    if r.device.type == "cpu" and r.numel():
        bad = ((r < -1) | (r >= experts)).any()
        if bool(bad):  # sync-ok: a host tensor, read on the host
            return None, "expert ids out of range: each router's ids must lie in [0, experts) (or -1: no route)"
    r = r.to(device=device, dtype=torch.long, non_blocking=True)
    if r.device.type != "cpu":
        r = torch.where((r >= 0) & (r < experts.to(r.device)), r, -1)
    return r, None


class RouteRecorder:
    """The routes a plain HF rollout took (:func:`record_routes`): per forward, each router's selected experts,
    joined along the sequence by :meth:`routes` (device ops; no host read)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.routers = find_routers(model)
        self._forwards: list[list[torch.Tensor | None]] = []
        self._batch: int | None = None

    def _root_pre(self, module, args, kwargs) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        if isinstance(ids, torch.Tensor) and ids.dim() >= 2:
            self._batch = ids.shape[0]
            self._forwards.append([None] * len(self.routers))

    def _routed(self, router: Router, idx: torch.Tensor | None) -> None:
        if idx is not None and self._forwards and self._batch:
            self._forwards[-1][router.index] = idx.detach().reshape(self._batch, -1, idx.shape[-1])

    def install(self, model: torch.nn.Module) -> list:
        """Hooks on ``model`` (its batch size) and on each router's experts (the routes they receive; the
        router's output where no experts module was found); the handles, in order."""
        handles = [model.register_forward_pre_hook(self._root_pre, with_kwargs=True)]
        for r in self.routers:
            if r.experts_module is not None:
                handles.append(r.experts_module.register_forward_pre_hook(
                    lambda m, args, kwargs, r=r: self._routed(r, experts_input(args, kwargs)), with_kwargs=True))
            else:
                handles.append(r.module.register_forward_hook(lambda m, a, out, r=r: self._routed(r, out[2])))
        return handles

    def routes(self) -> torch.Tensor:
        """``[batch, positions, n_routers, top_k]`` (long): every position the rollout's forwards ran, in order
        (a prefill of ``P`` and ``G - 1`` decode steps give ``P + G - 1``), routers in model order."""
        done = [f for f in self._forwards if all(x is not None for x in f)]
        if not done:
            raise RuntimeError("nanwatch: record_routes saw no complete forward of the model's routers")
        return torch.cat([torch.stack(f, dim=2) for f in done], dim=1).long()


@contextlib.contextmanager
def record_routes(model: torch.nn.Module) -> Iterator[RouteRecorder]:
    """Record the routes ``model`` takes inside the block (e.g. ``model.generate(...)``, a plain HF rollout);
    ``.routes()`` gives them in ``R``'s layout, for ``Monitor.rlhf(rollout_routes=)`` or ``Monitor.routes``.

    Example usage::

        with nanwatch.hooks.record_routes(policy) as rec:
            out = policy.generate(prompt_ids, max_new_tokens=64, do_sample=True)
        R = rec.routes()                      # [B, P + 64 - 1, n_routers, top_k]
    """
    rec = RouteRecorder(model)
    handles = rec.install(model)
    try:
        yield rec
    finally:
        for h in reversed(handles):
            h.remove()
