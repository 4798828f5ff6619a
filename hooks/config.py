"""Monitor configuration in sections: data, validated at construction, resolved against the environment in
one place.

``MonitorConfig`` holds the run's identity (``run_id``, where it reports, ``rank``, ``world_size``) and one
section per concern, each a small dataclass that validates itself, as torchtitan's ``JobConfig``. The part
doing a concern's work receives its section, and the identity values it needs as arguments, never the
whole config; the Monitor (``nanwatch.hooks.facade``) is the one place that holds it all and hands it out:

* ``measure`` (:class:`MeasureConfig`): the sites read in the forward and backward passes (the probes);
* ``weights`` (:class:`WeightsConfig`): the weights and the optimizer step that writes them: the weight
  guard and the group its flag is reduced over, and the three checks that read the weights and the covered
  optimizers' state outside the forward (after an update, in rotation at step start, across replicas).
  They are one section because they run around the optimizer step, on the optimizers nanwatch covers, from
  one place (``StepRemedies`` and its ``OptimizerHooks``), and answer one question: are the weights right?
  It is not called "guard": that word is the weight guard's alone (docs/glossary.md), and the checks are
  not guards;
* ``forensics`` (:class:`ForensicsConfig`): the differential rerun of a first non-finite step and the
  incident capsules it writes;
* ``spikes`` (:class:`SpikesConfig`): a value jumping k× over its recent past, before it overflows;
* ``rollout`` (:class:`RolloutConfig`): RLHF, the sampler against the trainer (its cap, its precision, the
  attribution);
* ``directives`` (:class:`DirectivesConfig`): who issues directives and how ranks agree on them;
* ``reports`` (:class:`ReportsConfig`): the reporter thread, the job scope and heartbeats, the close;
* ``log`` (:class:`LocalLogConfig`): the local record, log lines and a JSONL file.

The sections live here, beside each other, rather than beside their parts: every subpackage may import
this module (it sits below them all), the flat names below need them all, and the docs render them in one
table.

**Flat options.** ``attach(model, spike_factor=5)``, the integrations' callbacks and ``nanwatch bench
kernels --config`` name options flat; :data:`FLAT_OPTIONS` is the one place that maps a flat name to its
section and field (``spike_factor`` is ``spikes.factor``), :meth:`MonitorConfig.from_options` builds a config
from them, and an unknown name is a TypeError naming the nearest ones.

``MonitorConfig(...)`` does no I/O: it checks its values and raises a ValueError that says what is
expected. What a config leaves to the environment (the ingest token, ``NANWATCH_LOG_DIR``, the
``NANWATCH_CAPSULE*`` settings) and the shard a run reports to are filled in by :func:`resolve_config`,
which ``attach`` and the Monitor call: it returns a new config (``dataclasses.replace``) and leaves the
given one as it was.

Example usage::

    cfg = MonitorConfig(run_id="grpo-0412", spikes=SpikesConfig(factor=5), log=LocalLogConfig(every=100))
    same = MonitorConfig.from_options(run_id="grpo-0412", spike_factor=5, log_every=100)
    assert cfg == same and cfg.spikes.factor == 5
"""

from __future__ import annotations

import difflib
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
from nanwatch.wire import RoutingReplay, RunId, StepReport

__all__ = ["FLAT_OPTIONS", "SECTIONS", "DirectiveSource", "DirectivesConfig", "ForensicsConfig", "GuardChoice",
           "LocalLogConfig", "MeasureConfig", "MonitorConfig", "ReportScopeChoice", "ReportsConfig",
           "RolloutConfig", "SpikeAction", "SpikesConfig", "WeightsConfig", "default_is_attention", "flat_option",
           "resolve_config"]

log = logging.getLogger("nanwatch")

_ATTENTION_NAME = re.compile(r"(attention|attn|deltanet)$", re.IGNORECASE)
_RUN_ID = TypeAdapter(RunId)
#: Who issues the directives a trainer applies (``DirectivesConfig.source``).
DirectiveSource = Literal["auto", "local", "collector", "off"]
#: Whom a trainer's reports speak for (``ReportsConfig.scope``).
ReportScopeChoice = Literal["auto", "rank", "job"]
#: Whether nanwatch puts a weight guard on the optimizers that step the model (``WeightsConfig.guard``).
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


