"""The wire schema: the one module the trainer (nanwatch.hooks) and the collector (nanwatch.monitor) share.

It imports pydantic and nothing else, so the collector never pulls in torch and the trainer never pulls in
the web stack. Every fact of the contract is defined here once (the run-id alphabet, the modes, the
half-precision dtypes, the integer bound) and both sides derive theirs from it.

Non-finite floats are the data being monitored, so they must survive the trip exactly: models serialise
NaN/+Inf/-Inf as the JSON constants ``NaN``/``Infinity``/``-Infinity`` (what Python's ``json`` module
reads and writes) and never as ``null``.
"""

from __future__ import annotations

from typing import Annotated, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator, model_validator

__all__ = [
    "HALF_DTYPES",
    "MAX_INT",
    "MAX_ROLLOUT_COUNT",
    "MAX_ROLLOUT_FIGURE",
    "MODES",
    "RUN_ID_PATTERN",
    "RunId",
    "SCHEMA_MAJOR",
    "SCHEMA_VERSION",
    "Backend",
    "Coverage",
    "Directive",
    "DirectiveSpec",
    "Fingerprint",
    "Incident",
    "IncidentClass",
    "LogitStat",
    "Mode",
    "Phase",
    "ReportBatch",
    "ReportScope",
    "MismatchCause",
    "ModuleShare",
    "MoeStat",
    "RouterStat",
    "RoutingEvent",
    "RoutingEventKind",
    "RoutingReplay",
    "RlhfStat",
    "Spike",
    "RolloutAttribution",
    "RolloutEvent",
    "RolloutStat",
    "SdpaCall",
    "SiteKind",
    "SiteName",
    "SiteStat",
    "Stage",
    "StepReport",
    "MAX_WEIGHT_TENSORS",
    "WeightFingerprints",
    "dtype_name",
    "is_half",
    "schema_major",
]

SCHEMA_MAJOR = 1
SCHEMA_VERSION = f"{SCHEMA_MAJOR}.17"  # 1.1 stages, coverage; 1.2 guard, incidents, cadence; 1.3 birth sites;
#                                        1.4 job-level reports (scope), the guard's cross-rank verdict;
#                                        1.5 report stage (eval reports), raised, optimizer phase, birth kind;
#                                        1.6 final (a rank ended normally), loss scaling (scaler_overflow, scale)
#                                        1.7 Incident.capsule (where the incident capsule was written)
#                                        1.8 rollout mismatch (RlhfStat.rollout, rollout_events, attribution)
#                                        1.9 replica_divergence incidents (ranks, hosts, params), spikes
#                                        1.10 Coverage.coarse_skipped (coarse sites one step in coarse_every)
#                                        1.11 Coverage.coarse_skipped gone: every localising site is read every
#                                             step (a rotation cost the module of birth for one-off faults)
#                                        1.12 WeightFingerprints: dtypes and shapes (each side's), casts (the
#                                             trainer's weights as a rollout loads them), incarnation (binds a
#                                             trainer set to the run's reporting rank)
#                                        1.13 RolloutStat bounded (#37): finite figures, |dlogp| ones >= 0 and
#                                             <= MAX_ROLLOUT_FIGURE, fractions in [0, 1], the correlation in
#                                             [-1, 1], counts <= MAX_ROLLOUT_COUNT (one rank's step);
#                                             RolloutStat.fit_residual_rms (a temperature's line, told from
#                                             other weights' scatter)
#                                        1.14 Incident.device (the replay hint's --device)
#                                        1.15 MismatchCause stale_weights and shift (#36: the weight
#                                             sync's verdicts classify a mismatch)
#                                        1.16 StepReport.moe (#39): MoE routers' load, logit max, and their
#                                             disagreement with the rollout's routes; routing events
#                                        1.17 MoeStat.tokens_own_rerouted (#38): under routing_replay=apply, the
#                                             tokens the trainer's own routers sent elsewhere than the rollout

#: Who a report speaks for. ``rank``: one rank's own report (every pre-1.4 sender). ``job``: the job's
#: report for a step, per-site figures reduced over ``ranks_reporting`` ranks, posted by one rank.
#: ``detail``: a rank's own report, sent beside the job report because it differs (a non-finite value,
#: another SDPA backend, another attention mode): it names rank and layer, and its run-level figures are
#: already in the job report. ``heartbeat``: a rank's low-rate liveness in job mode (no measurements).
ReportScope = Literal["rank", "job", "detail", "heartbeat"]

