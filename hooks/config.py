"""Monitor configuration: data, validated at construction, resolved against the environment in one place.

``MonitorConfig(...)`` does no I/O: it checks its values and raises a ValueError that says what is
expected. What a config leaves to the environment (the ingest token, ``NANWATCH_LOG_DIR``, the
``NANWATCH_CAPSULE*`` settings) and the shard a run reports to are filled in by :func:`resolve_config`,
which ``attach`` and the Monitor call: it returns a new config (``dataclasses.replace``) and leaves the
given one as it was.
"""

from __future__ import annotations

import logging
import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
from pydantic import TypeAdapter, ValidationError

from nanwatch.addresses import collector_urls, pick_collector
from nanwatch.policy import DEFAULT_LOGIT_TAU
from nanwatch.tokens import token_from_env
from nanwatch.wire import RunId, StepReport

__all__ = ["DirectiveSource", "GuardChoice", "MonitorConfig", "ReportScopeChoice", "SpikeAction",
           "default_is_attention", "resolve_config"]

log = logging.getLogger("nanwatch")

_ATTENTION_NAME = re.compile(r"(attention|attn|deltanet)$", re.IGNORECASE)
_RUN_ID = TypeAdapter(RunId)
#: Who issues the directives a trainer applies (``MonitorConfig.directive_source``).
DirectiveSource = Literal["auto", "local", "collector", "off"]
#: Whom a trainer's reports speak for (``MonitorConfig.report_scope``).
ReportScopeChoice = Literal["auto", "rank", "job"]
#: Whether nanwatch puts a weight guard on the optimizers that step the model (``MonitorConfig.guard``).
GuardChoice = Literal["auto", "off"]
SpikeAction = Literal["report", "skip"]

#: Capsule limits a config leaves unset: (environment variable, default, least value allowed).
_CAPSULE_LIMITS = {"capsule_max": ("NANWATCH_CAPSULE_MAX", 4, 0),
                   "capsule_max_bytes": ("NANWATCH_CAPSULE_MAX_BYTES", 256 << 20, 4096)}
_CAPSULE_DIR_DEFAULT = "./nanwatch-capsules"


def default_is_attention(name: str, module: torch.nn.Module) -> bool:
    """Attention-like modules by class name: HF's ``*Attention``, ``*Attn``, and linear-attention layers
    such as Qwen3.5's ``*GatedDeltaNet``. Only the innermost match is instrumented."""
    return bool(_ATTENTION_NAME.search(type(module).__name__))