def _say(path: str) -> str:
    """How an error names a field: its flat option name, and where it sits (``spike_factor (spikes.factor)``)."""
    flat = _FLAT_OF.get(path, path)
    return path if flat == path else f"{flat} ({path})"


@dataclass(kw_only=True, slots=True)
class MeasureConfig:
    """What is read in the forward and backward passes: the sites (``nanwatch.hooks.instrument``'s probes)."""

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

    def __post_init__(self) -> None:
        if self.exact_logit_every < 0:
            raise ValueError(f"{_say('measure.exact_logit_every')} must be >= 0 (0 disables), "
                             f"got {self.exact_logit_every}")
        if self.exact_logit_chunk_elems < 1:
            raise ValueError(f"{_say('measure.exact_logit_chunk_elems')} must be >= 1, "
                             f"got {self.exact_logit_chunk_elems}")


@dataclass(kw_only=True, slots=True)
class WeightsConfig:
    """The weights and the optimizer step that writes them: the weight guard, and the checks that read the
    weights and the covered optimizers' state outside the forward (``nanwatch.hooks.remedies.optimizer_hooks``)."""

    guard: GuardChoice = "auto"
    """The weight guard (``nanwatch.hooks.remedies.weight_guard``): a step in which a monitored site saw a
    non-finite value does not update the weights. ``auto``: every ``torch.optim.Optimizer`` that steps the
    model's parameters gets one, the one passed as ``optimizer=`` and any other found at its first step (a
    global optimizer-step pre-hook, ``nanwatch.hooks.remedies.optimizer_discovery``). A fused optimizer's
    weight guard works on the device at no cost; others at one host read of the step's flag per optimizer step (what
    GradScaler pays for them). ``off``: nanwatch never skips a step and issues no flag reduction (an
    explicit ``Monitor.guard(opt)`` still puts a weight guard on ``opt``)."""

    guard_reduce: bool = True
    """Under torch.distributed, reduce the weight guard's flag across ``process_group`` (one async
    all-reduce of two float32 per optimizer step, see ``nanwatch.hooks.measure.collective``). False only when
    the ranks share no gradients (independent models): each rank then decides alone."""

    process_group: Any = None
    """The training process group (a ``torch.distributed`` ProcessGroup) the weight guard reduces its
    non-finite flag over, so that every rank skips a step any rank saw a non-finite value in. None: the
    default group. Pass the data-parallel group when ranks of other groups hold other parameters (tensor or
    pipeline parallelism) and must not skip with it. A CPU model needs a group that reduces CPU tensors
    (gloo); with None and an NCCL default group, nanwatch makes a gloo group once."""

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

    param_check_every: int = 0
    """Check every parameter (and every optimizer-state tensor of the optimizers nanwatch covers)
    once in this many steps, a rotating share at each step start, so that a tensor already non-finite is
    named as a site of its own before any forward; 0 (the default) turns it off. Off by default because it
    is not needed to name the tensor: every localising site is read every step, so a non-finite weight is
    met at its next use, at the module holding it (the first offender; a NaN ``exp_avg`` reaches the weight
    at the next update), and the differential rerun reads every parameter and optimizer-state tensor once
    on that incident and names it (``nanwatch.hooks.forensics.incident_tensors``). On, it reads all of them
    every N steps (~6 GB a step at 8B with N=8)."""

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

    def __post_init__(self) -> None:
        if self.guard not in ("auto", "off"):
            raise ValueError(f"{_say('weights.guard')} must be 'auto' or 'off', got {self.guard!r}")
        if self.process_group is not None and not (torch.distributed.is_available()
                                                   and isinstance(self.process_group, torch.distributed.ProcessGroup)):
            raise ValueError(f"{_say('weights.process_group')} must be a torch.distributed ProcessGroup (or None: "
                             f"the default group), got {type(self.process_group).__name__}")
        if self.optimizer_check_every is not None and self.optimizer_check_every < 1:
            raise ValueError(f"{_say('weights.optimizer_check_every')} must be >= 1 or None (optimizer_check=False "
                             f"turns the check off), got {self.optimizer_check_every}")
        if self.param_check_every < 0:
            raise ValueError(f"{_say('weights.param_check_every')} must be >= 0 (0 disables), "
                             f"got {self.param_check_every}")
        if not (isinstance(self.replica_check_every, int) and self.replica_check_every >= 0):
            raise ValueError(f"{_say('weights.replica_check_every')} must be an int >= 0 (0: off), "
                             f"got {self.replica_check_every!r}")