#: Where a tensor was seen: the forward output, the gradient flowing back into it, or (parameters only) what
#: the optimizer's update wrote into it.
Phase = Literal["forward", "backward", "optimizer"]
#: What the work belonged to: the training step itself, an evaluation (the model in eval mode), or text
#: generation (inside ``generate()``, e.g. GRPO's rollouts). Reported apart so none hides in another.
Stage = Literal["train", "eval", "generate"]
#: Why part of a step went unmeasured (``Coverage.unmeasured``):
#: ``no_forward`` no model forward was seen; ``no_attention`` forwards ran but no attention was measured;
#: ``compiled`` attention ran inside torch.compile'd graphs, counted but not probed; ``no_logits`` the
#: output head exists but its output was never seen in a training forward; ``no_logit_bound`` an attention
#: layer was measured but no logit figure could be read for it (see the report's warnings for why).
Unmeasured = Literal["no_forward", "no_attention", "compiled", "no_logits", "no_logit_bound"]
#: What the differential rerun of a run's first non-finite step found (``Incident.cls``):
#: ``precision`` only the fast path is non-finite (a fallback helps); ``data_mask`` every path is, or the
#: inputs already were (fully masked rows, non-finite inputs): no precision switch helps; ``not_reproducible``
#: the same path re-run on the same inputs is finite (suspect hardware or a race); ``optimizer`` the values were
#: finite through forward and backward and the optimizer's update wrote the non-finite ones (e.g. fp16 Adam's
#: eps underflow): no attention switch helps; ``not_classified`` the rerun could not run soundly
#: (``Incident.note`` says why).
IncidentClass = Literal["precision", "data_mask", "not_reproducible", "optimizer", "replica_divergence",
                        "not_classified"]
#: How a rerun path ended: non-finite at the first offender or the output, finite, or not run.
RerunOutcome = Literal["nonfinite", "finite", "skipped"]
#: What a site is; backward stats of any site count as ``grad`` in the headroom metric. ``block`` is a
#: decoder block's output (the residual stream); ``mlp``, ``norm``, ``router`` (an MoE gate's logits),
#: ``expert`` and ``module`` are its parts; ``param`` a parameter or optimizer-state tensor found
#: non-finite at step start.
SiteKind = Literal["attention", "logits", "logprob", "tensor", "embedding", "block", "mlp", "norm", "router",
                   "expert", "module", "param"]
#: The attention path a rank applies: ``none`` is the model's own path, untouched.
Mode = Literal["none", "fp32", "fused", "eager_to_sdpa", "skip_step"]
#: The modes in wire order (the trainer broadcasts a mode as its index in this tuple).
MODES: tuple[str, ...] = get_args(Mode)
#: The SDPA backend that ran. ``compiled``: inside a torch.compile graph, where the eager probes are off.
Backend = Literal[
    "flash", "efficient", "cudnn", "math", "cpu_flash", "overrideable", "compiled", "eager", "unknown"
]

#: Run ids travel in URL paths and Prometheus labels: a safe, bounded alphabet.
RUN_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:@+=-]{0,127}$"
RunId = Annotated[str, StringConstraints(pattern=RUN_ID_PATTERN)]
#: Characters no label or shown text may hold: C1 controls (U+0085 is a line break to some readers), the
#: line and paragraph separators, and the bidirectional marks, embeddings, overrides and isolates (U+202E
#: shows ``gsm.tfos`` for ``soft.msg``: a site name on a page or a dashboard must read as it is).
_INVISIBLE = r"\u0080-\u009f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069"
# Site names are module FQNs or user-given watch names: printable, bounded, no control characters.
SiteName = Annotated[str, StringConstraints(min_length=1, max_length=256, pattern=rf"^[^\x00-\x1f\x7f{_INVISIBLE}]+$")]
ShortText = Annotated[str, StringConstraints(max_length=1024,
                                             pattern=rf"^[^\x00-\x08\x0b-\x1f\x7f{_INVISIBLE}]*$")]
#: Integers stay within what JSON readers (JavaScript, Prometheus' float64) and SQLite hold exactly.
MAX_INT = 2**53 - 1
Count = Annotated[int, Field(ge=0, le=MAX_INT)]
Positive = Annotated[int, Field(ge=1, le=MAX_INT)]
#: The most tokens (or sequences) one report's rollout comparison may count: 2^32, beyond the positions of any
#: step's batch on one rank (or one job: 4,096 sequences of a million tokens). Bounded so that the collector's
#: sums over every live rank stay exact integers far below ``MAX_INT`` (#37: 2^53-1 + 1 broke a render).
MAX_ROLLOUT_COUNT = 2**32
#: The largest |Δlogp| figure (nats) a report may carry: beyond any real mismatch (a healthy run's mean is
#: 0.015) and small enough that token-weighted sums and squares over every rank's every token stay finite in
#: float64 (#37: 1e308 on two ranks overflowed the combination and took /metrics down).
MAX_ROLLOUT_FIGURE = 1e38
_RolloutCount = Annotated[int, Field(ge=0, le=MAX_ROLLOUT_COUNT)]
#: a |Δlogp| figure: finite, >= 0, at most MAX_ROLLOUT_FIGURE
_Magnitude = Annotated[float, Field(ge=0, le=MAX_ROLLOUT_FIGURE, allow_inf_nan=False)]
_Signed = Annotated[float, Field(ge=-MAX_ROLLOUT_FIGURE, le=MAX_ROLLOUT_FIGURE, allow_inf_nan=False)]
_Fraction = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
#: a sequence ratio exp(Σ Δlogp): finite and >= 0 (the trainer clamps the exponent at 709)
_Ratio = Annotated[float, Field(ge=0, allow_inf_nan=False)]

