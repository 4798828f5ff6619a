"""A step's MoE record decoded into the report's :class:`~nanwatch.wire.MoeStat`, and the routing events told
from it: reporter thread, host side, from the values the step's one copy brought (no device read).

Events (``MoeStat.events``):

* ``routing_replay_not_applied``: under ``routing_replay="verify"`` or ``"apply"``, a token reached experts other
  than the rollout's. Told on the first such step, and again after a clean one; the page is Prometheus's
  (``NanwatchRoutingReplayNotApplied``, on ``nanwatch_moe_replay_not_applied``).
* ``routing_disagreement``: without replay, the worst router disagrees with the rollout on more than
  :data:`DISAGREEMENT_EVENT` of the tokens (Megatron-LM #4168: about 10 % of routers disagree per forward without
  replay, and GRPO on Qwen3-30B-A3B collapsed). Told when it sets in, and again after it came back under.

A drift in the rollout mismatch, when routes were compared, says how much of it the routing explains
(:func:`explained`): ``MoeStat.routing_explains``.
"""

from __future__ import annotations

import math

from nanwatch.wire import MAX_ROLLOUT_FIGURE, MoeStat, RolloutEvent, RouterStat, RoutingEvent

__all__ = ["DISAGREEMENT_EVENT", "RoutingTeller", "explained", "moe_layout", "moe_stat", "moe_vectors", "read_moe"]

#: The per-router disagreement above which (without replay) a ``routing_disagreement`` event is told; the alert
#: ``NanwatchRoutingDisagreement`` uses the same figure, sustained.
DISAGREEMENT_EVENT = 0.05


def moe_stat(record, slot, logits, step: int) -> MoeStat | None:
    """The step's :class:`MoeStat` from its record (``StepState.moe``: a ``MoeStep``, or None when no router ran),
    its slots (``StepStats.slot``) and its logit figures (the routers' ``router`` sites); events told."""
    if record is None or not record.seen:
        return None
    taps = record.taps
    tops = {lg.layer: lg.bound for lg in logits if lg.source == "router"}
    routers = []
    for r in taps.routers:
        if r.index not in record.seen:
            continue
        load = [int(slot("sum", k)) for k in (("moe", r.name, "load", e) for e in range(r.experts))]
        top = tops.get(r.name)
        routers.append(RouterStat(router=r.name, top_k=r.top_k, load=load,
                                  logit_max=top if top is not None and math.isfinite(top) else None,
                                  compared=int(slot("sum", ("moe", r.name, "compared"))),
                                  differing=int(slot("sum", ("moe", r.name, "differing")))))
    stat = MoeStat(routing_replay=taps.routing_replay, routers=routers,
                   tokens_compared=int(slot("sum", ("moe", "tokens_compared"))),
                   tokens_rerouted=int(slot("sum", ("moe", "tokens_rerouted"))),
                   rerouted_abs_dlogp=min(slot("sum", ("moe", "rerouted_dlogp")), MAX_ROLLOUT_FIGURE),
                   rerouted_scored=int(slot("sum", ("moe", "rerouted_scored"))),
                   agreeing_abs_dlogp=min(slot("sum", ("moe", "agreeing_dlogp")), MAX_ROLLOUT_FIGURE),
                   agreeing_scored=int(slot("sum", ("moe", "agreeing_scored"))))
    if taps.teller is None:
        taps.teller = RoutingTeller()
    events = taps.teller.observe(step, stat)
    return stat.model_copy(update={"events": events}) if events else stat