@dataclass(kw_only=True, slots=True)
class ForensicsConfig:
    """What happens after a first non-finite step: the differential rerun that classifies it, and the
    incident capsule it writes (``nanwatch.hooks.forensics.rerun``, ``nanwatch.hooks.forensics.capsule``)."""

    rerun: bool | None = None
    """Classify the run's first non-finite step by the differential rerun (``nanwatch.hooks.forensics.rerun``)
    while a weight guard is effective, on every device; None (the default) or True: on, False: off. On the CPU
    the step is decided at its end (reading its non-finite flag there is free). On an accelerator nothing is
    read on the host in the step: the flag is copied asynchronously with an event, and the step is decided
    at the next step start, or else at the next optimizer pre-step, once the flag has landed, on the weights
    the step saw (the guard skipped its update); its inputs are kept (by reference) one step longer, and the
    incident lands in that later step's report with its own ``step``. A flag that lands only after the
    weights may have moved gives ``not_classified``, saying so (``nanwatch.hooks.forensics.rerun_flags``)."""

    capsule: bool | None = None
    """Write an incident capsule (``nanwatch.hooks.forensics.capsule``) when the differential re-run drills a
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

    def __post_init__(self) -> None:
        if self.capsule_dir is not None and not isinstance(self.capsule_dir, str):
            self.capsule_dir = os.fspath(self.capsule_dir)
        if self.capsule_dir is not None and "://" in self.capsule_dir:
            raise ValueError(f"{_say('forensics.capsule_dir')} {self.capsule_dir!r}: object-store URLs are not "
                             "supported yet; use a local directory")
        if self.capsule_max is not None and self.capsule_max < 0:
            raise ValueError(f"{_say('forensics.capsule_max')} must be >= 0 (0: no capsules), got {self.capsule_max}")
        if self.capsule_max_bytes is not None and self.capsule_max_bytes < 4096:
            raise ValueError(f"{_say('forensics.capsule_max_bytes')} must be >= 4096, got {self.capsule_max_bytes}")


@dataclass(kw_only=True, slots=True)
class SpikesConfig:
    """A value jumping k× over its recent past, before it overflows (``nanwatch.hooks.measure.spikes``)."""

    factor: float = 10.0
    """A site's value (forward: its output's amax; backward: its gradient's; ``mon.watch("loss", loss)``: the
    loss) above this many times its baseline is a spike (Megatron-LM's k = 10). 0 turns spikes off. Checked
    on the reporter thread from the values every report already carries: no cost in the training step."""

    window: int = 20
    """The baseline: the site's largest value over its last this many measured steps."""

    warmup: int = 10
    """The first this many measured steps of each site are never a spike (initialisation, first updates)."""

    action: SpikeAction = "report"
    """``report``: a spike is a precursor in the report and the log, never a directive, a skip or an
    incident. ``skip``: the weight guard also skips the update of a step that spiked, as a non-finite one;
    deciding before the optimizer step costs one host read of the step's values per optimizer step."""

    def __post_init__(self) -> None:
        if not (isinstance(self.factor, (int, float)) and math.isfinite(self.factor)
                and (self.factor == 0 or self.factor > 1)):
            raise ValueError(f"{_say('spikes.factor')} must be a finite number > 1, or 0 (off), got {self.factor!r}")
        if not (isinstance(self.window, int) and self.window >= 1):
            raise ValueError(f"{_say('spikes.window')} must be an int >= 1, got {self.window!r}")
        if not (isinstance(self.warmup, int) and self.warmup >= 0):
            raise ValueError(f"{_say('spikes.warmup')} must be an int >= 0, got {self.warmup!r}")
        if self.action not in ("report", "skip"):
            raise ValueError(f"{_say('spikes.action')} must be 'report' or 'skip', got {self.action!r}")


@dataclass(kw_only=True, slots=True)
class RolloutConfig:
    """RLHF: the rollout engine's logprobs against the trainer's (``Monitor.rlhf(rollout_logprobs=)``), the
    weights it was given (``Monitor.publish_weights``), and, for MoE, the experts it routed to
    (``rlhf(rollout_routes=)``, ``routing_replay``)."""

    cap: float = 2.0
    """The truncation cap c of ``Monitor.rlhf(rollout_logprobs=)``: a token whose ratio exp(Δlogp) leaves
    [1/c, c] counts in ``truncated_fraction``. 2.0 is verl's ``rollout_is_threshold``; the TRL integration
    passes TRL's own (``vllm_importance_sampling_clip_max``, 3.0 by default)."""

    dtype: str = "bfloat16"
    """The rollout engine's precision: what the attribution lowers one module at a time to (a torch dtype's
    name: ``bfloat16``, ``float16``)."""

    attribution: bool = True
    """On a drift or outlier-sequence event, re-run the worst sequences (kept from ``Monitor.rlhf(input_ids=)``)
    outside the step to name the module whose precision explains the mismatch. Once per run and cause; never a
    collective (a sharded model is refused, with a note)."""

    routing_replay: RoutingReplay = "off"
    """MoE routing replay (R3, docs/moe.md): ``off``; ``verify``: the trainer replays the rollout's routes itself
    (``Monitor.routes(R)`` or ``rlhf(rollout_routes=R)`` says which), and any token whose experts' input
    differs is a ``routing_replay_not_applied`` event (a critical page); ``apply``: nanwatch makes each
    router's selected experts the rollout's, keeping the trainer's probabilities renormalised over them."""

    def __post_init__(self) -> None:
        if self.routing_replay not in ("off", "verify", "apply"):
            raise ValueError(f"{_say('rollout.routing_replay')} must be 'off', 'verify' or 'apply', got "
                             f"{self.routing_replay!r}")
        if not (isinstance(self.cap, (int, float)) and self.cap > 1 and math.isfinite(self.cap)):
            raise ValueError(f"{_say('rollout.cap')} must be a finite number > 1, got {self.cap!r}")
        if not isinstance(getattr(torch, self.dtype, None), torch.dtype) or self.dtype.startswith("int"):
            raise ValueError(f"{_say('rollout.dtype')} must name a floating torch dtype (bfloat16, float16), got "
                             f"{self.dtype!r}")


@dataclass(kw_only=True, slots=True)
class DirectivesConfig:
    """Who issues the directives a trainer applies, and how its ranks agree on them
    (``nanwatch.hooks.directives``)."""

    source: DirectiveSource = "auto"
    """Who issues directives: ``collector`` (its rules), ``local`` (the same default rules, run in the trainer
    by ``LocalRuleEngine``: a remedy without a service), ``auto`` (local without a collector, the
    collector's with one), ``off``."""

    check_every: int = 4
    """Under torch.distributed, ranks agree on the active directive every K steps: one all-reduce of four
    int64 on a CPU (gloo) group, no device sync. A directive applies at most K steps after a rank learned of
    it; what one agreement costs is in ``docs/benchmarks.md``. Without torch.distributed there is nothing
    to agree on: a directive applies at the next step boundary."""

    logit_tau: float = DEFAULT_LOGIT_TAU
    """The local rule engine's attention-logit threshold (the collector has its own: NANWATCH_LOGIT_TAU)."""

    def __post_init__(self) -> None:
        if self.source not in ("auto", "local", "collector", "off"):
            raise ValueError(f"{_say('directives.source')} must be 'auto', 'local', 'collector' or 'off', "
                             f"got {self.source!r}")
        if self.check_every < 1:
            raise ValueError(f"{_say('directives.check_every')} must be >= 1, got {self.check_every}")
        if self.logit_tau <= 0:
            raise ValueError(f"{_say('directives.logit_tau')} must be > 0, got {self.logit_tau}")


@dataclass(kw_only=True, slots=True)
class ReportsConfig:
    """Step reports, job reports and heartbeats: the reporter thread, whom a report speaks for, the close
    (``nanwatch.hooks.report``)."""

    max_pending: int = 8
    """Steps whose stats may wait for the reporter thread; beyond that a step's report is dropped and
    counted rather than stalling training."""

    on_report: Callable[[StepReport], None] | None = None
    """Called on the reporter thread with every finished StepReport (exceptions are logged, not raised)."""

    scope: ReportScopeChoice = "auto"
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

    reduce_timeout_s: float = 60.0
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

    def __post_init__(self) -> None:
        if self.max_pending < 1:
            raise ValueError(f"{_say('reports.max_pending')} must be >= 1, got {self.max_pending}")
        if self.scope not in ("auto", "rank", "job"):
            raise ValueError(f"{_say('reports.scope')} must be 'auto', 'rank' or 'job', got {self.scope!r}")
        if self.heartbeat_s is not None and not 0 < self.heartbeat_s <= 86_400:
            raise ValueError(f"{_say('reports.heartbeat_s')} must be > 0 and at most a day (86400), or None, "
                             f"got {self.heartbeat_s}")
        if not self.reduce_timeout_s > 0:
            raise ValueError(f"{_say('reports.reduce_timeout_s')} must be > 0, got {self.reduce_timeout_s}")
        if not 0 <= self.close_timeout <= 3600:
            raise ValueError(f"{_say('reports.close_timeout')} must be between 0 and 3600 seconds, "
                             f"got {self.close_timeout}")


@dataclass(kw_only=True, slots=True)
class LocalLogConfig:
    """The local record: log lines and a JSONL file (``nanwatch.hooks.report.local_log``)."""

    incidents: bool = True
    """Log one line (``logging.getLogger("nanwatch")``, WARNING) when a non-finite episode starts, when an
    incident is classified, when the attention mode changes and when the values turn finite again: in the
    training log, where people already look, even without a collector. Never once per NaN step."""

    every: int | None = None
    """Also log a one-line summary every N training steps (at INFO); None: none."""

    dir: str | None = None
    """Folder for a JSONL record of every report (``nanwatch status --file`` reads it); None: the
    ``NANWATCH_LOG_DIR`` environment variable (read by ``resolve_config``); neither: no file. One file per
    run, rank and incarnation, written on the reporter thread; an unwritable folder is warned about once,
    never raised."""

    max_bytes: int = 64 << 20
    """Rotate the JSONL file when it would grow past this many bytes."""

    backups: int = 4
    """Rotated JSONL files kept beside the current one (``.1`` the newest), at least 1: the record is bounded
    by ``log_max_bytes * (log_backups + 1)``."""

    def __post_init__(self) -> None:
        if self.every is not None and self.every < 1:
            raise ValueError(f"{_say('log.every')} must be >= 1, or None (no summary lines), got {self.every}")
        if self.max_bytes < 1024:
            raise ValueError(f"{_say('log.max_bytes')} must be >= 1024, got {self.max_bytes}")
        if self.backups < 1:
            raise ValueError(f"{_say('log.backups')} must be >= 1 (the standard library never rotates with 0), "
                             f"got {self.backups}")
        if self.dir is not None and not isinstance(self.dir, str):
            self.dir = os.fspath(self.dir)


@dataclass(kw_only=True, slots=True)
class MonitorConfig:
    """What to measure and where to send it: the run's identity, then one section per concern (the module
    docstring says which part receives which). Defaults are the cheap, always-on set.

    Constructing one reads nothing: a field left to the environment stays None until
    :func:`resolve_config`. Flat option names (``spike_factor=5``) build one through :meth:`from_options`.
    Measured costs of the defaults are in ``docs/benchmarks.md``.
    """

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

    measure: MeasureConfig = field(default_factory=MeasureConfig)
    """What is read in the forward and backward passes (the probes)."""

    weights: WeightsConfig = field(default_factory=WeightsConfig)
    """The weight guard, and the checks of the weights and optimizer state around the optimizer step."""

    forensics: ForensicsConfig = field(default_factory=ForensicsConfig)
    """The differential rerun of the first non-finite step, and its incident capsules."""

    spikes: SpikesConfig = field(default_factory=SpikesConfig)
    """A value jumping k× over its recent past."""

    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """RLHF: the rollout engine against the trainer."""

    directives: DirectivesConfig = field(default_factory=DirectivesConfig)
    """Who issues directives, and how the ranks agree on them."""

    reports: ReportsConfig = field(default_factory=ReportsConfig)
    """The reporter thread, the job scope and heartbeats, the close."""

    log: LocalLogConfig = field(default_factory=LocalLogConfig)
    """The local record: log lines and a JSONL file."""

    def __post_init__(self) -> None:
        """Validation only (each section validated itself): no environment, no file."""
        try:
            _RUN_ID.validate_python(self.run_id, strict=True)
        except ValidationError:
            raise ValueError(f"run_id {self.run_id!r} is not valid: use 1-128 of letters, digits and ._:@+=- "
                             "(it becomes a URL path segment and a Prometheus label)") from None
        if self.collector is not None:
            collector_urls(self.collector)  # a ValueError that says what is expected
        for name, cls in SECTIONS.items():
            value = getattr(self, name)
            if not isinstance(value, cls):
                raise TypeError(f"MonitorConfig({name}=...) takes a {cls.__name__}, got {value!r}; flat options "
                                f"(guard='off', spike_factor=5) go to nanwatch.attach() or "
                                f"MonitorConfig.from_options()")

    @classmethod
    def from_options(cls, *, run_id: str, collector: str | Sequence[str] | None = None,
                     **options: Any) -> MonitorConfig:
        """A config from flat option names, as ``nanwatch.attach(model, run_id=..., spike_factor=5)`` and the
        integrations' callbacks take them (:data:`FLAT_OPTIONS`). An unknown name is a TypeError naming the
        nearest ones; a bad value the section's ValueError."""
        top: dict[str, Any] = {"run_id": run_id, "collector": collector}
        parts: dict[str, dict[str, Any]] = {}
        for name, value in options.items():
            section, name_in_section = flat_option(name)
            (top if section is None else parts.setdefault(section, {}))[name_in_section] = value
        return cls(**top, **{section: SECTIONS[section](**given) for section, given in parts.items()})

    def option(self, name: str) -> Any:
        """The value of the flat option ``name`` (``cfg.option("spike_factor") == cfg.spikes.factor``)."""
        section, name_in_section = flat_option(name)
        return getattr(self if section is None else getattr(self, section), name_in_section)


#: The sections of a MonitorConfig, by field name, in the order the docs list them.
SECTIONS: dict[str, type] = {"measure": MeasureConfig, "weights": WeightsConfig, "forensics": ForensicsConfig,
                             "spikes": SpikesConfig, "rollout": RolloutConfig, "directives": DirectivesConfig,
                             "reports": ReportsConfig, "log": LocalLogConfig}

#: Every flat option name -> where it sits (``section.field``; a bare name: the top level). The one place that
#: maps the flat names of ``attach(model, ...)``, the integrations' callbacks and ``nanwatch bench kernels
#: --config`` to the sections; a test checks that it names every field once.
FLAT_OPTIONS: dict[str, str] = {
    "run_id": "run_id", "collector": "collector", "token": "token", "rank": "rank", "world_size": "world_size",
    **{name: f"measure.{name}" for name in ("grads", "logits", "coarse", "fingerprint", "is_attention",
                                            "exact_logit_every", "exact_logit_chunk_elems")},
    **{name: f"weights.{name}" for name in ("guard", "guard_reduce", "process_group", "optimizer_check",
                                            "optimizer_check_every", "param_check_every", "replica_check_every",
                                            "replica_repair")},
    **{name: f"forensics.{name}" for name in ("rerun", "capsule", "capsule_max", "capsule_dir",
                                              "capsule_max_bytes")},
    "spike_factor": "spikes.factor", "spike_window": "spikes.window", "spike_warmup": "spikes.warmup",
    "spike_action": "spikes.action",
    "rollout_cap": "rollout.cap", "rollout_dtype": "rollout.dtype", "rollout_attribution": "rollout.attribution",
    "routing_replay": "rollout.routing_replay",
    "directive_source": "directives.source", "directive_check_every": "directives.check_every",
    "logit_tau": "directives.logit_tau",
    "max_pending_reports": "reports.max_pending", "on_report": "reports.on_report", "report_scope": "reports.scope",
    "heartbeat_s": "reports.heartbeat_s", "report_reduce_timeout_s": "reports.reduce_timeout_s",
    "close_timeout": "reports.close_timeout",
    "log_incidents": "log.incidents", "log_every": "log.every", "log_dir": "log.dir", "log_max_bytes": "log.max_bytes",
    "log_backups": "log.backups",
}
_FLAT_OF = {path: flat for flat, path in FLAT_OPTIONS.items()}


def flat_option(name: str) -> tuple[str | None, str]:
    """(section, field) of the flat option ``name`` (section None: the top level). An unknown name is a
    TypeError that lists the nearest option names."""
    path = FLAT_OPTIONS.get(name)
    if path is None:
        near = difflib.get_close_matches(name, FLAT_OPTIONS, n=4, cutoff=0.6)
        near += [flat for flat, p in FLAT_OPTIONS.items() if p.endswith("." + name) and flat not in near]
        hint = f"; the nearest: {', '.join(near)}" if near else ""
        if name in SECTIONS:
            hint += f"; a whole section goes in config=MonitorConfig({name}={SECTIONS[name].__name__}(...))"
        raise TypeError(f"nanwatch: {name}= is not an option{hint} (all of them: docs/reference.md)")
    section, _, name_in_section = path.rpartition(".")
    return section or None, name_in_section


def resolve_config(config: MonitorConfig | None = None, *, run_id: str | None = None,
                   collector: str | Sequence[str] | None = None, **options: Any) -> MonitorConfig:
    """The config an ``attach(...)`` means, resolved: the one place that reads the environment (the ingest
    token and its file, ``NANWATCH_LOG_DIR``, ``NANWATCH_CAPSULE*``) and picks the shard a run reports to.

    ``config`` as given, or one built from the arguments (flat option names, :data:`FLAT_OPTIONS`).
    Arguments beside a ``config`` that say something else would be silently dropped: a ValueError instead
    (repeating the config's own values is fine). Returns a new config (``dataclasses.replace``, every section
    copied), or ``config`` itself when there is nothing to fill in; resolving a resolved config changes
    nothing."""
    config = _config_for(config, run_id=run_id, collector=collector, options=options)
    top: dict[str, Any] = {}
    collectors = config.collectors
    if config.collector is not None and not collectors:
        collectors = tuple(collector_urls(config.collector))
        top["collector"] = pick_collector(collectors, config.run_id)
    if config.token is None:
        top["token"] = token_from_env("NANWATCH_TOKEN")
    log_dir = {"dir": os.environ.get("NANWATCH_LOG_DIR") or None} if config.log.dir is None else {}
    capsules = _capsule_settings(config.forensics)
    top = {k: v for k, v in top.items() if getattr(config, k) != v}
    log_dir = {k: v for k, v in log_dir.items() if getattr(config.log, k) != v}
    capsules = {k: v for k, v in capsules.items() if getattr(config.forensics, k) != v}
    if not (top or log_dir or capsules) and collectors == config.collectors:
        return config
    copies = {name: replace(getattr(config, name)) for name in SECTIONS}  # the given config's stay its own
    copies.update(log=replace(config.log, **log_dir), forensics=replace(config.forensics, **capsules))
    resolved = replace(config, **top, **copies)
    resolved.collectors = collectors
    return resolved


def _config_for(config: MonitorConfig | None, *, run_id: str | None, collector: str | Sequence[str] | None,
                options: dict[str, Any]) -> MonitorConfig:
    """``config``, checked against the arguments beside it, or a config built from them (no I/O)."""
    if config is None:
        if run_id is None:
            raise TypeError("nanwatch.attach() needs run_id= (or config=)")
        return MonitorConfig.from_options(run_id=run_id, collector=collector, **options)
    for key, value in {"run_id": run_id, "collector": collector, **options}.items():
        if value is None and key in ("run_id", "collector"):
            continue
        given = config.option(key)  # a TypeError for an unknown name
        same = (_shards(value) == (config.collectors or _shards(config.collector)) if key == "collector"
                else given == value)
        if not same:
            raise ValueError(f"nanwatch.attach(): {key}={value!r} conflicts with config.{FLAT_OPTIONS[key]}="
                             f"{given!r}; set it in the config, or pass one of the two")
    return config


def _shards(value: str | Sequence[str] | None) -> tuple[str, ...]:
    return () if value is None else tuple(collector_urls(value))


def _capsule_settings(config: ForensicsConfig) -> dict[str, Any]:
    """The capsule fields a forensics section leaves unset, from ``NANWATCH_CAPSULE*`` or the defaults. A
    variable that does not parse turns capsules off with a warning: a bad variable must not stop training."""
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
