"""Monitor configuration: small, typed, validated at construction."""

from __future__ import annotations

import os
import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from pydantic import TypeAdapter, ValidationError

from nanwatch.addresses import collector_urls, pick_collector
from nanwatch.policy import DEFAULT_LOGIT_TAU
from nanwatch.tokens import token_from_env
from nanwatch.wire import RunId, StepReport

__all__ = ["DirectiveSource", "GuardChoice", "MonitorConfig", "ReportScopeChoice", "default_is_attention", "resolve_config"]

_ATTENTION_NAME = re.compile(r"(attention|attn|deltanet)$", re.IGNORECASE)
_RUN_ID = TypeAdapter(RunId)
#: Who issues the directives a trainer applies (``MonitorConfig.directive_source``).
DirectiveSource = Literal["auto", "local", "collector", "off"]
#: Whom a trainer's reports speak for (``MonitorConfig.report_scope``).
ReportScopeChoice = Literal["auto", "rank", "job"]
#: Whether nanwatch guards the optimizers that step the model (``MonitorConfig.guard``).
GuardChoice = Literal["auto", "off"]


def default_is_attention(name: str, module: torch.nn.Module) -> bool:
    """Attention-like modules by class name: HF's ``*Attention``, ``*Attn``, and linear-attention layers
    such as Qwen3.5's ``*GatedDeltaNet``. Only the innermost match is instrumented."""
    return bool(_ATTENTION_NAME.search(type(module).__name__))