@dataclass(kw_only=True, slots=True)
class MonitorConfig:
    """What to measure and where to send it. Defaults are the cheap, always-on set.

    The fields, in this order, by concern:

    * **the run and where it reports**: ``run_id``, ``collector`` (``collectors``), ``token``, ``rank``,
      ``world_size``;
    * **what is measured**: ``grads``, ``logits``, ``coarse``, ``fingerprint``, ``is_attention``,
      ``exact_logit_every``, ``exact_logit_chunk_elems``, ``param_check_every``;
    * **remedies** (the weight guard, the optimizer check, the differential re-run, the capsule):
      ``guard``, ``optimizer_check``, ``optimizer_check_every``, ``process_group``, ``guard_reduce``, ``replica_check_every``,
      ``replica_repair``, ``rerun``, ``capsule``,
      ``capsule_max``, ``capsule_dir``, ``capsule_max_bytes``;
    * **spikes** (a value jumping k× over its recent past, before it overflows): ``spike_factor``,
      ``spike_window``, ``spike_warmup``, ``spike_action``;
    * **the rollout** (RLHF: the sampler against the trainer): ``rollout_cap``, ``rollout_dtype``,
      ``rollout_attribution``;
    * **directives**: ``directive_source``, ``directive_check_every``,
      ``logit_tau``;
    * **reports** (step reports, job reports, heartbeats): ``max_pending_reports``, ``on_report``,
      ``report_scope``, ``heartbeat_s``, ``report_reduce_timeout_s``, ``close_timeout``;
    * **the local record** (log lines and a JSONL file): ``log_incidents``, ``log_every``, ``log_dir``,
      ``log_max_bytes``, ``log_backups``.

    Constructing one reads nothing: a field left to the environment stays None until
    :func:`resolve_config`. Measured costs of the defaults are in ``docs/benchmarks.md``.
    """

    # ---- the run and where it reports --------------------------------------------------------------
    run_id: str
    """Names the run in every report and metric label; letters, digits and ``._:@+=-``, at most 128."""

    collector: str | Sequence[str] | None = None
    """Base URL of the collector (``http://host:port``); None keeps reports in-process only. Several (a list,
    or one string separated by commas) are shards: the run reports to the one ``pick_collector`` chooses by
    a stable hash of ``run_id`` (the same on every rank), and the resolved config's ``collector`` holds that
    one URL."""

    collectors: tuple[str, ...] = field(default=(), init=False)
    """Every shard ``collector`` named (filled by ``resolve_config``; one URL: just that one)."""

    token: str | None = None
    """Ingest bearer token for the collector; None: ``NANWATCH_TOKEN``, or the file ``NANWATCH_TOKEN_FILE``
    (read by ``resolve_config``)."""

    rank: int | None = None
    """This process's rank; default: torch.distributed's rank if initialised, else ``$RANK``, else 0."""

    world_size: int | None = None
    """Number of ranks; default: torch.distributed's world size, else ``$WORLD_SIZE``, else 1."""

    # ---- what is measured --------------------------------------------------------------------------
    grads: bool = True
    """Also measure the gradient flowing back into every site (the backward pass)."""

    logits: bool = True
    """Measure the output-embedding (``lm_head``) output, i.e. the logits."""

    coarse: bool = True
    """Measure the output of every decoder block and of its parts (attention, MLP/MoE, norms), MoE routers and
    experts, the input embedding and the final norm, and their gradients: the first offender is then the
    part where a non-finite value was born, not the next attention layer."""

    fingerprint: bool = True
    """Record each forward's input layout (position_ids, mask kind, packing, fully masked rows)."""

    is_attention: Callable[[str, torch.nn.Module], bool] = default_is_attention
    """Which modules are attention sites (given FQN and module)."""

    exact_logit_every: int = 100
    """Compute the exact per-head max attention logit every N steps (about one attention forward of
    extra work on those steps); 0 turns it off. Other steps use the saved log-sum-exp bound."""

    exact_logit_chunk_elems: int = 1 << 24
    """Upper bound on the score elements held at once by the exact computation (memory stays bounded)."""

    param_check_every: int = 0
    """Check every parameter (and every optimizer-state tensor of the optimizers nanwatch covers)
    once in this many steps, a rotating share at each step start, so that a tensor already non-finite is
    named as a site of its own before any forward; 0 (the default) turns it off. Off by default because it
    is not needed to name the tensor: every localising site is read every step, so a non-finite weight is
    met at its next use, at the module holding it (the first offender; a NaN ``exp_avg`` reaches the weight
    at the next update), and the differential rerun reads every parameter and optimizer-state tensor once
    on that incident and names it (``nanwatch.hooks.remedies.incident_tensors``). On, it reads all of them
    every N steps (~6 GB a step at 8B with N=8)."""

    # ---- remedies ----------------------------------------------------------------------------------
    guard: GuardChoice = "auto"
    """The weight guard (``nanwatch.hooks.remedies.weight_guard``): a step in which a monitored site saw a
    non-finite value does not update the weights. ``auto``: every ``torch.optim.Optimizer`` that steps the
    model's parameters gets one, the one passed as ``optimizer=`` and any other found at its first step (a
    global optimizer-step pre-hook, ``nanwatch.hooks.remedies.optimizer_discovery``). A fused optimizer's
    weight guard works on the device at no cost; others at one host read of the step's flag per optimizer step (what
    GradScaler pays for them). ``off``: nanwatch never skips a step and issues no flag reduction (an
    explicit ``Monitor.guard(opt)`` still puts a weight guard on ``opt``)."""

    optimizer_check: bool = True
    """After the steps of an optimizer nanwatch found (passed or discovered), check the parameters it
    just wrote (every ``optimizer_check_every``-th step): the largest |x| of each parameter that had a
    gradient, on the device (``_foreach_norm(ord=inf)``; on the CPU one ``aminmax`` each)
    (``nanwatch.hooks.measure.optimizer_check``). A value born in a checked update (fp16 AdamW's eps
    underflow, a huge learning rate) is then named at the step it happened (site kind ``param``, pass
    ``optimizer``), with an incident of class ``optimizer``; one born in an update not checked is seen at
    the next forward that uses it, at the module holding it, and the differential rerun names the parameter
    (class ``optimizer``, birth kind ``param``)."""

    optimizer_check_every: int | None = None
    """Run the optimizer check after one optimizer step in this many (and always after the first). None: 1
    when the model is on the CPU (0.61 ms on a 170 ms step of the tiny bench model), 16 on an accelerator,
    where reading every weight after every update costs a read of the whole model a step (16.4 GB at 8B in
    bf16, about 1.3 % of an H100 step): a value the unchecked updates write is still seen at its next use, in
    the next forward, and named by the rerun. 1: every step."""

    process_group: Any = None
    """The training process group (a ``torch.distributed`` ProcessGroup) the weight guard reduces its
    non-finite flag over, so that every rank skips a step any rank saw a non-finite value in. None: the
    default group. Pass the data-parallel group when ranks of other groups hold other parameters (tensor or
    pipeline parallelism) and must not skip with it. A CPU model needs a group that reduces CPU tensors
    (gloo); with None and an NCCL default group, nanwatch makes a gloo group once."""

    guard_reduce: bool = True
    """Under torch.distributed, reduce the weight guard's flag across ``process_group`` (one async
    all-reduce of two float32 per optimizer step, see ``nanwatch.hooks.measure.collective``). False only when
    the ranks share no gradients (independent models): each rank then decides alone."""

    replica_check_every: int = 500
    """Under torch.distributed, every this many optimizer steps compare the parameters and the covered
    optimizers' state across the data-parallel replicas, which must be bit-identical (DDP, ZeRO-1/2: the
    data-parallel group, ``process_group``; FSDP2 HSDP: the mesh's replicate dimension): a device-side
    fingerprint per tensor, one all-gather, the verdict decoded by the reporter thread; a disagreement is
    an incident of class ``replica_divergence`` (``nanwatch.hooks.remedies.replica_check``; docs/distributed.md,
    "Replicas that must agree"). 0: off. The default keeps the amortised cost under 0.5 % of a step
    (``nanwatch bench replica``, docs/benchmarks.md). Must be the same on every rank (a collective)."""

    replica_repair: bool = False
    """When the replica check finds a disagreement and a majority of replicas agrees, broadcast the majority's
    tensors to the others and check again (``Incident.repaired``); without a majority (two replicas, a tie)
    repair is impossible and the incident says so. Costs one host read of the verdict per check."""

    rerun: bool | None = None
    """Classify the run's first non-finite step by the differential rerun (``nanwatch.hooks.remedies.rerun``)
    while a weight guard is effective, on every device; None (the default) or True: on, False: off. On the CPU
    the step is decided at its end (reading its non-finite flag there is free). On an accelerator nothing is
    read on the host in the step: the flag is copied asynchronously with an event, and the step is decided
    at the next step start, or else at the next optimizer pre-step, once the flag has landed, on the weights
    the step saw (the guard skipped its update); its inputs are kept (by reference) one step longer, and the
    incident lands in that later step's report with its own ``step``. A flag that lands only after the
    weights may have moved gives ``not_classified``, saying so (``nanwatch.hooks.remedies.rerun_flags``)."""

    capsule: bool | None = None
    """Write an incident capsule (``nanwatch.hooks.remedies.capsule``) when the differential re-run drills a
    non-finite step down to its birth module: the module, its faulting call's inputs, RNG and settings in
    one safetensors file that ``nanwatch replay`` re-runs anywhere. None: on unless ``NANWATCH_CAPSULE=0``.
    Costs nothing on clean steps (it runs only inside the re-run of an incident)."""

    capsule_max: int | None = None
    """At most this many capsules per run, one per incident class; default ``NANWATCH_CAPSULE_MAX`` or 4."""

    capsule_dir: str | None = None
    """Where capsules are written (a local directory); default ``NANWATCH_CAPSULE_DIR`` or
    ``./nanwatch-capsules``."""

    capsule_max_bytes: int | None = None
    """A capsule's size limit: parameters first, then inputs; what does not fit is listed in it as dropped.
    Default ``NANWATCH_CAPSULE_MAX_BYTES`` or 256 MiB."""

    # ---- spikes (nanwatch.hooks.measure.spikes) -----------------------------------------------------
    spike_factor: float = 10.0
    """A site's value (forward: its output's amax; backward: its gradient's; ``mon.watch("loss", loss)``: the
    loss) above this many times its baseline is a spike (Megatron-LM's k = 10). 0 turns spikes off. Checked
    on the reporter thread from the values every report already carries: no cost in the training step."""

    spike_window: int = 20
    """The baseline: the site's largest value over its last this many measured steps."""

    spike_warmup: int = 10
    """The first this many measured steps of each site are never a spike (initialisation, first updates)."""

    spike_action: SpikeAction = "report"
    """``report``: a spike is a precursor in the report and the log, never a directive, a skip or an
    incident. ``skip``: the weight guard also skips the update of a step that spiked, as a non-finite one;
    deciding before the optimizer step costs one host read of the step's values per optimizer step."""

    # ---- the rollout ---------------------------------------------------------------------------------
    rollout_cap: float = 2.0
    """The truncation cap c of ``Monitor.rlhf(rollout_logprobs=)``: a token whose ratio exp(Δlogp) leaves
    [1/c, c] counts in ``truncated_fraction``. 2.0 is verl's ``rollout_is_threshold``; the TRL integration
    passes TRL's own (``vllm_importance_sampling_clip_max``, 3.0 by default)."""

    rollout_dtype: str = "bfloat16"
    """The rollout engine's precision: what the attribution lowers one module at a time to (a torch dtype's
    name: ``bfloat16``, ``float16``)."""

    rollout_attribution: bool = True
    """On a drift or outlier-sequence event, re-run the worst sequences (kept from ``Monitor.rlhf(input_ids=)``)
    outside the step to name the module whose precision explains the mismatch. Once per run and cause; never a
    collective (a sharded model is refused, with a note)."""

    # ---- directives --------------------------------------------------------------------------------
    directive_source: DirectiveSource = "auto"
    """Who issues directives: ``collector`` (its rules), ``local`` (the same default rules, run in the trainer
    by ``LocalRuleEngine``: a remedy without a service), ``auto`` (local without a collector, the
    collector's with one), ``off``."""

    directive_check_every: int = 4
    """Under torch.distributed, ranks agree on the active directive every K steps: one all-reduce of four
    int64 on a CPU (gloo) group, no device sync. A directive applies at most K steps after a rank learned of
    it; what one agreement costs is in ``docs/benchmarks.md``. Without torch.distributed there is nothing
    to agree on: a directive applies at the next step boundary."""

    logit_tau: float = DEFAULT_LOGIT_TAU
    """The local rule engine's attention-logit threshold (the collector has its own: NANWATCH_LOGIT_TAU)."""

    # ---- reports -----------------------------------------------------------------------------------
    max_pending_reports: int = 8
    """Steps whose stats may wait for the reporter thread; beyond that a step's report is dropped and
    counted rather than stalling training."""

    on_report: Callable[[StepReport], None] | None = None
    """Called on the reporter thread with every finished StepReport (exceptions are logged, not raised)."""

    report_scope: ReportScopeChoice = "auto"
    """Under torch.distributed, whom step reports speak for: ``rank`` (each rank posts its own, every step),
    ``job`` (one job report per job-step: per-site figures reduced across ranks in the reporter thread,
    posted by rank 0; a rank that differs posts its own beside it as a ``detail``; the others a heartbeat),
    or ``auto``: ``job`` from 16 ranks on. Below that a job's per-rank reports cost a collector little and
    keep every rank's own view; from there the collector's load, which grows with ranks in per-rank mode,
    is what limits how many jobs it holds (``docs/benchmarks.md``). Must be the same on every rank (``job``
    creates a gloo group at attach, collectively)."""

    heartbeat_s: float | None = None
    """Job scope: a rank other than 0 that has nothing to add to the job report posts a heartbeat this
    often (rank 0's job reports are its own), so that a rank that stops is seen; the heartbeat carries the
    interval, and the collector holds the rank live for three of them. None: ``max(30, world_size / 100)``
    seconds, so that one job's heartbeats stay under 100 requests a second whatever its size. Up to 3,000
    ranks a rank that stops is alerted as fast as in per-rank mode; beyond, after two of its intervals (the
    job's reduction, which every rank joins every step, stops within ``report_reduce_timeout_s`` and says
    so sooner)."""

    report_reduce_timeout_s: float = 60.0
    """Job scope: how long the reporter thread waits in one collective of the job report's reduction for a
    peer before giving up on job reports for good (warned; per-rank reports from then on). Training never
    waits on it: only the reporter thread does, and the reports it cannot build meanwhile are dropped."""

    close_timeout: float = 3.0
    """The most seconds ``Monitor.close()`` waits for the last reports to reach the collector (its
    ``timeout=`` overrides it for one close; capsules still being written get the same bound, separately). A
    request the collector has not answered by then is cut off; what was not delivered is kept on disk, in
    ``<log_dir>/undelivered`` (``log_dir`` or ``NANWATCH_LOG_DIR``), else ``$XDG_STATE_HOME/nanwatch/undelivered``
    (``~/.local/state/nanwatch/undelivered``), one folder per run, for ``nanwatch push`` to send later; the
    close logs how many were delivered, how many were kept (where) and how many were lost (which steps)."""

    # ---- the local record: log lines and a JSONL file (nanwatch.hooks.report.local_log) -------------
    log_incidents: bool = True
    """Log one line (``logging.getLogger("nanwatch")``, WARNING) when a non-finite episode starts, when an
    incident is classified, when the attention mode changes and when the values turn finite again: in the
    training log, where people already look, even without a collector. Never once per NaN step."""

    log_every: int | None = None
    """Also log a one-line summary every N training steps (at INFO); None: none."""

    log_dir: str | None = None
    """Folder for a JSONL record of every report (``nanwatch status --file`` reads it); None: the
    ``NANWATCH_LOG_DIR`` environment variable (read by ``resolve_config``); neither: no file. One file per
    run, rank and incarnation, written on the reporter thread; an unwritable folder is warned about once,
    never raised."""

    log_max_bytes: int = 64 << 20
    """Rotate the JSONL file when it would grow past this many bytes."""

    log_backups: int = 4
    """Rotated JSONL files kept beside the current one (``.1`` the newest), at least 1: the record is bounded
    by ``log_max_bytes * (log_backups + 1)``."""

    def __post_init__(self) -> None:
        """Validation only: no environment, no file."""
        _check_run(self)
        _check_measuring(self)
        _check_remedies(self)
        _check_rollout(self)
        _check_spikes(self)
        _check_directives_and_reports(self)
        _check_local_record(self)


