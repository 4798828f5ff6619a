"""One step's measurements: host-side bookkeeping (names, order, shapes) plus device-side values.

The hot path only launches device ops and appends to host lists: a measured tensor costs one ``aminmax``
into the observation log (``nanwatch.hooks.measure.observations``); a per-call figure whose step value is a max
over calls (a layer's per-head logit figure, a forward's fully masked rows) costs the one op that computes it,
written into a row of ``nanwatch.hooks.measure.max_rows``; fingerprint counts and RLHF sums go to named slots
of the SlotBuffer. At step end all three are flattened into one device tensor for one asynchronous copy,
and ``swap()`` hands the step's site table (a :class:`StepState`) over. The recorder only writes:
``nanwatch.hooks.measure.decode`` turns the host copy and the site table into a ``StepStats`` value on the
reporter thread, never in a hook.
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from nanwatch.hooks.measure.collective import FlagReduction, reduction_active
from nanwatch.hooks.measure.figures import Figure
from nanwatch.hooks.measure.max_rows import MaxRows
from nanwatch.hooks.measure.observations import BufKey, ObservationLog
from nanwatch.hooks.measure.slot_buffer import SlotBuffer
from nanwatch.wire import Incident, RolloutAttribution, dtype_name

__all__ = ["GUARD_SKIPPED", "NONFINITE_RANK", "Counts", "ForwardMeta", "ParamBatch", "Recorder", "Records", "SiteKey",
           "SiteMeta", "StepState"]

#: A site's key in one step: (site, pass, stage).
SiteKey = tuple[str, str, str]
#: The slot holding 1 when the weight guard skipped the step's update (max over the step's optimizer steps).
GUARD_SKIPPED = ("guard", "skipped")

#: The slot holding ``-r``, ``r`` the lowest rank whose step held a non-finite value, from the guard's
#: reduction across ranks (``nanwatch.hooks.measure.collective``): max over the step's optimizer steps.
NONFINITE_RANK = ("guard", "nonfinite_rank")

#: Forwards fingerprinted per step; the wire allows 256, a training step rarely has more than a few.
MAX_FORWARDS = 64


@dataclass(slots=True)
class SiteMeta:
    """A site's calls in one step, host-side (their values are rows of the observation log)."""

    kind: str
    dtype: torch.dtype
    calls: int = 0
    numel: int = 0


@dataclass(slots=True)
class ForwardMeta:
    """What one model forward was fed; counts live in the buffer under ``("fwd", index, name)``."""

    index: int
    position_ids: str = "none"
    mask: str = "none"
    packed_checked: bool = False
    plain_causal: bool = False
    mask_4d_seen: bool = False

    def key(self, name: str) -> tuple:
        """The slot of this forward's count ``name`` (``Recorder.slot``; read back by the decode)."""
        return ("fwd", self.index, name)


@dataclass(slots=True)
class Counts:
    """The counters behind ``nanwatch.wire.Coverage``."""

    forwards: int = 0  # eager model forwards
    train_forwards: int = 0  # of which in the train stage
    compiled_forwards: int = 0  # model forwards that ran inside a compiled graph
    attention_calls: int = 0
    attention_probed: int = 0
    compiled_calls: int = 0
    recomputed_calls: int = 0
    logits: bool = False
    params_checked: int = 0


@dataclass(slots=True)
class ParamBatch:
    """Parameters read together by one device op, one value each (the largest magnitude; NaN or Inf when
    the parameter holds one). Training thread until handed over with the step."""

    pos: int
    """Where in the step's execution order it was recorded (the number of rows before it)."""
    phase: str
    """``optimizer``: read right after the update; ``forward``: the same values, as the next step starts."""
    owner: str
    """The optimizer's class name."""
    names: list[str]
    dtypes: list[str]
    numels: list[int]
    values: torch.Tensor
    """``[len(names)]`` float32 on the recorder's device (set by ``Recorder.param_batch``)."""


