"""The MoE routers measured, compared and replayed, on the device, in the step (training thread).

Per router and forward: the routes the experts received (their ``top_k_index`` input, after any replay) are
counted per expert into sum slots with one ``index_add_`` (the step's load, summed over forwards; ranks sum
too), and kept by reference for the step-end comparison; the router's logits are a ``router`` site (the
coarse site when ``coarse`` is on, else measured here): one ``aminmax``, which gives the logit max and names a
NaN born in a router there. Nothing is read on the host.

Rollout routes (``Monitor.routes(R)``, ``Monitor.rlhf(rollout_routes=R)``) are compared once, at the step's end,
with the last training forward whose tokens line up (``nanwatch.hooks.moe.routes``): per router, the unmasked
tokens whose expert set differs (sorted along top-k, so order-insensitive); per step, tokens with any router
differing; and, with ``rollout_logprobs``, |Δlogp| summed apart over rerouted and agreeing tokens (the
attribution). Under ``routing_replay="apply"`` the router's output is replaced: the rollout's experts, with the
trainer's own probabilities over them (renormalised where the router renormalises its top-k; DeepSeek-V3's
sigmoid scores, renormalised and scaled); the routes its routers chose are kept too, and the comparison counts the
tokens they sent elsewhere than the rollout (``TOKENS_OWN_REROUTED``, a report figure): what the replay corrected,
which the experts' input, the rollout's by then, no longer shows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from nanwatch.hooks.failsafe import contained, probe_failed
from nanwatch.hooks.instrument.probes import Probes, recomputing
from nanwatch.hooks.measure.figures import figure
from nanwatch.hooks.moe.routers import Router, experts_input, find_routers
from nanwatch.hooks.moe.routes import check_routes, offset, spread

__all__ = ["TOKENS_OWN_REROUTED", "MoeStep", "MoeTaps"]

#: Under ``routing_replay="apply"``: the compared tokens whose trainer's own routers (before the replay) chose
#: another expert set than the rollout's in at least one router (``MoeStat.tokens_own_rerouted``; ranks sum).
TOKENS_OWN_REROUTED = figure("moe.tokens_own_rerouted", how="sum", integer=True)

_is_compiling = torch.compiler.is_compiling


@dataclass(slots=True)
class MoeStep:
    """One step's MoE record, host side (``StepState.moe``): which routers ran, whether routes were compared."""

    taps: MoeTaps
    seen: set[int] = field(default_factory=set)
    compared: bool = False


@dataclass(slots=True)
class _Given:
    """Rollout routes given in the open step: on the device, with the mask and |Δlogp| of ``rlhf``, if any."""

    routes: torch.Tensor
    mask: torch.Tensor | None = None
    abs_dlogp: torch.Tensor | None = None