def _check_run(c: MonitorConfig) -> None:
    try:
        _RUN_ID.validate_python(c.run_id, strict=True)
    except ValidationError:
        raise ValueError(f"run_id {c.run_id!r} is not valid: use 1-128 of letters, digits and ._:@+=- "
                         "(it becomes a URL path segment and a Prometheus label)") from None
    if c.collector is not None:
        collector_urls(c.collector)  # a ValueError that says what is expected


def _check_measuring(c: MonitorConfig) -> None:
    if c.exact_logit_every < 0:
        raise ValueError(f"exact_logit_every must be >= 0 (0 disables), got {c.exact_logit_every}")
    if c.exact_logit_chunk_elems < 1:
        raise ValueError(f"exact_logit_chunk_elems must be >= 1, got {c.exact_logit_chunk_elems}")
    if c.optimizer_check_every is not None and c.optimizer_check_every < 1:
        raise ValueError(f"optimizer_check_every must be >= 1 or None (optimizer_check=False turns the check off), "
                         f"got {c.optimizer_check_every}")
    if c.param_check_every < 0:
        raise ValueError(f"param_check_every must be >= 0 (0 disables), got {c.param_check_every}")


def _check_rollout(c: MonitorConfig) -> None:
    if not (isinstance(c.rollout_cap, (int, float)) and c.rollout_cap > 1 and math.isfinite(c.rollout_cap)):
        raise ValueError(f"rollout_cap must be a finite number > 1, got {c.rollout_cap!r}")
    if not isinstance(getattr(torch, c.rollout_dtype, None), torch.dtype) or c.rollout_dtype.startswith("int"):
        raise ValueError(f"rollout_dtype must name a floating torch dtype (bfloat16, float16), got "
                         f"{c.rollout_dtype!r}")