class RoutingTeller:
    """Turns each step's :class:`MoeStat` into routing events (reporter thread only)."""

    def __init__(self) -> None:
        self._not_applied = False  # told, and no clean step since
        self._disagreeing = False

    def observe(self, step: int, stat: MoeStat) -> list[RoutingEvent]:
        if not stat.tokens_compared:
            return []
        worst = sorted((r for r in stat.routers if r.differing), key=lambda r: -(r.disagreement or 0.0))
        fraction = stat.rerouted_fraction or 0.0
        names = ", ".join(f"{r.router} {r.disagreement:.1%}" for r in worst[:4])
        more = f" and {len(worst) - 4} more" if len(worst) > 4 else ""
        if stat.routing_replay != "off":
            if not worst:
                self._not_applied = False
                return []
            if self._not_applied:
                return []
            self._not_applied = True
            return [RoutingEvent(
                kind="routing_replay_not_applied", step=step, routers=[r.router for r in worst[:16]],
                fraction=fraction,
                evidence=f"routing_replay={stat.routing_replay}: {fraction:.1%} of {stat.tokens_compared} tokens reached "
                         f"experts other than the rollout's: {names}{more}")]
        top = worst[0].disagreement if worst else 0.0
        if not top or top <= DISAGREEMENT_EVENT:
            self._disagreeing = False
            return []
        if self._disagreeing:
            return []
        self._disagreeing = True
        return [RoutingEvent(
            kind="routing_disagreement", step=step, routers=[r.router for r in worst[:16]], fraction=fraction,
            evidence=f"{fraction:.1%} of {stat.tokens_compared} tokens took another expert in at least one router "
                     f"than the rollout did; worst: {names}{more} (routing replay, R3, removes it)")]


def explained(events: list[RolloutEvent], moe: MoeStat | None) -> list[RolloutEvent]:
    """``events`` with each drift saying how much of the mismatch the routing explains, when routes were
    compared with the rollout's logprobs given."""
    share = moe.routing_explains if moe is not None else None
    if share is None:
        return events
    out = []
    for e in events:
        if e.cause == "drift":
            e = e.model_copy(update={
                "figures": {**e.figures, "routing_explains": share},
                "evidence": f"{e.evidence}; routing explains {share:.0%} of the mismatch "
                            f"({moe.tokens_rerouted} of {moe.tokens_compared} tokens rerouted)"})
        out.append(e)
    return out


# ---- job reports: the layout of a step's MoE figures in the job's SUM and MAX vectors ---------------------------
_STEP_SUMS = ("tokens_compared", "tokens_rerouted", "rerouted_abs_dlogp", "rerouted_scored", "agreeing_abs_dlogp",
              "agreeing_scored")


def moe_layout(moe: MoeStat | None) -> tuple[tuple[str, int, int], ...]:
    """``(router, experts, top_k)`` per router the step measured: the MoE part of a job's table."""
    return tuple((r.router, r.experts, r.top_k) for r in moe.routers) if moe is not None else ()


def moe_vectors(moe: MoeStat | None, layout: tuple[tuple[str, int, int], ...]) -> tuple[list[float], list[float]]:
    """This rank's MoE figures laid out by the job's ``layout``: (SUM part, MAX part); zeros and "none" for a
    router this rank did not measure."""
    mine = {r.router: r for r in moe.routers} if moe is not None else {}
    sums: list[float] = [1.0 if moe is not None else 0.0]
    maxes: list[float] = []
    for name, experts, _ in layout:
        r = mine.get(name)
        ok = r is not None and r.experts == experts
        sums += [*(r.load if ok else [0] * experts), r.compared if ok else 0, r.differing if ok else 0]
        maxes.append(r.logit_max if ok and r.logit_max is not None else -math.inf)
    sums += [getattr(moe, k) if moe is not None else 0.0 for k in _STEP_SUMS]
    return sums, maxes


def read_moe(layout: tuple[tuple[str, int, int], ...], take_sums, take_maxes, *,
             poster: MoeStat | None) -> MoeStat | None:
    """The job's :class:`MoeStat` from the reduced vectors (``take_sums(n)``/``take_maxes(n)`` read them in the
    order :func:`moe_vectors` wrote); the poster's replay mode and events (told from its own view)."""
    (present,) = take_sums(1)
    routers = []
    for name, experts, top_k in layout:
        *load, compared, differing = (int(x) for x in take_sums(experts + 2))
        (top,) = take_maxes(1)
        routers.append(RouterStat(router=name, top_k=top_k, load=load, compared=compared, differing=differing,
                                  logit_max=top if math.isfinite(top) else None))
    step = dict(zip(_STEP_SUMS, take_sums(len(_STEP_SUMS)), strict=True))
    if not present:
        return None
    for k in ("tokens_compared", "tokens_rerouted", "rerouted_scored", "agreeing_scored"):
        step[k] = int(step[k])
    for k in ("rerouted_abs_dlogp", "agreeing_abs_dlogp"):
        step[k] = min(step[k], MAX_ROLLOUT_FIGURE)
    return MoeStat(routing_replay=poster.routing_replay if poster is not None else "off", routers=routers,
                   events=poster.events if poster is not None else [], **step)