#: Half-precision floating dtypes, by torch's name for them (``str(dtype)`` without ``torch.``).
HALF_DTYPES: frozenset[str] = frozenset({"float16", "bfloat16"})
_DTYPE_ALIASES = {"half": "float16", "fp16": "float16", "bf16": "bfloat16"}


#: A dtype on the wire: torch's name for it (``bfloat16``, ``float8_e4m3fn``); it becomes a Prometheus
#: label value, so no control characters, spaces or quotes.
DtypeName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_.]{1,32}$")]


def dtype_name(dtype: object) -> str:
    """The wire spelling of a dtype: ``torch.float16``, ``half`` and ``fp16`` all become ``float16``."""
    name = str(dtype).removeprefix("torch.")
    return _DTYPE_ALIASES.get(name, name)


def is_half(dtype: object) -> bool:
    """fp16/bf16, under any spelling trainers use (a torch dtype, ``torch.float16``, ``bf16``...)."""
    return dtype_name(dtype) in HALF_DTYPES


class _Wire(BaseModel):
    # Unknown fields are rejected (a typo must not vanish silently); NaN/Inf are serialised as constants.
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants", frozen=False)


class SiteStat(_Wire):
    """Finiteness of one site (module output, logits, watched tensor or its gradient) over one step."""

    site: SiteName
    kind: SiteKind
    phase: Phase
    stage: Stage = "train"
    dtype: DtypeName
    calls: Count = 1
    numel: Count
    nan: Count = Field(description="calls (visits of this site in the step) whose tensor held a NaN")
    inf: Count = Field(description="calls whose tensor held an Inf and no NaN")
    amax: float = Field(description="largest |x| over the step's calls that held no NaN or Inf; NaN when "
                        "every call did")
    headroom: float = Field(description="amax / finfo(dtype).max: 1.0 means at the overflow edge; +inf when "
                            "an Inf was seen (no headroom left), NaN when no value was finite")


class SdpaCall(_Wire):
    """One SDPA signature at one site: which backend ran, and why not a fused one."""

    site: SiteName
    backend: Backend = Field(description="the backend that ran (confirmed from grad_fn when grad is on)")
    predicted: Backend = Field(description="what torch._fused_sdp_choice predicted")
    confirmed: bool = Field(description="backend was read from the output's grad_fn, not only predicted")
    dtype: DtypeName
    shape: Annotated[str, StringConstraints(max_length=256)]
    reason: ShortText | None = Field(None, description="why no fused backend ran (None when one did)")
    calls: Positive = 1
    stage: Stage = "train"


class LogitStat(_Wire):
    """Max scaled QK logit of one attention layer in the step (max over calls, heads and ranks' rows)."""

    layer: SiteName
    bound: float = Field(description="the layer's figure, used by the metric and the rules alike: an upper "
                         "bound on the max logit (max saved log-sum-exp, never below the exact max), or the "
                         "exact max where no log-sum-exp was saved")
    source: Literal["lse", "exact", "scores", "router"] = Field(
        description="lse: a fused kernel's saved log-sum-exp; exact/scores: the exact max; router: an MoE "
        "router's largest logit")
    exact: float | None = Field(None, description="exact max, on sampled steps")
    per_head: Annotated[list[float], Field(max_length=4096, fail_fast=True)] | None = None


class RlhfStat(_Wire):
    """Policy-gradient health: computed over masked tokens; non-finite values are counted, never dropped."""

    nonfinite: dict[Annotated[str, StringConstraints(max_length=32)], Count] = Field(
        default_factory=dict, max_length=16
    )
    tokens: Count = 0
    logprob_min: float | None = None
    ratio_max: float | None = None
    clip_fraction: float | None = None
    kl_k1_mean: float | None = None
    kl_k1_max: float | None = None
    kl_k3_mean: float | None = None
    kl_k3_max: float | None = None
    kl_k3_ratio_mean: float | None = Field(
        None, description="mean of k3 x importance ratio: the KL that TRL's GRPO optimises by default "
        "(use_bias_correction_kl)")
    kl_optimised: Literal["k1", "k3", "k3_ratio"] | None = Field(
        None, description="which of the KL figures the trainer's loss uses, when the integration knows")
    advantage_std: float | None = None
    rollout: RolloutStat | None = Field(None, description="rollout vs trainer logprobs (``rollout_logprobs=``)")


class Spike(_Wire):
    """A site whose value jumped ``factor``× over its running baseline this step, without overflowing: a
    precursor, not an incident (Megatron's "large grads" and spiky-loss checks, k = 10)."""

    site: SiteName
    phase: Phase
    kind: SiteKind
    value: float = Field(description="this step's amax (a gradient site: its largest |g|; the loss: its value)")
    baseline: float = Field(description="the site's running baseline (the largest value of its recent steps)")
    factor: float = Field(description="value / baseline")


