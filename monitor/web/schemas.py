"""Response bodies of the collector's HTTP API (requests use the wire models).

Answers are strict JSON, which every client parses (``JSON.parse`` refuses a bare ``NaN``): a non-finite
float is written as the string ``"NaN"``, ``"Infinity"`` or ``"-Infinity"``, and the OpenAPI document says
so (:data:`ApiFloat`). Only the trainer-to-collector wire keeps its documented ``NaN`` constants. Routes
return models through ``ApiJSON`` (``model_dump_json``). Views of the state (``RankView``, ``EventView``)
are read from it by attribute (``from_attributes``): one name per field, the wire's, end to end.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema
from starlette.responses import JSONResponse

from nanwatch.monitor.data.event_log import first_nonfinite
from nanwatch.monitor.data.store import EventRow
from nanwatch.wire import Directive

__all__ = ["ApiFloat", "CrashedRank", "EventView", "FieldError", "FirstOffender", "Health", "IngestResult", "Problem",
           "RankView", "RlhfView", "RolloutView", "RunDetail", "RunList", "RunSummary", "SdpaView", "ValidationProblem",
           "WeightSyncResult", "WeightSyncView", "WeightVerdict", "WorkerSyncView", "ApiJSON"]


#: A float that may be non-finite: a JSON number, or one of three strings.
ApiFloat = Annotated[float, WithJsonSchema(
    {"anyOf": [{"type": "number"}, {"type": "string", "enum": ["NaN", "Infinity", "-Infinity"]}]},
    mode="serialization")]


class _Out(BaseModel):
    model_config = ConfigDict(ser_json_inf_nan="strings")


class _View(_Out):
    """A response read from a state object's attributes of the same names."""

    model_config = ConfigDict(ser_json_inf_nan="strings", from_attributes=True)


class IngestResult(_View):
    """What the collector did with a batch. Resent reports are acknowledged too: they are ``duplicates``."""

    accepted: int
    duplicates: int


class Problem(_Out):
    """Every error: ``detail`` says what was wrong and what to do."""

    detail: str


class FieldError(_Out):
    loc: list[str | int]
    msg: str
    type: str


class ValidationProblem(_Out):
    """A body or parameter that failed validation: one entry per offending field, located by ``loc``."""

    detail: list[FieldError] = Field(description="the first errors (at most 20)")
    error_count: int | None = Field(None, description="how many errors there were in all")


class Health(_Out):
    status: str


class FirstOffender(_Out):
    """Where the run's first non-finite value was reported (in arrival order)."""

    site: str | None
    phase: str | None
    stage: str | None = Field(None, description="train, eval or generate (None: an event from before 1.1)")
    rank: int | None
    step: int | None
    time: ApiFloat

    @classmethod
    def of(cls, ev: EventRow) -> FirstOffender:
        """From the run's ``first_nonfinite`` event."""
        where = first_nonfinite(ev)
        return cls(site=ev.site, phase=where.get("phase"), stage=where.get("stage"), rank=ev.rank, step=ev.step,
                   time=ev.time)


class RolloutView(_View):
    """The rollout against the trainer on the same tokens (the wire's ``RolloutStat``, floats as ``ApiFloat``)."""

    tokens: int
    sequences: int
    cap: ApiFloat
    abs_mean: ApiFloat | None
    abs_max: ApiFloat | None
    abs_p99: ApiFloat | None
    mean: ApiFloat | None
    rms: ApiFloat | None
    k3_mean: ApiFloat | None
    seq_ratio_max: ApiFloat | None
    seq_ratio_min: ApiFloat | None
    truncated_fraction: ApiFloat | None
    prob_correlation: ApiFloat | None
    logprob_slope: ApiFloat | None
    seq_abs_mean_max: ApiFloat | None
    outlier_sequences: int