def _check_spikes(c: MonitorConfig) -> None:
    if not (isinstance(c.spike_factor, (int, float)) and math.isfinite(c.spike_factor)
            and (c.spike_factor == 0 or c.spike_factor > 1)):
        raise ValueError(f"spike_factor must be a finite number > 1, or 0 (off), got {c.spike_factor!r}")
    if not (isinstance(c.spike_window, int) and c.spike_window >= 1):
        raise ValueError(f"spike_window must be an int >= 1, got {c.spike_window!r}")
    if not (isinstance(c.spike_warmup, int) and c.spike_warmup >= 0):
        raise ValueError(f"spike_warmup must be an int >= 0, got {c.spike_warmup!r}")
    if c.spike_action not in ("report", "skip"):
        raise ValueError(f"spike_action must be 'report' or 'skip', got {c.spike_action!r}")


def _check_remedies(c: MonitorConfig) -> None:
    if not (isinstance(c.replica_check_every, int) and c.replica_check_every >= 0):
        raise ValueError(f"replica_check_every must be an int >= 0 (0: off), got {c.replica_check_every!r}")
    if c.guard not in ("auto", "off"):
        raise ValueError(f"guard must be 'auto' or 'off', got {c.guard!r}")
    if c.process_group is not None and not (torch.distributed.is_available()
                                            and isinstance(c.process_group, torch.distributed.ProcessGroup)):
        raise ValueError(f"process_group must be a torch.distributed ProcessGroup (or None: the default "
                         f"group), got {type(c.process_group).__name__}")
    if c.capsule_dir is not None and not isinstance(c.capsule_dir, str):
        c.capsule_dir = os.fspath(c.capsule_dir)
    if c.capsule_dir is not None and "://" in c.capsule_dir:
        raise ValueError(f"capsule_dir {c.capsule_dir!r}: object-store URLs are not supported yet; "
                         "use a local directory")
    if c.capsule_max is not None and c.capsule_max < 0:
        raise ValueError(f"capsule_max must be >= 0 (0: no capsules), got {c.capsule_max}")
    if c.capsule_max_bytes is not None and c.capsule_max_bytes < 4096:
        raise ValueError(f"capsule_max_bytes must be >= 4096, got {c.capsule_max_bytes}")