class RolloutStat(_Wire):
    """The rollout (sampler) and the trainer scoring the same tokens: Δlogp = trainer − rollout, over the
    unmasked tokens where both are finite. Sums and maxima reduced exactly across ranks; ``abs_p99`` is read
    from a fixed log-spaced histogram (``nanwatch.hooks.rollout.compare``), within one bin (×1.33).

    Every figure is computed over finite tokens, so it is finite (1.13): a non-finite, negative or out-of-range
    figure is refused (422 naming the field), never combined with another rank's (#37, #36)."""

    tokens: _RolloutCount = Field(0, description="unmasked tokens where both logprobs are finite")
    sequences: _RolloutCount = Field(0, description="sequences with at least one such token")
    cap: Annotated[float, Field(gt=1, le=MAX_ROLLOUT_FIGURE, allow_inf_nan=False)] = Field(
        2.0, description="the truncation cap c: a token's ratio exp(Δlogp) outside [1/c, c] counts as truncated")
    abs_mean: _Magnitude | None = Field(None, description="mean |Δlogp|")
    abs_max: _Magnitude | None = Field(None, description="max |Δlogp|")
    abs_p99: _Magnitude | None = Field(None, description="99th percentile of |Δlogp| (histogram estimate)")
    mean: _Signed | None = Field(None, description="mean Δlogp (signed): far from 0 next to abs_mean, one side "
                                 "scores every token higher")
    rms: _Magnitude | None = Field(None, description="root mean square of Δlogp")
    k3_mean: _Magnitude | None = Field(None, description="k3 estimate of KL(rollout || trainer): mean of "
                                       "r − 1 − log r, r = exp(Δlogp), over tokens the rollout sampled")
    seq_ratio_max: _Ratio | None = Field(None, description="largest sequence ratio exp(Σ Δlogp)")
    seq_ratio_min: _Ratio | None = Field(None, description="smallest sequence ratio exp(Σ Δlogp)")
    truncated_fraction: _Fraction | None = Field(None, description="fraction of tokens whose ratio leaves [1/c, c]")
    prob_correlation: Annotated[float, Field(ge=-1, le=1, allow_inf_nan=False)] | None = Field(
        None, description="Pearson correlation of the two token-probability vectors")
    logprob_slope: _Signed | None = Field(None, description="least-squares slope of rollout on trainer logprobs: "
                                          "1 when they agree, 1/T when the sampler alone divides by temperature T")
    fit_residual_rms: _Magnitude | None = Field(None, description="root mean square of what the least-squares "
                                                "line (logprob_slope) leaves of the rollout's logprobs: near 0 "
                                                "when a temperature on one side explains the mismatch, near rms "
                                                "when it does not")
    seq_abs_mean_max: _Magnitude | None = Field(None, description="the worst sequence's mean |Δlogp|")
    outlier_sequences: _RolloutCount = Field(0, description="sequences whose mean |Δlogp| exceeds 8× the median "
                                             "sequence's in their batch (and 0.05)")


MismatchCause = Literal["jump", "drift", "offset", "outliers", "stale_weights", "shift"]


class RolloutEvent(_Wire):
    """A rollout mismatch classified by its pattern. Never a precision directive: the cause is outside the
    trainer's attention (the weight sync, the rollout's precision or kernels, the sampler, a few sequences)."""

    cause: MismatchCause
    step: Count
    figures: dict[Annotated[str, StringConstraints(max_length=32)], float] = Field(default_factory=dict,
                                                                                 max_length=16)
    evidence: ShortText = ""
    remedy: ShortText = ""


class ModuleShare(_Wire):
    """One module lowered alone to the rollout's precision: the mismatch it reproduces."""

    module: SiteName
    abs_mean: float = Field(description="mean |Δlogp| against the fp32 forward with this module lowered alone")
    share: float = Field(description="abs_mean / the mismatch with every module lowered")


class RolloutAttribution(_Wire):
    """The worst sequences re-run outside the step: the trainer's forward in fp32, then each module (or block)
    lowered alone to ``rollout_dtype``; ``module`` names the one whose lowering alone reproduces most of the
    mismatch."""

    step: Count = Field(description="the step whose event asked for it")
    cause: MismatchCause
    rollout_dtype: Annotated[str, StringConstraints(max_length=32)]
    sequences: Count = 0
    observed_abs_mean: float | None = Field(None, description="mean |Δlogp| trainer vs rollout on these sequences")
    lowered_abs_mean: float | None = Field(None, description="mean |Δlogp| fp32 vs every module lowered")
    module: SiteName | None = Field(None, description="the module named (None: no single module explains it)")
    modules: Annotated[list[ModuleShare], Field(max_length=16)] = Field(default_factory=list)
    capsule: Annotated[str, StringConstraints(max_length=1024, pattern=r"^[^\x00-\x1f\x7f]*$")] | None = None
    seconds: float = 0.0
    note: ShortText = ""


# ---- MoE routing (#39) ----------------------------------------------------------------------------------
#: The routing replay (R3) a trainer runs under (``MonitorConfig.routing_replay``): ``off``, ``verify`` (the
#: trainer replays the rollout's routes itself; nanwatch checks the experts' input), ``apply`` (nanwatch does).
RoutingReplay = Literal["off", "verify", "apply"]
#: ``routing_replay_not_applied``: under verify/apply, the experts received other routes than the rollout's
#: (a critical page); ``routing_disagreement``: without replay, the routers disagree with the rollout's.
RoutingEventKind = Literal["routing_replay_not_applied", "routing_disagreement"]
#: The most experts one router may count, and routers one report may carry.
MAX_EXPERTS, MAX_ROUTERS = 4096, 1024