@dataclass(slots=True)
class StepState:
    """Host-side record of one step; handed to the reporter thread at step end and never touched again."""

    order: list[SiteKey] = field(default_factory=list)
    #: one per measured call, in execution order: (site, log, buffer, row)
    rows: list[tuple[SiteKey, str, BufKey, int]] = field(default_factory=list)
    #: the flattened copy's layout: (log, buffer, rows) per segment, then the max rows, then the slots
    layout: list[tuple[str, BufKey, int]] = field(default_factory=list)
    #: the max rows' part of the layout: (buffer, cells) per segment
    max_layout: list[tuple[BufKey, int]] = field(default_factory=list)
    #: each max figure's rows (``MaxRows.row``), by key: (buffer, offset); the step's value is their max
    maxes: dict[Hashable, list[tuple[BufKey, int]]] = field(default_factory=dict)
    sites: dict[SiteKey, SiteMeta] = field(default_factory=dict)
    sdpa: dict[tuple, int] = field(default_factory=dict)
    logits: dict[str, tuple[str, int]] = field(default_factory=dict)
    forwards: list[ForwardMeta] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    #: RLHF stats were recorded: True, or the name of the KL estimator the trainer optimises
    rlhf: bool | str = False
    #: what the step covered (see ``nanwatch.wire.Coverage``; ``unmeasured`` is derived from it at decode)
    coverage: Counts = field(default_factory=lambda: Counts())
    #: SDPA attention layers measured in a training forward (each should get a logit figure)
    attention_layers: set[str] = field(default_factory=set)
    #: the differential rerun's verdict on this step (``nanwatch.hooks.forensics.rerun``), when it ran
    incident: Incident | None = None
    #: the rollout attribution that ran at this step's end (``nanwatch.hooks.rollout.attribution``), if any
    rollout_attribution: RolloutAttribution | None = None
    #: ``train``: a training step; ``eval``: an evaluation window's own record
    #: (``nanwatch.hooks.instrument.eval_windows``)
    stage: str = "train"
    #: the slot buffer the step wrote into (its slot index decodes the copy); set when handed over
    slots: SlotBuffer | None = None
    #: parameters read together after an optimizer step, or carried to this step's start
    #: (``nanwatch.hooks.measure.optimizer_check``), in execution order among ``rows``
    batches: list[ParamBatch] = field(default_factory=list)
    #: how many of ``batches`` the last ``flat()`` holds (its layout, like ``layout``)
    flat_batches: int = 0
    #: where each part of the last ``flat()`` (rows, max rows, batches, slots, in that order) starts in it, and
    #: its length: the copy groups the parts by dtype (empty: in order, as a hand-written copy is)
    flat_order: list[tuple[int, int]] = field(default_factory=list)
    #: the report figures the step wrote (``nanwatch.hooks.measure.figures``), by path: the decode reads these
    figures: set[str] = field(default_factory=set)
    #: the replica check ran in this step: its layout (``nanwatch.hooks.measure.replica_verdict.ReplicaLayout``),
    #: which names the verdict in the step's slots
    replica: object = None
    #: the step's MoE record (``nanwatch.hooks.moe.taps.MoeStep``): routers that ran, routes compared; None: none
    moe: object = None


@dataclass(slots=True)
class Records:
    """Where a recorder writes: one record (a :class:`StepState`) and the buffers its values go to, with the
    last-read memo, which is only good against those buffers. A recorder writes into one at a time
    (:meth:`Recorder.write_into`); an evaluation window gives it its own (``nanwatch.hooks.instrument.eval_windows``)."""

    state: StepState
    obs: dict[str, ObservationLog]
    buf: SlotBuffer
    maxes: MaxRows
    last: tuple | None = None

    @classmethod
    def fresh(cls, device: torch.device) -> Records:
        """An empty record, with buffers of its own on ``device``."""
        return cls(StepState(), {"train": ObservationLog(), "other": ObservationLog()}, SlotBuffer(device), MaxRows())