def _check_directives_and_reports(c: MonitorConfig) -> None:
    if c.directive_source not in ("auto", "local", "collector", "off"):
        raise ValueError(f"directive_source must be 'auto', 'local', 'collector' or 'off', "
                         f"got {c.directive_source!r}")
    if c.directive_check_every < 1:
        raise ValueError(f"directive_check_every must be >= 1, got {c.directive_check_every}")
    if c.logit_tau <= 0:
        raise ValueError(f"logit_tau must be > 0, got {c.logit_tau}")
    if c.max_pending_reports < 1:
        raise ValueError(f"max_pending_reports must be >= 1, got {c.max_pending_reports}")
    if c.report_scope not in ("auto", "rank", "job"):
        raise ValueError(f"report_scope must be 'auto', 'rank' or 'job', got {c.report_scope!r}")
    if c.heartbeat_s is not None and not 0 < c.heartbeat_s <= 86_400:
        raise ValueError(f"heartbeat_s must be > 0 and at most a day (86400), or None, got {c.heartbeat_s}")
    if not c.report_reduce_timeout_s > 0:
        raise ValueError(f"report_reduce_timeout_s must be > 0, got {c.report_reduce_timeout_s}")
    if not 0 <= c.close_timeout <= 3600:
        raise ValueError(f"close_timeout must be between 0 and 3600 seconds, got {c.close_timeout}")