class RouterStat(_Wire):
    """One MoE router in one step: the routed token slots each expert received (the experts' input, after
    any replay), its largest logit, and how many unmasked tokens it sent to another expert set than the
    rollout did. Counts, so that ranks (and a job report) reduce exactly: sum ``load``, ``compared`` and
    ``differing``, max ``logit_max``."""

    router: SiteName
    top_k: Positive
    load: Annotated[list[Count], Field(min_length=1, max_length=MAX_EXPERTS)] = Field(
        description="routed token slots per expert, in the router's expert order (tokens × top_k in all)")
    logit_max: float | None = Field(None, description="the router's largest logit (None: none finite)")
    compared: Count = Field(0, description="unmasked tokens whose expert set was compared with the rollout's")
    differing: Count = Field(0, description="of those, tokens whose expert set differs (order-insensitive)")

    @property
    def experts(self) -> int:
        return len(self.load)

    @property
    def load_max(self) -> float | None:
        """The largest expert's share of the routed slots × the number of experts: 1 when balanced, ``experts``
        when one expert took every slot; None when nothing was routed."""
        slots = sum(self.load)
        return max(self.load) * len(self.load) / slots if slots else None

    @property
    def experts_idle(self) -> int:
        """Experts that received no token this step."""
        return sum(1 for n in self.load if n == 0)

    @property
    def disagreement(self) -> float | None:
        """The fraction of compared tokens whose expert set differs from the rollout's (None: none compared)."""
        return self.differing / self.compared if self.compared else None


class RoutingEvent(_Wire):
    """Routing disagreement worth telling: named routers (worst first) and the step's rerouted fraction."""

    kind: RoutingEventKind
    step: Count
    routers: Annotated[list[SiteName], Field(max_length=16)] = Field(default_factory=list)
    fraction: _Fraction = Field(description="fraction of compared tokens with at least one router differing")
    evidence: ShortText = ""


class MoeStat(_Wire):
    """The MoE routers of one step (``StepReport.moe``), in model order. Every figure is a count or a max, so
    :meth:`merged` reduces ranks exactly (a job report, the collector's per-layer series)."""

    routing_replay: RoutingReplay = "off"
    routers: Annotated[list[RouterStat], Field(max_length=MAX_ROUTERS, fail_fast=True)] = Field(
        default_factory=list)
    tokens_compared: Count = Field(0, description="unmasked tokens compared with the rollout's routes")
    tokens_rerouted: Count = Field(0, description="of those, tokens with at least one router differing")
    rerouted_abs_dlogp: _Magnitude = Field(0.0, description="sum of |Δlogp| over rerouted tokens (with "
                                           "rollout_logprobs): what the attribution compares")
    rerouted_scored: Count = Field(0, description="rerouted tokens with a finite Δlogp")
    agreeing_abs_dlogp: _Magnitude = Field(0.0, description="sum of |Δlogp| over tokens routed alike")
    agreeing_scored: Count = Field(0, description="tokens routed alike with a finite Δlogp")
    tokens_own_rerouted: Count | None = Field(
        None, description="routing_replay=apply (1.17): of tokens_compared, tokens whose trainer's own routers, before "
        "the replay gave them the rollout's experts, chose another expert set in at least one router: what the replay "
        "corrected (tokens_rerouted then verifies the replay itself). None: not under apply, or not compared")
    events: Annotated[list[RoutingEvent], Field(max_length=8, fail_fast=True)] = Field(default_factory=list)

    @property
    def rerouted_fraction(self) -> float | None:
        return self.tokens_rerouted / self.tokens_compared if self.tokens_compared else None

    @property
    def routing_explains(self) -> float | None:
        """The share of the rollout mismatch (sum |Δlogp|) that the rerouted tokens carry above what the same
        tokens would carry at the agreeing tokens' mean: 0 when rerouted tokens are no worse, 1 when the
        agreeing tokens carry none. None without both kinds of token scored."""
        total = self.rerouted_abs_dlogp + self.agreeing_abs_dlogp
        if not (self.rerouted_scored and self.agreeing_scored and total > 0):
            return None
        excess = self.rerouted_abs_dlogp - self.rerouted_scored * self.agreeing_abs_dlogp / self.agreeing_scored
        return min(max(excess / total, 0.0), 1.0)

    @classmethod
    def merged(cls, parts: list[MoeStat]) -> MoeStat | None:
        """Ranks' stats of one step reduced exactly: counts summed, maxima maxed, routers matched by name (in
        first-seen order); no events (they are told from the merged figures)."""
        if not parts:
            return None
        routers: dict[str, RouterStat] = {}
        for part in parts:
            for r in part.routers:
                got = routers.get(r.router)
                if got is None or len(got.load) != len(r.load):
                    routers[r.router] = r if got is None else got
                    continue
                tops = [v for v in (got.logit_max, r.logit_max) if v is not None]
                routers[r.router] = got.model_copy(update={
                    "load": [a + b for a, b in zip(got.load, r.load, strict=True)], "compared": got.compared + r.compared,
                    "differing": got.differing + r.differing, "logit_max": max(tops) if tops else None})
        sums = {k: sum(getattr(p, k) for p in parts) for k in (
            "tokens_compared", "tokens_rerouted", "rerouted_abs_dlogp", "rerouted_scored", "agreeing_abs_dlogp",
            "agreeing_scored")}
        own = [p.tokens_own_rerouted for p in parts if p.tokens_own_rerouted is not None]
        sums["tokens_own_rerouted"] = sum(own) if own else None
        sums["rerouted_abs_dlogp"] = min(sums["rerouted_abs_dlogp"], MAX_ROLLOUT_FIGURE)
        sums["agreeing_abs_dlogp"] = min(sums["agreeing_abs_dlogp"], MAX_ROLLOUT_FIGURE)
        return cls(routing_replay=parts[0].routing_replay, routers=list(routers.values()), **sums)