class Recorder:
    """Writes one step's stats; ``swap()`` hands the finished step over and starts the next.

    Training thread only. It never reads its values back: the reporter thread decodes the host copy of
    ``flat()`` with the StepState ``swap()`` handed over (``nanwatch.hooks.measure.decode``)."""

    def __init__(self, device: torch.device | str, *, group=None, reduce: bool = True) -> None:
        """``group``: the training process group the guard's flag is reduced over (None: the default
        group); ``reduce=False``: each rank decides alone (``MonitorConfig.weights.guard_reduce``)."""
        self.buf = SlotBuffer(device)
        #: the dtype slots accumulate in (float64; float32 on MPS): sum into it to stay exact
        self.acc_dtype = self.buf.dtype
        self._group = group
        self._reduction = FlagReduction(group) if reduce else None
        #: training calls apart from the rest (eval, generate): the weight guard's flag is one log's rows
        self.obs = {"train": ObservationLog(), "other": ObservationLog()}
        #: per-call rows of the figures maxed over calls (logit figures, a forward's fully masked rows): a
        #: caller writes ``maxes.row(key, ...)`` with one ``out=`` op
        self.maxes = MaxRows()
        self.state = StepState()
        #: the last tensor read, its version and row: a tensor read twice in a row, unchanged, is read once
        #: (in backward the same gradient flows into a block's output and its MLP's, through the residual)
        self._last: tuple[weakref.ref, int, str, BufKey, int] | None = None

    # ---- hot path -------------------------------------------------------------------------------
    def tensor(self, site: str, kind: str, phase: str, x: torch.Tensor, stage: str = "train") -> None:
        """Measure one call of a site: one ``aminmax`` (no other device op)."""
        key = (site, phase, stage)
        state = self.state
        meta = state.sites.get(key)
        if meta is None:
            meta = state.sites[key] = SiteMeta(kind, x.dtype)
            state.order.append(key)
        meta.calls += 1
        meta.numel += x.numel()
        if x.numel():
            log = "train" if stage == "train" else "other"
            last = self._last
            if last is not None and last[0]() is x and last[1] == x._version and last[2] == log:
                bufkey, row = last[3], last[4]
            else:
                bufkey, row = self.obs[log].observe(x.detach())
                self._last = (weakref.ref(x), x._version, log, bufkey, row)
            state.rows.append((key, log, bufkey, row))

    def sdpa(self, site: str, backend: str, predicted: str, confirmed: bool, dtype: torch.dtype | str,
             shape: str, reason: str | None, *, calls: int = 1, stage: str = "train") -> None:
        key = (site, backend, predicted, confirmed, dtype_name(dtype), shape, reason, stage)
        self.state.sdpa[key] = self.state.sdpa.get(key, 0) + calls

    def logit_heads(self, layer: str, source: str, x: torch.Tensor, dim: tuple[int, ...] | None = None) -> None:
        """A per-head logit figure of one call: the max of ``x`` over ``dim`` (the remaining dimension is the
        heads), or ``x`` itself (1-D, per head) when ``dim`` is None; one device op either way."""
        n = x.numel() if dim is None else x.shape[_kept_dim(x, dim)]
        prev = self.state.logits.get((layer, source))
        self.state.logits[(layer, source)] = (source, n) if prev is None or prev[1] == n else prev
        row = self.maxes.row((source, layer, n), n, x.dtype, x.device)
        if dim is None:
            row.copy_(x.reshape(n))
        else:
            torch.amax(x, dim=dim, out=row)

    def forward_begin(self, position_ids: str, mask: str) -> ForwardMeta:
        forwards = self.state.forwards
        if len(forwards) >= MAX_FORWARDS:  # e.g. generate(): later forwards share the last record
            return forwards[-1]
        meta = ForwardMeta(len(forwards), position_ids, mask)
        forwards.append(meta)
        return meta

    def slot(self, key, value: torch.Tensor, *, how: str = "sum", many: bool = False,
             at: torch.Tensor | None = None) -> None:
        """Add (``how="sum"``) or max (``"max"``) a 0-d device value into the slot ``key``: RLHF sums and
        counts, a forward's counts (``ForwardMeta.key``), the scaler's and the weight guard's flags. With
        ``many``, ``key`` is a tuple of keys and ``value`` 1-D, one per key, in one device op: sums into slots
        anywhere (``SlotBuffer.scatter_add``; with ``at``, ``value[i]`` into ``key[at[i]]``), maxima into
        consecutive slots (``SlotBuffer.block``)."""
        if many and how == "sum":
            self.buf.scatter_add(key, _to(self.buf, value), at=None if at is None else _to(self.buf, at))
        elif many:
            self.buf.block(how, key, _to(self.buf, value))
        elif how == "sum":
            self.buf.add(key, _to(self.buf, value))
        else:
            self.buf.maximize(key, _to(self.buf, value))

    def figure(self, fig: Figure, value: torch.Tensor) -> None:
        """The report figure ``fig``'s value in this step (a 0-d device value; ``nanwatch.hooks.measure.figures``):
        added, maxed or assigned (the last write of the step wins) into its slot, by ``fig.how``; the step notes
        that it wrote it (a slot, once allocated, is in every later copy)."""
        if fig.how == "last":
            self.buf.assign(fig.key, _to(self.buf, value))
        else:
            self.slot(fig.key, value, how=fig.how)
        self.state.figures.add(fig.path)

    def mark_rlhf(self, kl_optimised: str | None) -> None:
        """This step has RLHF stats; ``kl_optimised`` names the KL estimator the loss uses, if known."""
        self.state.rlhf = kl_optimised or True

    def param_batch(self, batch: ParamBatch) -> None:
        """Parameters read together (``nanwatch.hooks.measure.optimizer_check``): placed after the rows recorded so
        far in execution order; its values brought to the buffer's device as float32 (device ops only)."""
        batch.pos = len(self.state.rows)
        batch.values = _to(self.buf, batch.values.detach().float())
        self.state.batches.append(batch)

    def fold_compiled(self, counts: dict[str, int]) -> None:
        """Step end: what ran inside compiled graphs (``nanwatch.hooks.measure.compiled``), counted, not probed."""
        sdpa_calls = 0
        for key, calls in counts.items():
            if key.startswith("sdpa:"):
                sdpa_calls += calls
                self.sdpa("<compiled>", "compiled", "compiled", False, key.removeprefix("sdpa:"), "", None,
                          calls=calls)
        # an attention module may call SDPA (both counted) or not (eager attention): count each call once
        attention = max(sdpa_calls, counts.get("attention", 0))
        self.cover(compiled_forwards=counts.get("forward", 0), attention=attention, compiled=attention)

    def set_incident(self, incident: Incident) -> None:
        """The differential rerun's verdict on the open step."""
        self.state.incident = incident

    def cover(self, *, forwards: int = 0, train: bool = False, compiled_forwards: int = 0, attention: int = 0,
              probed: int = 0, recomputed: int = 0, compiled: int = 0, logits: bool = False,
              layer: str | None = None, params_checked: int = 0) -> None:
        """Count what this step covered (host-side integers only); ``train``: the forwards were training
        forwards."""
        c = self.state.coverage
        c.forwards += forwards
        c.train_forwards += forwards if train else 0
        c.compiled_forwards += compiled_forwards
        c.attention_calls += attention
        c.attention_probed += probed
        c.recomputed_calls += recomputed
        c.compiled_calls += compiled
        c.logits = c.logits or logits
        c.params_checked += params_checked
        if layer is not None:
            self.state.attention_layers.add(layer)

    def current_forward(self) -> ForwardMeta | None:
        return self.state.forwards[-1] if self.state.forwards else None

    def warn(self, message: str) -> bool:
        """Put ``message`` into this step's report, once per step; True if it was not there yet."""
        if message in self.state.warnings:
            return False
        self.state.warnings.append(message)
        return True

    def nonfinite_flag(self, *, job: bool = False, spiked: bool = False) -> torch.Tensor:
        """1.0 when a training site held NaN or Inf so far in this step, else 0.0: a 0-d float32 tensor on
        the buffer's device, from device ops only (reading it on the host is a sync).

        ``job=True``: reduced (MAX) over the training process group under torch.distributed: a collective,
        so every rank calls it under the same condition, never a local value. The lowest faulting rank goes
        into the buffer for the report (``StepStats.nonfinite_rank``): device ops only.

        ``spiked``: this rank's step spiked and ``spike_action="skip"`` asks to skip it: the flag is set (the
        reduction then skips the step on every rank), but this rank is not named as a non-finite one."""
        # The training rows, and the parameters an optimizer step wrote or this step started from, grouped by
        # (device, dtype): one ``cat`` per group of several (a single kernel where the dtypes agree), then
        # ``(x * 0).any()``: a finite value times 0 is 0, NaN and Inf times 0 are NaN, which ``any`` counts as
        # true, and nothing overflows. ``~isfinite(x).any()`` said the same in six kernels per tensor
        # (``isfinite`` alone is four: ``x == x``, ``abs``, ``!= inf``, ``*``, on every backend).
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for x in [*self.obs["train"].used(), *(b.values for b in self.state.batches)]:
            groups.setdefault((x.device, x.dtype), []).append(x)
        parts = [(g[0] if len(g) == 1 else torch.cat(g)).mul(0).any() for g in groups.values()]
        if not parts:
            flag = torch.zeros((), dtype=torch.float32, device=self.buf.device)
        else:
            flag = parts[0] if len(parts) == 1 else torch.stack([p.to(parts[0].device) for p in parts]).any()
            flag = _to(self.buf, flag).to(torch.float32)
        if spiked:
            flag = torch.ones_like(flag)
        if not job or self._reduction is None or not reduction_active(self._group):
            return flag
        flag, lowest = self._reduction.reduce(flag)
        if not spiked:
            self.buf.maximize(NONFINITE_RANK, _to(self.buf, lowest))
        return _to(self.buf, flag)

    @property
    def trained(self) -> bool:
        """The open step ran a training forward (eager or compiled)."""
        c = self.state.coverage
        return bool(c.train_forwards or c.compiled_forwards)

    def write_into(self, records: Records) -> Records:
        """Write into ``records`` from now on; returns what was written into so far, untouched (its last-read
        memo included, so that writing into it again resumes exactly where it was)."""
        out = Records(self.state, self.obs, self.buf, self.maxes, self._last)
        self.state, self.obs, self.buf, self.maxes, self._last = (records.state, records.obs, records.buf,
                                                                 records.maxes, records.last)
        return out

    # ---- step boundary ---------------------------------------------------------------------------
    def flat(self) -> torch.Tensor:
        """Everything the step measured, as one float64 device tensor (device ops only): the used rows of
        every observation buffer, then the max rows, then the parameter batches, then the slots, in that
        order for the decode (``StepState.layout``, ``max_layout``, ``flat_batches``, ``flat_order``).

        The parts of one dtype are concatenated before they are converted, one conversion per (device, dtype)
        rather than per part, so the device tensor holds them grouped by dtype; ``StepState.flat_order`` says
        where each part landed, and the decode reads them back in order (``decode_step``)."""
        parts, layout = [], []
        for name, log in self.obs.items():
            segs, lay = log.segments()
            parts += segs
            layout += [(name, k, n) for k, n in lay]
        self.state.layout = layout
        segs, self.state.max_layout = self.maxes.segments()
        self.state.maxes = self.maxes.figures
        parts += segs
        self.state.flat_batches = len(self.state.batches)
        parts += [b.values.reshape(-1) for b in self.state.batches]
        parts.append(self.buf.data[: self.buf.size])
        flat, self.state.flat_order = _gathered(parts, self.buf.device)
        return flat

    def swap(self) -> StepState:
        """Hand the finished step over and start the next (the buffers are reused from the start)."""
        state, self.state = self.state, StepState(stage=self.state.stage)
        state.slots = self.buf
        self._last = None  # rows are reused from the start: never alias across steps
        for log in self.obs.values():
            log.reset()
        self.maxes.reset()
        self.buf.reset()
        return state