def _check_local_record(c: MonitorConfig) -> None:
    if c.log_every is not None and c.log_every < 1:
        raise ValueError(f"log_every must be >= 1, or None (no summary lines), got {c.log_every}")
    if c.log_max_bytes < 1024:
        raise ValueError(f"log_max_bytes must be >= 1024, got {c.log_max_bytes}")
    if c.log_backups < 1:
        raise ValueError(f"log_backups must be >= 1 (the standard library never rotates with 0), "
                         f"got {c.log_backups}")
    if c.log_dir is not None and not isinstance(c.log_dir, str):
        c.log_dir = os.fspath(c.log_dir)


def resolve_config(config: MonitorConfig | None = None, *, run_id: str | None = None,
                   collector: str | Sequence[str] | None = None, **options: Any) -> MonitorConfig:
    """The config an ``attach(...)`` means, resolved: the one place that reads the environment (the ingest
    token and its file, ``NANWATCH_LOG_DIR``, ``NANWATCH_CAPSULE*``) and picks the shard a run reports to.

    ``config`` as given, or one built from the arguments. Arguments beside a ``config`` that say something
    else would be silently dropped: a ValueError instead (repeating the config's own values is fine).
    Returns a new config (``dataclasses.replace``), or ``config`` itself when there is nothing to fill in;
    resolving a resolved config changes nothing."""
    config = _config_for(config, run_id=run_id, collector=collector, options=options)
    changes: dict[str, Any] = {}
    collectors = config.collectors
    if config.collector is not None and not collectors:
        collectors = tuple(collector_urls(config.collector))
        changes["collector"] = pick_collector(collectors, config.run_id)
    if config.token is None:
        changes["token"] = token_from_env("NANWATCH_TOKEN")
    if config.log_dir is None:
        changes["log_dir"] = os.environ.get("NANWATCH_LOG_DIR") or None
    changes.update(_capsule_settings(config))
    changes = {k: v for k, v in changes.items() if getattr(config, k) != v}
    if not changes and collectors == config.collectors:
        return config
    resolved = replace(config, **changes)
    resolved.collectors = collectors
    return resolved