class Fingerprint(_Wire):
    """What one forward was fed: the first things a user checks after a NaN."""

    forward: Count = Field(description="index of the forward within the step")
    position_ids: Literal["none", "2d", "3d_mrope", "4d", "other"]
    mask: Literal["none", "padding_2d", "4d", "packed_block", "other"]
    fully_masked_rows: Count
    packed: bool = Field(description="position_ids restart inside a row: several documents in one sequence")
    plain_causal: bool = Field(description="attention ran with is_causal and no mask")
    cross_doc_leak: bool = Field(description="packed and plain causal: documents attend to each other")


class Coverage(_Wire):
    """What the step measured, so that a step nothing looked at is never reported as clean."""

    forwards: Count = Field(0, description="model forwards seen, eager or compiled")
    sites: Count = Field(0, description="distinct (site, pass, stage) measured")
    attention_calls: Count = Field(0, description="attention calls that ran, probed or not")
    attention_probed: Count = Field(0, description="attention calls measured (backend, output, logit figure)")
    compiled_calls: Count = Field(0, description="SDPA calls inside torch.compile'd graphs: counted, not probed")
    recomputed_calls: Count = Field(
        0, description="attention calls re-run by activation checkpointing in backward: recognised, not "
        "counted again (their saved log-sum-exp is where the logit bound is read)")
    logits: bool = Field(False, description="the output head's logits were measured in a training forward")
    params_checked: Count = Field(0, description="parameter and optimizer-state tensors checked at step start")
    unmeasured: Annotated[list[Unmeasured], Field(max_length=8, fail_fast=True)] = Field(default_factory=list)


class Incident(_Wire):
    """The differential rerun of a run's first non-finite step: the offending micro-batch re-run (forward,
    no grad) on the same inputs and RNG state, on the same path, under fp32 attention and on the math
    kernel; the class picks the remedy."""

    cls: IncidentClass = Field(description="precision, data_mask, not_reproducible or not_classified")
    step: Count
    site: SiteName | None = Field(None, description="the first offender the rerun looked at")
    phase: Phase | None = None
    same: RerunOutcome = "skipped"
    fp32: RerunOutcome = "skipped"
    math: RerunOutcome = "skipped"
    fully_masked_rows: Count = 0
    birth: SiteName | None = Field(None, description="where the value was born (forward): the first module to "
                                   "finish non-finite from a finite input, or, if its input was already "
                                   "non-finite, the module whose own code ran before it")
    birth_params: dict[Annotated[str, StringConstraints(max_length=64)], Count] = Field(
        default_factory=dict, max_length=64,
        description="the birth module's own parameters that were already non-finite, with their NaN/Inf count")
    birth_elements: Count = Field(0, description="non-finite elements in the birth module's output (exact)")
    birth_kind: SiteKind | None = Field(None, description="what the birth module is (attention, mlp, norm, "
                                        "param...): the remedy is chosen by it")
    path: Annotated[list[SiteName], Field(max_length=16, fail_fast=True)] = Field(
        default_factory=list, description="the coarse sites (blocks and their children) and the output head "
        "the non-finite value reached next, in order")
    host: Annotated[str, StringConstraints(max_length=255)] = ""
    device: Annotated[str, StringConstraints(max_length=32, pattern=r"^[a-z0-9_]*$")] = Field(
        "", description="the kind of device the run computed on (cpu, cuda, ...): where `nanwatch replay` runs it")
    capsule: Annotated[str, StringConstraints(max_length=1024, pattern=r"^[^\x00-\x1f\x7f]*$")] | None = Field(
        None, description="where this incident's capsule was written (a local path, or an object-store URL): "
        "`nanwatch replay CAPSULE` reproduces the birth anywhere")
    seconds: float = Field(0.0, description="wall time the rerun took")
    note: ShortText = ""
    ranks: Annotated[list[Count], Field(max_length=1024, fail_fast=True)] = Field(
        default_factory=list, description="replica_divergence: the ranks whose parameters disagree with the "
        "majority of their replicas (with two replicas, both)")
    hosts: Annotated[list[Annotated[str, StringConstraints(max_length=255)]], Field(max_length=64)] = Field(
        default_factory=list, description="replica_divergence: the hosts of those ranks")
    params: Annotated[list[SiteName], Field(max_length=16, fail_fast=True)] = Field(
        default_factory=list, description="replica_divergence: the first differing parameters (or optimizer "
        "state entries, named param:state), in the model's order")
    repaired: bool | None = Field(None, description="replica_divergence: the majority's parameters and optimizer "
                                  "state were broadcast to the others and the check then passed (False: it did "
                                  "not, or there is no majority; None: replica_repair off)")