class RlhfView(_View):
    """A rank's latest RLHF health (the wire's ``RlhfStat``, its floats as ``ApiFloat``)."""

    nonfinite: dict[str, int]
    tokens: int
    logprob_min: ApiFloat | None
    ratio_max: ApiFloat | None
    clip_fraction: ApiFloat | None
    kl_k1_mean: ApiFloat | None
    kl_k1_max: ApiFloat | None
    kl_k3_mean: ApiFloat | None
    kl_k3_max: ApiFloat | None
    kl_k3_ratio_mean: ApiFloat | None
    kl_optimised: str | None
    advantage_std: ApiFloat | None
    rollout: RolloutView | None = None


class RankView(_View):
    """The latest report of one live rank, summarised (``RankState``)."""

    rank: int
    incarnation: str
    seq: int
    scope: str = Field(description="rank or detail: the rank's own measured report; heartbeat: known by heartbeats "
                       "(job mode)")
    step: int
    time: ApiFloat
    received: ApiFloat
    world_size: int
    attention_mode: str
    directive_version: int
    dropped_reports: int
    nonfinite: int
    first_offender: str | None
    first_offender_phase: str | None
    headroom: dict[str, ApiFloat]
    logit_max: ApiFloat | None
    rlhf: RlhfView | None = None
    silent_s: ApiFloat = Field(0.0, description="seconds since the collector last heard from the rank")
    late: bool = Field(False, description="silent past NANWATCH_RANK_LATE_S (or two heartbeats): hung, or gone")
    crashed: str | None = Field(None, description="the exception type the rank's step raised: the rank crashed "
                                "(not counted in live_ranks); None while it runs")
    ended: bool = Field(False, description="the rank sent its final report (a normal end): this is its last view, "
                        "kept for the API only (its series are gone)")


class EventView(_View):
    time: ApiFloat
    kind: str
    rank: int | None
    step: int | None
    site: str | None
    actor: str
    detail: dict[str, Any]


class SpikeView(_Out):
    """One spike of the run's latest report with spikes (wire 1.9 ``Spike``): a precursor, not an incident."""

    step: int
    rank: int
    site: str
    phase: str
    kind: str
    value: ApiFloat
    baseline: ApiFloat
    factor: ApiFloat


class SdpaView(_Out):
    backend: str
    dtype: str
    stage: str
    calls: float


class CrashedRank(_Out):
    """A rank whose step raised (wire 1.5 ``raised``)."""

    rank: int
    raised: str
    step: int | None = Field(description="the step it raised in (None: known from before a collector restart)")


class RunSummary(_Out):
    run_id: str
    status: Literal["live", "crashed", "ended", "idle"] = Field(
        description="crashed: a rank's step raised (the run ends crashed, whatever its other ranks do); live: "
        "ranks reported within the TTL; ended: every rank sent its final report (the run ended normally); "
        "idle: none of these (no rank reported within the TTL, and the run did not say it ended). Decided by "
        "nanwatch.run_status, as nanwatch status decides it (which also says silent: a rank is late)")
    live_ranks: int = Field(description="ranks that reported within the TTL, crashed ones excepted")
    crashed_ranks: list[CrashedRank] = Field(default_factory=list)
    latest_step: int
    last_report_time: ApiFloat | None
    nonfinite_total: float = Field(description="non-finite site visits: calls of a site whose tensor held a NaN "
                                   "or an Inf, summed over steps (not elements)")
    skipped_steps: float = Field(0, description="optimizer steps the weight guard skipped (the most any rank did)")
    directive: Directive
    first_offender: FirstOffender | None
    incidents: dict[str, float] = Field(default_factory=dict, description="incidents by class (precision, "
                                        "data_mask, not_reproducible, optimizer, replica_divergence, ...)")
    rollout_events: dict[str, float] = Field(default_factory=dict, description="classified rollout mismatches "
                                             "by cause (jump, drift, offset, outliers)")
    weight_sync_mismatches: float = Field(0, description="weight syncs that failed verification")


class RunList(_Out):
    """One page of runs, by run id; pass ``next_after`` as ``after`` for the next page."""

    runs: list[RunSummary]
    next_after: str | None = Field(None, description="the cursor of the next page (the last run id of this one); "
                                   "None on the last page")