def _config_for(config: MonitorConfig | None, *, run_id: str | None, collector: str | Sequence[str] | None,
                options: dict[str, Any]) -> MonitorConfig:
    """``config``, checked against the arguments beside it, or a config built from them (no I/O)."""
    if config is None:
        if run_id is None:
            raise TypeError("nanwatch.attach() needs run_id= (or config=)")
        return MonitorConfig(run_id=run_id, collector=collector, **options)
    for key, value in {"run_id": run_id, "collector": collector, **options}.items():
        if value is None and key in ("run_id", "collector"):
            continue
        if key not in MonitorConfig.__dataclass_fields__:
            raise ValueError(f"nanwatch.attach(): {key}= is not a MonitorConfig field")
        same = (_shards(value) == (config.collectors or _shards(config.collector)) if key == "collector"
                else getattr(config, key) == value)
        if not same:
            raise ValueError(f"nanwatch.attach(): {key}={value!r} conflicts with config.{key}="
                             f"{getattr(config, key)!r}; set it in the config, or pass one of the two")
    return config


def _shards(value: str | Sequence[str] | None) -> tuple[str, ...]:
    return () if value is None else tuple(collector_urls(value))


def _capsule_settings(config: MonitorConfig) -> dict[str, Any]:
    """The capsule fields a config leaves unset, from ``NANWATCH_CAPSULE*`` or the defaults. A variable
    that does not parse turns capsules off with a warning: a bad variable must not stop training."""
    env, found = os.environ, {}
    if config.capsule is None:
        found["capsule"] = env.get("NANWATCH_CAPSULE", "1").strip().lower() not in ("0", "false", "off", "no")
    try:
        for name, (var, default, least) in _CAPSULE_LIMITS.items():
            if getattr(config, name) is None:
                found[name] = _int_variable(var, default, least)
        if config.capsule_dir is None:
            found["capsule_dir"] = env.get("NANWATCH_CAPSULE_DIR") or _CAPSULE_DIR_DEFAULT
            if "://" in found["capsule_dir"]:
                raise ValueError(f"NANWATCH_CAPSULE_DIR {found['capsule_dir']!r}: object-store URLs are not "
                                 "supported yet; use a local directory")
    except ValueError as exc:
        log.warning("nanwatch: incident capsules off: %s", exc)
        return {"capsule": False, "capsule_max": 0, "capsule_max_bytes": config.capsule_max_bytes or 4096,
                "capsule_dir": config.capsule_dir or _CAPSULE_DIR_DEFAULT}
    return found


def _int_variable(var: str, default: int, least: int) -> int:
    raw = os.environ.get(var)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{var} must be an integer, got {raw!r}") from None
    if value < least:
        raise ValueError(f"{var} must be >= {least}, got {value}")
    return value