def schema_major(version: str) -> int | None:
    """The major number of a ``"MAJOR.MINOR"`` version string, or None if it is not one."""
    head = version.split(".", 1)[0]
    return int(head) if head.isdigit() else None


class StepReport(_Wire):
    """Everything one rank measured in one step. ``step`` and ``first_offender`` are public API."""

    v: Annotated[str, StringConstraints(max_length=16)] = Field(
        SCHEMA_VERSION, json_schema_extra={"pattern": rf"^0*{SCHEMA_MAJOR}(\.[\s\S]*)?$"},
        description="schema version MAJOR.MINOR; a reader refuses a major it does not speak")
    run_id: RunId
    scope: ReportScope = Field("rank", description="who the report speaks for: rank, job, detail or heartbeat")
    rank: Count = Field(0, description="the sending rank (in a job report, the rank that posted it)")
    world_size: Positive = 1
    incarnation: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9._-]{1,64}$")]
    seq: Count = Field(description="per (rank, incarnation) report sequence number; the idempotency key")
    step: Count = Field(description="the training step; HF's ``global_step`` under the Trainer integration. An "
                        "eval report carries the training step it follows")
    stage: Stage = Field("train", description="train: a training step's report. eval: an evaluation's own report "
                         "(its figures are never folded into a training step's)")
    time: float = Field(description="unix time the step ended")
    sites: Annotated[list[SiteStat], Field(max_length=4096, fail_fast=True)] = Field(default_factory=list)
    sdpa: Annotated[list[SdpaCall], Field(max_length=4096, fail_fast=True)] = Field(default_factory=list)
    logits: Annotated[list[LogitStat], Field(max_length=4096, fail_fast=True)] = Field(default_factory=list)
    rlhf: RlhfStat | None = None
    rollout_events: Annotated[list[RolloutEvent], Field(max_length=8, fail_fast=True)] = Field(
        default_factory=list, description="rollout mismatches classified at this step (job or rank report)")
    rollout_attribution: RolloutAttribution | None = None
    moe: MoeStat | None = Field(None, description="MoE routers: load, logit max, disagreement with the rollout's "
                                "routes, routing events (None: no router ran, or a pre-1.15 sender)")
    spikes: Annotated[list[Spike], Field(max_length=64, fail_fast=True)] = Field(
        default_factory=list, description="sites whose value jumped k× over their running baseline this step "
        "(at most 64, largest factor first)")
    fingerprints: Annotated[list[Fingerprint], Field(max_length=256, fail_fast=True)] = Field(default_factory=list)
    coverage: Coverage | None = Field(None, description="what was measured (None from 1.0 senders)")
    step_skipped: bool | None = Field(
        None, description="the weight guard skipped this step's optimizer update (None: no guard)")
    incident: Incident | None = None
    agree_every: Positive | None = Field(
        None, description="under torch.distributed: ranks agree on directives every this many steps")
    attention_mode: Mode = "none"
    directive_version: Count = 0
    first_offender: SiteName | None = None
    first_offender_phase: Phase | None = None
    first_offender_stage: Stage | None = None
    first_offender_rank: Count | None = Field(
        None, description="the rank that held first_offender: in a job report, the rank whose first offender came "
        "earliest in execution order (ties: the lowest rank); in a rank or detail report, the sender")
    ranks_reporting: Positive | None = Field(
        None, description="job reports: how many ranks the reduction covered (world_size when all took part)")
    heartbeat_s: Annotated[float, Field(gt=0, le=86_400)] | None = Field(
        None, description="heartbeat reports: the sender's heartbeat interval, so the collector holds the rank "
        "live (and not late) for a few of them however long they are")
    nonfinite_rank: Count | None = Field(
        None, description="with a weight guard under torch.distributed: the lowest rank whose step held a "
        "non-finite value, from the guard's reduction across ranks (so every rank's report says who made the "
        "job skip the step); None when no rank did")
    raised: Annotated[str, StringConstraints(max_length=128, pattern=r"^[A-Za-z0-9_.]*$")] | None = Field(
        None, description="the exception type the step raised (the step never finished): the rank crashed")
    final: bool = Field(False, description="the last report of this rank's incarnation: the Monitor closed "
                        "normally (Monitor exit, the HF callback's on_train_end). A rank that vanishes without one "
                        "crashed or hung")
    loss_scale: Annotated[float, Field(ge=0)] | None = Field(
        None, description="dynamic loss scaling (a GradScaler): the scale after this step's update; None without one")
    scaler_overflow: bool | None = Field(
        None, description="dynamic loss scaling handled this step's non-finite values: only gradients were "
        "non-finite, the scaler found them, skipped the update and lowered the scale. Normal operation, not an "
        "incident (a collapsing scale is); None without a scaler")
    dropped_reports: Count = Field(0, description="reports this rank could not deliver so far (cumulative)")
    warnings: Annotated[list[ShortText], Field(max_length=64, fail_fast=True)] = Field(default_factory=list)

    @field_validator("v")
    @classmethod
    def _known_major(cls, v: str) -> str:
        if schema_major(v) != SCHEMA_MAJOR:
            raise ValueError(f"unsupported schema version {v!r}: this side speaks {SCHEMA_MAJOR}.x")
        return v

    @model_validator(mode="after")
    def _rank_in_world(self) -> StepReport:
        for name in ("rank", "first_offender_rank", "nonfinite_rank"):
            value = getattr(self, name)
            if value is not None and value >= self.world_size:
                raise ValueError(f"{name} {value} is outside world_size {self.world_size}")
        if self.ranks_reporting is not None and self.ranks_reporting > self.world_size:
            raise ValueError(f"ranks_reporting {self.ranks_reporting} exceeds world_size {self.world_size}")
        if self.scope == "heartbeat" and (self.sites or self.sdpa or self.logits or self.rlhf or self.fingerprints
                                          or self.incident or self.rollout_events or self.rollout_attribution
                                          or self.spikes or self.moe):
            raise ValueError("a heartbeat carries no measurements (sites, sdpa, logits, rlhf, fingerprints, "
                             "incident): send them as a rank, job or detail report")
        return self

    @property
    def nonfinite_total(self) -> int:
        return sum(s.nan + s.inf for s in self.sites)