def _gathered(parts: list[torch.Tensor], device: torch.device) -> tuple[torch.Tensor, list[tuple[int, int]]]:
    """``parts`` (1-D, any dtype and device) in one new float64 tensor on ``device``, and where each landed.
    Parts of one (device, dtype) are concatenated, then converted: one conversion per dtype, not per part
    (float64 parts already on ``device`` go straight into the final ``cat``)."""
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, p in enumerate(parts):
        groups.setdefault((p.device, p.dtype), []).append(i)
    chunks, order, at = [], [(0, 0)] * len(parts), 0
    for (dev, dtype), idx in groups.items():
        if dev == device and dtype == torch.float64:
            chunks += [parts[i] for i in idx]
        else:
            chunk = parts[idx[0]] if len(idx) == 1 else torch.cat([parts[i] for i in idx])
            chunks.append(chunk.to(device=device, dtype=torch.float64, non_blocking=device.type == "cuda"))
        for i in idx:
            order[i] = (at, parts[i].numel())
            at += parts[i].numel()
    return torch.cat(chunks), order


def _kept_dim(x: torch.Tensor, dim: tuple[int, ...]) -> int:
    """The one dimension of ``x`` a reduction over ``dim`` keeps (the heads)."""
    reduced = {d % x.dim() for d in dim}
    (kept,) = (d for d in range(x.dim()) if d not in reduced)
    return kept


def _to(buf: SlotBuffer, x: torch.Tensor) -> torch.Tensor:
    """Bring a small result to ``buf``'s device. Asynchronous towards a GPU; towards a CPU buffer (a CUDA
    tensor in a model whose parameters are on the CPU) it must be blocking, or CPU ops would read it before
    the copy lands."""
    if x.device == buf.device:
        return x
    return x.to(buf.device, non_blocking=buf.device.type == "cuda")