class MoeTaps:
    """The MoE part of one Monitor: its routers (found once) and their hooks, the routes given in the open step.

    Example usage::

        taps = MoeTaps(model, probes, routing_replay="verify", warn=warn)
        handles = taps.install()
        taps.give(R)                          # Monitor.routes(R), or rlhf(rollout_routes=R)
        ...                                   # forwards
        taps.step_end()                       # the comparison, into the step's slots
    """

    def __init__(self, model: torch.nn.Module, probes: Probes, *, routing_replay: str, warn) -> None:
        self.routers = find_routers(model)
        self.routing_replay = routing_replay
        self._p, self._warn = probes, warn
        self._device = next((r.module.weight.device for r in self.routers), torch.device("cpu"))
        self._given: _Given | None = None
        self._kept: dict[int, torch.Tensor] = {}  # router index -> the last training forward's routes
        self._own: dict[int, torch.Tensor] = {}  # under apply: the same forward's routes as its routers chose them
        self._ones: dict[tuple[int, torch.device], torch.Tensor] = {}
        self._load_keys = {r.index: tuple(("moe", r.name, "load", e) for e in range(r.experts)) for r in self.routers}
        self._broken: set[int] = set()  # routers that broke the contract at run time (warned once)
        self._compare_keys = (*(("moe", r.name, "compared") for r in self.routers),
                              *(("moe", r.name, "differing") for r in self.routers))
        #: reporter thread only: the routing events' memory (``nanwatch.hooks.moe.report.RoutingTeller``)
        self.teller = None

    # ---- install ------------------------------------------------------------------------------------
    def install(self) -> list:
        """Hooks on every router (its output; the logits site unless a coarse site measures it; apply) and on
        its experts module (the routes it receives); the handles, in order."""
        handles = []
        try:
            for r in self.routers:
                # not always_call: a router whose forward raised has no routes to measure or replace
                handles.append(r.module.register_forward_hook(lambda m, args, out, r=r: self._router_post(r, out)))
                if r.experts_module is not None:
                    handles.append(r.experts_module.register_forward_pre_hook(
                        lambda m, args, kwargs, r=r: contained(self._routed, r, experts_input(args, kwargs)),
                        with_kwargs=True))
        except BaseException:
            for h in reversed(handles):
                h.remove()
            raise
        return handles

    # ---- routes given ------------------------------------------------------------------------------
    def give(self, routes: object, *, mask: torch.Tensor | None = None, logprobs: torch.Tensor | None = None,
             rollout_logprobs: torch.Tensor | None = None, source: str = "routes") -> None:
        """Rollout routes for the open step (``source`` names the call in a warning); with ``rlhf``'s mask and
        both logprob sets, the comparison also splits |Δlogp| over rerouted and agreeing tokens. A bad
        ``routes`` is one warning and nothing else: never an exception into the training loop."""
        r, why = check_routes(routes, self.routers, self._device)
        if r is None:
            self._warn(f"{source} ignored: {why}")
            return
        if mask is None and isinstance(logprobs, torch.Tensor) and logprobs.dim() == 2:
            # rlhf without a mask: its tokens are the logprobs' columns, not every position R covers (a prompt)
            mask = torch.ones(logprobs.shape, dtype=torch.bool, device=logprobs.device)
        dl = None
        if (isinstance(logprobs, torch.Tensor) and isinstance(rollout_logprobs, torch.Tensor)
                and logprobs.shape == rollout_logprobs.shape and logprobs.dim() == 2):
            dl = (logprobs.detach().double() - rollout_logprobs.detach().to(logprobs.device).double()).abs()
        self._given = _Given(r, mask.detach() if isinstance(mask, torch.Tensor) else None, dl)

    # ---- hot path ------------------------------------------------------------------------------------
    def _router_post(self, r: Router, out):
        """The router's output: its logits measured, its routes replaced under ``apply``. Contained: a failure
        is a warning and the router's own output stands."""
        try:
            return self._router_output(r, out)
        except Exception as exc:
            probe_failed(exc)
            return None

    def _router_output(self, r: Router, out):
        p = self._p
        if not p.active or _is_compiling() or r.index in self._broken:
            return None
        if not (isinstance(out, tuple) and len(out) == 3 and all(isinstance(t, torch.Tensor) for t in out)):
            self._broken.add(r.index)
            self._warn(f"MoE router {r.name} returned {type(out).__name__}, not (router_logits, routing_weights, "
                       "selected_experts): not measured")
            return None
        logits, weights, idx = out
        stage = p.stage()
        if p.measuring and id(r.module) not in p.coarse_ids:
            contained(p.site, r.name, "router", logits)
        if self.routing_replay == "apply" and self._given is not None and stage != "generate":
            if stage == "train" and p.measuring and not recomputing():  # the trainer's own routes, before replay
                self._own[r.index] = idx.detach()
            replaced = _apply(r, self._given.routes, logits, weights, idx)
            if replaced is None:
                p.rec.warn(f"routing_replay=apply: the routes given ({tuple(self._given.routes.shape[:2])}) do not "
                           f"line up with this forward's {idx.shape[0]} tokens at {r.name}: not applied")
            else:
                out = replaced
        if r.experts_module is None:
            contained(self._routed, r, out[2])
        return out

    def _routed(self, r: Router, idx: torch.Tensor | None) -> None:
        """The routes ``r``'s experts received in this forward: counted per expert, kept for the comparison."""
        p = self._p
        if idx is None or not p.measuring or _is_compiling() or recomputing():
            return
        stage = p.stage()
        if stage == "generate":
            return
        rec = p.rec
        m = rec.state.moe
        if m is None:
            m = rec.state.moe = MoeStep(self)
        m.seen.add(r.index)
        flat = idx.reshape(-1)
        key = (flat.numel(), flat.device)
        ones = self._ones.get(key)
        if ones is None:
            ones = self._ones[key] = torch.ones(flat.numel(), dtype=rec.acc_dtype, device=rec.buf.device)
        rec.slot(self._load_keys[r.index], ones, how="sum", many=True, at=flat)
        if stage == "train":
            self._kept[r.index] = idx.detach()

    # ---- step end ----------------------------------------------------------------------------------
    def step_end(self) -> None:
        """Compare the routes given in the step with the last training forward's, into the step's slots (device
        ops only); then forget both (routes apply within one step)."""
        given, kept, own, self._given, self._kept, self._own = self._given, self._kept, self._own, None, {}, {}
        rec = self._p.rec
        if given is None:
            if self.routing_replay != "off" and kept:
                rec.warn(f"routing_replay={self.routing_replay}, but no rollout routes were given this step "
                         "(Monitor.routes(R) or rlhf(rollout_routes=R)): nothing was verified")
            return
        if len(kept) != len(self.routers):
            if kept or self.routing_replay != "off":
                rec.warn("rollout routes were given, but not every router ran in a training forward this step: "
                         "not compared")
            return
        contained(self._compare, given, kept, own)

    def _compare(self, given: _Given, kept: dict[int, torch.Tensor], own: dict[int, torch.Tensor]) -> None:
        rec = self._p.rec
        R = given.routes
        B, S = R.shape[:2]
        T = kept[0].shape[0]
        s_fwd = T // B if B else 0
        off = offset(s_fwd, S) if B and T == B * s_fwd else None
        if off is None:
            rec.warn(f"rollout routes {tuple(R.shape)} do not line up with the step's last forward over {T} tokens "
                     "(R is [batch, seq] of logprobs, or of the forward's positions): not compared")
            return
        ok = (R >= 0).all(dim=-1).all(dim=-1)  # [B, S]: a position with a route for every router
        if given.mask is not None:
            mask = spread(given.mask.to(R.device).bool(), s_fwd, False)
            if mask is None:
                rec.warn(f"the mask {tuple(given.mask.shape)} does not line up with the forward: not compared")
                return
            ok = ok & mask[:, off : off + S]
        # every router at once: [B, S, n_routers, top_k], sorted along top-k (order-insensitive), one compare
        given_sorted = R.sort(dim=-1).values

        def differing(routes: dict[int, torch.Tensor]) -> torch.Tensor:  # [B, S, n]: a token's set differs
            mine = torch.stack([routes[r.index].reshape(B, s_fwd, -1)[:, off : off + S].long() for r in self.routers],
                               dim=2)
            return (mine.sort(dim=-1).values != given_sorted).any(dim=-1) & ok[..., None]

        differ = differing(kept)
        anyd = differ.any(dim=-1)
        n = ok.sum()
        if len(own) == len(self.routers) and all(o.shape == kept[i].shape for i, o in own.items()):
            # under apply: what the replay corrected, the tokens the trainer's own routers sent elsewhere
            rec.figure(TOKENS_OWN_REROUTED, differing(own).any(dim=-1).sum().to(rec.acc_dtype))
        rec.slot(self._compare_keys, torch.cat([n.expand(len(self.routers)), differ.sum(dim=(0, 1))]),
                 how="sum", many=True)
        counts = [n, anyd.sum()]
        if given.abs_dlogp is not None:
            dl = spread(given.abs_dlogp.to(R.device), s_fwd, float("nan"))
            if dl is not None:
                dl = dl[:, off : off + S]
                scored = ok & (dl.abs() < float("inf"))
                d0 = torch.where(scored, dl, torch.zeros_like(dl)).double()
                rer, agree = scored & anyd, scored & ~anyd
                counts += [(d0 * rer).sum(), rer.sum(), (d0 * agree).sum(), agree.sum()]
        keys = (("moe", "tokens_compared"), ("moe", "tokens_rerouted"), ("moe", "rerouted_dlogp"),
                ("moe", "rerouted_scored"), ("moe", "agreeing_dlogp"), ("moe", "agreeing_scored"))[: len(counts)]
        rec.slot(keys, torch.stack([c.to(rec.acc_dtype) for c in counts]), how="sum", many=True)
        m = rec.state.moe
        if m is None:
            m = rec.state.moe = MoeStep(self)
        m.compared = True


def _apply(r: Router, R: torch.Tensor, logits: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor):
    """The router's output with the rollout's experts (R3), or None when ``R`` does not line up with it."""
    B, S = R.shape[:2]
    T, k = idx.shape
    s_fwd = T // B if B else 0
    off = offset(s_fwd, S) if B and T == B * s_fwd else None
    if off is None:
        return None
    routes = idx.reshape(B, s_fwd, k).clone()
    mine = routes[:, off : off + S]
    given = R[:, :, r.index]
    routes[:, off : off + S] = torch.where(given >= 0, given, mine)
    routes = routes.reshape(T, k)
    scores = logits.float().sigmoid() if r.sigmoid else logits.float().softmax(dim=-1)
    w = scores.gather(1, routes)
    if getattr(r.module, "norm_topk_prob", True):  # Mixtral, GPT-OSS (a softmax over the top-k) always do
        w = w / w.sum(dim=-1, keepdim=True).clamp_min(1e-20)
    return logits, (w * r.scale).to(weights.dtype), routes.to(idx.dtype)