class ReportBatch(_Wire):
    """What the trainer POSTs: one or more reports, oldest first."""

    reports: Annotated[list[StepReport], Field(min_length=1, max_length=256, fail_fast=True)]


class DirectiveSpec(_Wire):
    """What an operator (or a rule) asks for; the collector turns it into a versioned Directive."""

    mode: Mode
    apply_at_step: Count | None = Field(
        None, description="step from which ranks apply it; default: latest step seen plus the margin"
    )
    revert_after_clean_steps: Positive | None = Field(
        None, description="go back to mode 'none' after this many clean steps (None: stay)"
    )
    reason: ShortText = ""


class Directive(_Wire):
    """A versioned instruction to every rank of a run. Version 0 with mode 'none' means no directive yet."""

    run_id: RunId
    version: Count
    mode: Mode
    apply_at_step: Count
    revert_after_clean_steps: Positive | None = None
    reason: ShortText = ""
    set_by: ShortText = ""
    created_at: float = 0.0


#: A weight fingerprint (``nanwatch.fingerprint``): two 64-bit lanes, 32 lowercase hex digits.
WEIGHT_FINGERPRINT_PATTERN = r"^[0-9a-f]{32}$"
#: The most tensors one side's weight fingerprints may name (a 671B MoE has ~92k; split a larger set by
#: prefix into several workers' posts, or raise it here and on the collector together).
MAX_WEIGHT_TENSORS = 131_072
#: The dtypes a trainer set may carry casts to (``WeightFingerprints.casts``), and a shape's most dimensions.
MAX_WEIGHT_CASTS = 4
MAX_WEIGHT_DIMS = 16
WeightFingerprint = Annotated[str, StringConstraints(pattern=WEIGHT_FINGERPRINT_PATTERN)]
#: A tensor's name in a state dict: printable, bounded.
TensorName = Annotated[str, StringConstraints(min_length=1, max_length=512,
                                              pattern=rf"^[^\x00-\x1f\x7f{_INVISIBLE}]+$")]


class WeightFingerprints(_Wire):
    """One side's weight fingerprints of one weight version (``PUT /v1/runs/{run_id}/weights/{version}``):
    the trainer's (what it published) or a rollout worker's (what it loaded). The collector compares each
    rollout worker's set with the trainer's of the same version."""

    side: Literal["trainer", "rollout"]
    worker: Annotated[str, StringConstraints(pattern=RUN_ID_PATTERN)] = Field(
        "0", description="which rollout worker (its rank, host or name); the trainer's is ignored")
    fingerprints: dict[TensorName, WeightFingerprint] = Field(
        max_length=MAX_WEIGHT_TENSORS, description="tensor name -> its weight fingerprint")
    dtypes: dict[TensorName, DtypeName] | None = Field(
        None, max_length=MAX_WEIGHT_TENSORS, description="tensor name -> its dtype (1.12; ``nanwatch.fingerprint`` "
        "carries them): lets the collector compare a bf16 copy with the trainer's bf16 cast, and name a dtype no "
        "cast explains")
    shapes: dict[TensorName, Annotated[list[Count], Field(max_length=MAX_WEIGHT_DIMS)]] | None = Field(
        None, max_length=MAX_WEIGHT_TENSORS, description="tensor name -> its shape (1.12)")
    casts: dict[DtypeName, dict[TensorName, WeightFingerprint]] | None = Field(
        None, max_length=MAX_WEIGHT_CASTS, description="the trainer's only (1.12): dtype -> the fingerprints of its "
        "floating tensors as cast to that dtype (``.to(dtype)``, round-to-nearest-even), as a rollout loads them")
    incarnation: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9._-]{1,64}$")] | None = Field(
        None, description="the trainer's only (1.12): the incarnation of the rank that posts the run's reports; "
        "a trainer set without the run's is refused (a rollout worker cannot post side=trainer)")