@dataclass(kw_only=True, slots=True)
class MonitorConfig:
    """What to measure and where to send it. Defaults are the cheap, always-on set."""

    run_id: str
    """Names the run in every report and metric label; letters, digits and ``._:@+=-``, at most 128."""

    collector: str | Sequence[str] | None = None
    """Base URL of the collector (``http://host:port``); None keeps reports in-process only. Several (a list,
    or one string separated by commas) are shards: the run reports to the one ``pick_collector`` chooses by
    a stable hash of ``run_id`` (the same on every rank), and ``collector`` then holds that one URL."""

    collectors: tuple[str, ...] = field(default=(), init=False)
    """Every shard ``collector`` named (filled at construction; one URL: just that one)."""

    token: str | None = None
    """Ingest bearer token for the collector; default: ``NANWATCH_TOKEN``, or the file ``NANWATCH_TOKEN_FILE``."""

    rank: int | None = None
    """This process's rank; default: torch.distributed's rank if initialised, else ``$RANK``, else 0."""

    world_size: int | None = None
    """Number of ranks; default: torch.distributed's world size, else ``$WORLD_SIZE``, else 1."""

    grads: bool = True
    """Also measure the gradient flowing back into every site (the backward pass)."""

    logits: bool = True
    """Measure the output-embedding (``lm_head``) output, i.e. the logits."""

    coarse: bool = True
    """Measure the output of every decoder block and of its parts (attention, MLP/MoE, norms), MoE routers and
    experts, the input embedding and the final norm, and their gradients: the first offender is then the
    part where a non-finite value was born, not the next attention layer."""

    param_check_every: int = 8
    """Check every parameter (and every optimizer-state tensor of the optimizers nanwatch guards or checks) once in this many
    steps, a rotating share at each step start, so that a tensor already non-finite is named as the birth
    site; 0 turns it off."""

    guard: GuardChoice = "auto"
    """The weight guard (``nanwatch.hooks.remedies.weight_guard``): a step in which a monitored site saw a non-finite
    value does not update the weights. ``auto``: every ``torch.optim.Optimizer`` that steps the model's
    parameters is guarded, the one passed as ``optimizer=`` and any other found at its first step (a global
    optimizer-step pre-hook, ``nanwatch.hooks.remedies.optimizer_discovery``). Fused optimizers are guarded on the
    device at no cost; others at one host read of the step's flag per optimizer step (what GradScaler pays
    for them). ``off``: nanwatch never skips a step and issues no flag reduction (an explicit
    ``Monitor.guard(opt)`` still guards ``opt``)."""

    optimizer_check: bool = True
    """After every step of an optimizer nanwatch found (passed or discovered), check the parameters it
    just wrote: one ``torch._foreach_norm(ord=inf)`` over the parameters that had a gradient, on the device
    (``nanwatch.hooks.measure.optimizer_check``). A value born in the update (fp16 AdamW's eps underflow, a huge
    learning rate) is then named at the step it happened (site kind ``param``, phase ``optimizer``), with an
    incident of class ``optimizer``, instead of at the next forward it poisons."""

    fingerprint: bool = True
    """Record each forward's input layout (position_ids, mask kind, packing, fully masked rows)."""

    exact_logit_every: int = 100
    """Compute the exact per-head max attention logit every N steps (about one attention forward of
    extra work on those steps); 0 turns it off. Other steps use the saved log-sum-exp bound."""

    exact_logit_chunk_elems: int = 1 << 24
    """Upper bound on the score elements held at once by the exact computation (memory stays bounded)."""

    is_attention: Callable[[str, torch.nn.Module], bool] = default_is_attention
    """Which modules are attention sites (given FQN and module)."""

    max_pending_reports: int = 8
    """Steps whose stats may wait for the reporter thread; beyond that a step's report is dropped and
    counted rather than stalling training."""

    on_report: Callable[[StepReport], None] | None = None
    """Called on the reporter thread with every finished StepReport (exceptions are logged, not raised)."""

    directive_check_every: int = 4
    """Under torch.distributed, ranks agree on the active directive every K steps: one all-reduce of four
    int64 on a CPU (gloo) group, no device sync. A directive applies at most K steps after a rank learned of
    it. Measured (``nanwatch bench fallback``, 2 gloo ranks on 2 CPU cores): 0.5 ms per agreement, so K=4
    keeps it under 0.1% of the benchmark's 150 ms step (README, 'Speed'). Without torch.distributed there is
    nothing to agree on: a directive applies at the next step boundary."""

    directive_source: DirectiveSource = "auto"
    """Who issues directives: ``collector`` (its rules), ``local`` (the same default rules, run in the trainer
    by ``LocalRuleEngine``: a remedy without a service), ``auto`` (local without a collector, the
    collector's with one), ``off``."""

    policy: DirectiveSource | None = None
    """Deprecated name of ``directive_source`` ("policy" now means only the shared rules,
    ``nanwatch.policy``); still accepted, with a DeprecationWarning, and copied into ``directive_source``."""

    logit_tau: float = DEFAULT_LOGIT_TAU
    """The local rule engine's attention-logit threshold (the collector has its own: NANWATCH_LOGIT_TAU)."""

    report_scope: ReportScopeChoice = "auto"
    """Under torch.distributed, whom reports speak for: ``rank`` (each rank posts its own, every step), ``job``
    (one report per job-step: per-site figures reduced across ranks in the reporter thread, posted by rank 0;
    a rank that differs posts its own beside it as a ``detail``; the others a ``heartbeat``), or ``auto``:
    ``job`` from 16 ranks on. Below that a job's per-rank reports cost a collector little (16 ranks are 1.6%
    of the 1024 reports/s one collector held at p99 73 ms, README 'Speed') and keep every rank's own view;
    from there the collector's load, which grows with ranks in per-rank mode, is what limits how many jobs
    it holds. Must be the same on every rank (``job`` creates a gloo group at attach, collectively)."""

    heartbeat_s: float | None = None
    """Job scope: a rank other than 0 that has nothing to add to the job's report posts a ``heartbeat`` this
    often (rank 0's job reports are its own), so that a rank that stops is seen; the heartbeat carries the
    interval, and the collector holds the rank live for three of them. None: ``max(30, world_size / 100)``
    seconds, so that one job's heartbeats stay under 100 requests a second whatever its size. Measured
    (``nanwatch bench collector --ranks 65536 --scope job``, 2-core VM): one heartbeat per rank every 30 s
    is 2,185 requests/s, which took 94% of a core at p99 340 ms; every 655 s (the default at 65,536 ranks) it
    is 100 a second. Up to 3,000 ranks a rank that stops is alerted as fast as in per-rank mode; beyond, after
    two of its intervals (the job's reduction, which every rank joins every step, stops within
    ``report_reduce_timeout_s`` and says so sooner)."""

    report_reduce_timeout_s: float = 60.0
    """Job scope: how long the reporter thread waits in one collective of the job report's reduction for a
    peer before giving up on job reports for good (warned; per-rank reports from then on). Training never
    waits on it: only the reporter thread does, and the reports it cannot build meanwhile are dropped."""

    replay: bool | None = None
    """Classify the run's first non-finite step by a differential replay (``nanwatch.hooks.remedies.rerun``).
    None: on when the model is on the CPU and a weight guard is attached (reading the step's non-finite
    flag is then free); True: also on a GPU, at one host read of that flag per step."""

    capsule: bool | None = None
    """Write an incident capsule (``nanwatch.hooks.remedies.capsule``) when the replay drills a non-finite step down to
    its birth module: the module, its faulting call's inputs, RNG and settings in one safetensors file that
    ``nanwatch replay`` re-runs anywhere. None: on unless ``NANWATCH_CAPSULE=0``. Costs nothing on clean steps
    (it runs only inside the replay of an incident)."""

    capsule_max: int | None = None
    """At most this many capsules per run, one per incident class; default ``NANWATCH_CAPSULE_MAX`` or 4."""

    capsule_dir: str | None = None
    """Where capsules are written (a local directory); default ``NANWATCH_CAPSULE_DIR`` or
    ``./nanwatch-capsules``."""

    capsule_max_bytes: int | None = None
    """A capsule's size limit: parameters first, then inputs; what does not fit is listed in it as dropped.
    Default ``NANWATCH_CAPSULE_MAX_BYTES`` or 256 MiB."""

    process_group: Any = None
    """The training process group (a ``torch.distributed`` ProcessGroup) the weight guard reduces its
    non-finite flag over, so that every rank skips a step any rank saw a non-finite value in. None: the
    default group. Pass the data-parallel group when ranks of other groups hold other parameters (tensor or
    pipeline parallelism) and must not skip with it. A CPU model needs a group that reduces CPU tensors
    (gloo); with None and an NCCL default group, nanwatch makes a gloo group once."""

    guard_reduce: bool = True
    """Under torch.distributed, reduce the weight guard's flag across ``process_group`` (one async
    all-reduce of two float32 per optimizer step, see ``nanwatch.hooks.measure.collective``). False only when the
    ranks share no gradients (independent models): each rank then decides alone."""

    # ---- the local record: log lines and a JSONL file (nanwatch.hooks.report.local_log) -------------------
    log_incidents: bool = True
    """Log one line (``logging.getLogger("nanwatch")``, WARNING) when a non-finite episode starts, when an
    incident is classified, when the attention mode changes and when the values turn finite again: in the
    training log, where people already look, even without a collector. Never once per NaN step."""

    log_every: int | None = None
    """Also log a one-line summary every N training steps (at INFO); None: none."""

    log_dir: str | None = None
    """Folder for a JSONL record of every report (``nanwatch status --file`` reads it); default: the
    ``NANWATCH_LOG_DIR`` environment variable; None (and no variable): no file. One file per run, rank and
    incarnation, written on the reporter thread; an unwritable folder is warned about once, never raised."""

    log_max_bytes: int = 64 << 20
    """Rotate the JSONL file when it would grow past this many bytes."""

    log_backups: int = 4
    """Rotated JSONL files kept beside the current one (``.1`` the newest), at least 1: the record is bounded
    by ``log_max_bytes * (log_backups + 1)``."""

    def __post_init__(self) -> None:
        if self.policy is not None:
            warnings.warn("MonitorConfig(policy=...) is deprecated: use directive_source=... (same values)",
                          DeprecationWarning, stacklevel=3)
            if self.directive_source not in ("auto", self.policy):
                raise ValueError(f"policy={self.policy!r} (deprecated) and directive_source="
                                 f"{self.directive_source!r} disagree: pass directive_source alone")
            self.directive_source, self.policy = self.policy, None
        if self.directive_source not in ("auto", "local", "collector", "off"):
            raise ValueError(f"directive_source must be 'auto', 'local', 'collector' or 'off', "
                             f"got {self.directive_source!r}")
        try:
            _RUN_ID.validate_python(self.run_id, strict=True)
        except ValidationError:
            raise ValueError(f"run_id {self.run_id!r} is not valid: use 1-128 of letters, digits and ._:@+=- "
                             "(it becomes a URL path segment and a Prometheus label)") from None
        if self.exact_logit_every < 0:
            raise ValueError(f"exact_logit_every must be >= 0 (0 disables), got {self.exact_logit_every}")
        if self.exact_logit_chunk_elems < 1:
            raise ValueError(f"exact_logit_chunk_elems must be >= 1, got {self.exact_logit_chunk_elems}")
        if self.max_pending_reports < 1:
            raise ValueError(f"max_pending_reports must be >= 1, got {self.max_pending_reports}")
        if self.param_check_every < 0:
            raise ValueError(f"param_check_every must be >= 0 (0 disables), got {self.param_check_every}")
        if self.guard not in ("auto", "off"):
            raise ValueError(f"guard must be 'auto' or 'off', got {self.guard!r}")
        if self.logit_tau <= 0:
            raise ValueError(f"logit_tau must be > 0, got {self.logit_tau}")
        if self.directive_check_every < 1:
            raise ValueError(f"directive_check_every must be >= 1, got {self.directive_check_every}")
        if self.process_group is not None and not (torch.distributed.is_available()
                                                   and isinstance(self.process_group, torch.distributed.ProcessGroup)):
            raise ValueError(f"process_group must be a torch.distributed ProcessGroup (or None: the default "
                             f"group), got {type(self.process_group).__name__}")
        if self.report_scope not in ("auto", "rank", "job"):
            raise ValueError(f"report_scope must be 'auto', 'rank' or 'job', got {self.report_scope!r}")
        if self.heartbeat_s is not None and not 0 < self.heartbeat_s <= 86_400:
            raise ValueError(f"heartbeat_s must be > 0 and at most a day (86400), or None, got {self.heartbeat_s}")
        if not self.report_reduce_timeout_s > 0:
            raise ValueError(f"report_reduce_timeout_s must be > 0, got {self.report_reduce_timeout_s}")
        if self.log_every is not None and self.log_every < 1:
            raise ValueError(f"log_every must be >= 1, or None (no summary lines), got {self.log_every}")
        if self.log_max_bytes < 1024:
            raise ValueError(f"log_max_bytes must be >= 1024, got {self.log_max_bytes}")
        if self.log_backups < 1:
            raise ValueError(f"log_backups must be >= 1 (the standard library never rotates with 0), "
                             f"got {self.log_backups}")
        if self.log_dir is None:
            self.log_dir = os.environ.get("NANWATCH_LOG_DIR") or None
        elif not isinstance(self.log_dir, str):
            self.log_dir = os.fspath(self.log_dir)
        if self.capsule_dir is not None and not isinstance(self.capsule_dir, str):
            self.capsule_dir = os.fspath(self.capsule_dir)
        if self.capsule_dir is not None and "://" in self.capsule_dir:
            raise ValueError(f"capsule_dir {self.capsule_dir!r}: object-store URLs are not supported yet; "
                             "use a local directory")
        if self.capsule_max is not None and self.capsule_max < 0:
            raise ValueError(f"capsule_max must be >= 0 (0: no capsules), got {self.capsule_max}")
        if self.capsule_max_bytes is not None and self.capsule_max_bytes < 4096:
            raise ValueError(f"capsule_max_bytes must be >= 4096, got {self.capsule_max_bytes}")
        if self.collector is not None:
            self.collectors = tuple(collector_urls(self.collector))
            if len(self.collectors) > 1 or not isinstance(self.collector, str):
                self.collector = pick_collector(self.collectors, self.run_id)
        if self.token is None:
            self.token = token_from_env("NANWATCH_TOKEN")


def resolve_config(config: MonitorConfig | None, *, run_id: str | None, collector: str | None,
                   **options) -> MonitorConfig:
    """The config an ``attach(...)`` call means: ``config`` as given, or one built from the arguments.
    Arguments beside a ``config`` that say something else would be silently dropped: a ValueError instead
    (repeating the config's own values is fine)."""
    if config is None:
        if run_id is None:
            raise TypeError("nanwatch.attach() needs run_id= (or config=)")
        return MonitorConfig(run_id=run_id, collector=collector, **options)
    for key, value in {"run_id": run_id, "collector": collector, **options}.items():
        if value is None and key in ("run_id", "collector"):
            continue
        name = "directive_source" if key == "policy" else key
        if name not in MonitorConfig.__dataclass_fields__:
            raise ValueError(f"nanwatch.attach(): {key}= is not a MonitorConfig field")
        same = (tuple(collector_urls(value)) == config.collectors if key == "collector"
                else getattr(config, name) == value)
        if not same:
            raise ValueError(f"nanwatch.attach(): {key}={value!r} conflicts with config.{name}="
                             f"{getattr(config, name)!r}; set it in the config, or pass one of the two")
    return config