class RunDetail(RunSummary):
    ranks: list[RankView]
    rollout: RolloutView | None = Field(
        None, description="the rollout mismatch of the run's latest step: the live job report's, or its live "
        "ranks' combined (token-weighted means, extremes, and bounds where ranks cannot be merged exactly: "
        "nanwatch.monitor.data.rollout_figures); None: no live view measured one")
    rollout_nonfinite_total: int = Field(0, description="non-finite values in the rollout's own log-probabilities "
                                         "(inside the mask), summed over steps: nanwatch_rollout_nonfinite_values_total")
    sdpa: list[SdpaView]
    spikes_total: dict[str, int] = Field(default_factory=dict, description="spike steps by site kind: "
                                         "nanwatch_spikes_total")
    latest_spikes: list[SpikeView] = Field(default_factory=list, description="the spikes of the run's latest "
                                           "report with any (the first few, largest factor first; in memory)")
    weight_sync: WeightSyncView | None = Field(None, description="the run's weight syncs, by rollout worker (None: "
                                               "no weight fingerprints posted since the collector started)")
    event_counts: dict[str, int]
    events: list[EventView]


class WeightVerdict(_Out):
    """One rollout worker's weight fingerprints of a version against the trainer's."""

    worker: str
    verified: bool = Field(description="every tensor's fingerprint equals the trainer's, none missing or extra")
    differing: list[str] = Field(description="the first tensors whose fingerprints differ, sorted")
    differing_count: int
    missing: list[str] = Field(description="the first tensors the trainer has and the worker not, sorted")
    missing_count: int
    extra: list[str] = Field(description="the first tensors the worker has and the trainer not, sorted")
    extra_count: int
    outcome: Literal["verified", "mismatch", "unverifiable"] = Field(
        description="mismatch: a tensor differs, is missing or extra (a failed sync); unverifiable: only dtypes or "
        "shapes that no cast the trainer published explains (the sync cannot be checked); else verified")
    dtype_differs: list[str] = Field(description="the first tensors whose dtype no published cast explains, as "
                                     "'name: trainer float32, rollout float8_e4m3fn'")
    dtype_differs_count: int
    shape_differs: list[str] = Field(description="the first tensors whose shapes differ, as 'name: trainer [4, 8], "
                                     "rollout [8, 4]'")
    shape_differs_count: int


class WeightSyncResult(_Out):
    """What a weight-fingerprint set was compared with: nothing yet (the other side has not posted), one
    worker's verdict (a rollout set), or the verdicts of the workers that were waiting (the trainer's)."""

    version: int
    side: Literal["trainer", "rollout"]
    worker: str
    bound: bool = Field(True, description="a trainer set: whether it is the run's (its incarnation is the one that "
                        "posts the run's reports); false: it waits for that incarnation's first report (compared "
                        "then), or never binds (not the run's trainer)")
    compared: list[WeightVerdict]


class WorkerSyncView(_Out):
    """One rollout worker's weight syncs (in memory: a collector restart forgets them)."""

    latest_posted: int = Field(description="the newest version it posted a set of")
    latest_verified: int | None = Field(description="the newest version whose set verified (None: none yet)")
    outcome: Literal["waiting", "verified", "mismatch", "unverifiable"] = Field(
        description="its latest compared set's outcome (waiting: none compared yet)")
    lag: int = Field(description="versions the trainer published after its latest verified one, when it lags (two "
                     "or more, or one unposted past NANWATCH_WEIGHT_SYNC_WAIT_S), else 0: "
                     "nanwatch_weight_sync_lag_versions")


class WeightSyncView(_Out):
    """The run's weight syncs (``PUT /v1/runs/{run_id}/weights/{version}``, docs/weight_sync.md)."""

    latest_published: int | None = Field(description="the newest version with the run's trainer set")
    workers: dict[str, WorkerSyncView]


class ApiJSON(JSONResponse):
    """JSON rendered by pydantic, keeping NaN/Infinity (routes still declare ``response_model``)."""

    def render(self, content: Any) -> bytes:
        return content.model_dump_json().encode() if isinstance(content, BaseModel) else super().render(content)
