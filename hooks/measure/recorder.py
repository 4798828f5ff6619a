"""One step's measurements: host-side bookkeeping (names, order, shapes) plus device-side values.

The hot path only launches device ops and appends to host lists: a measured tensor costs one ``aminmax``
into the observation log (``nanwatch.hooks.measure.observations``); logit figures, fingerprint counts and RLHF sums
go to named slots of the SlotBuffer. At step end both are flattened into one device tensor for one
asynchronous copy; ``decode`` turns the host copy back into wire objects on the reporter thread, never in
a hook.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from nanwatch.hooks.measure.collective import FlagReduction, reduction_active
from nanwatch.hooks.measure.dtypes import finfo_max
from nanwatch.hooks.measure.observations import BufKey, ObservationLog
from nanwatch.hooks.measure.optimizer_check import MAX_NAMED, BatchSeen, ParamBatch, read_batch
from nanwatch.hooks.measure.slot_buffer import SlotBuffer
from nanwatch.wire import Fingerprint, Incident, LogitStat, SdpaCall, SiteStat, dtype_name

__all__ = ["GUARD_SKIPPED", "NONFINITE_RANK", "Counts", "ForwardMeta", "Recorder", "SiteKey", "StepSoFar", "StepState"]

#: A site's key in one step: (site, pass, stage).
SiteKey = tuple[str, str, str]
#: Site kinds reported only when non-finite (checked every step, named only when they matter).
QUIET_KINDS = frozenset({"param"})

#: The slot holding 1 when the weight guard skipped the step's update (max over the step's optimizer steps).
GUARD_SKIPPED = ("guard", "skipped")

#: The slot holding ``-r``, ``r`` the lowest rank whose step held a non-finite value, from the guard's
#: reduction across ranks (``nanwatch.hooks.measure.collective``): max over the step's optimizer steps.
NONFINITE_RANK = ("guard", "nonfinite_rank")

#: Forwards fingerprinted per step; the wire allows 256, a training step rarely has more than a few.
MAX_FORWARDS = 64


@dataclass(slots=True)
class _SiteMeta:
    kind: str
    dtype: torch.dtype
    calls: int = 0
    numel: int = 0


@dataclass(slots=True)
class _Observed:
    """A site's calls, read off their (min, max) rows at decode."""

    nan: int = 0
    inf: int = 0
    amax: float = -1.0  # largest |x| over finite calls (-1: none)
    top: float = -math.inf  # largest x over finite calls (a router's logit max)


@dataclass(slots=True)
class ForwardMeta:
    """What one model forward was fed; counts live in the buffer under ``("fwd", index, name)``."""

    index: int
    position_ids: str = "none"
    mask: str = "none"
    packed_checked: bool = False
    plain_causal: bool = False
    mask_4d_seen: bool = False


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
class StepState:
    """Host-side record of one step; handed to the reporter thread at step end and never touched again."""

    order: list[SiteKey] = field(default_factory=list)
    #: one per measured call, in execution order: (site, log, buffer, row)
    rows: list[tuple[SiteKey, str, BufKey, int]] = field(default_factory=list)
    #: the flattened copy's layout: (log, buffer, rows) per segment, then the slots
    layout: list[tuple[str, BufKey, int]] = field(default_factory=list)
    sites: dict[SiteKey, _SiteMeta] = field(default_factory=dict)
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
    #: the differential replay's verdict on this step (``nanwatch.hooks.remedies.rerun``), when it ran
    incident: Incident | None = None
    #: ``train``: a training step; ``eval``: an evaluation window's own record (``Recorder.enter_eval``)
    stage: str = "train"
    #: the slot buffer the step wrote into (its slot index decodes the copy); set when handed over
    slots: SlotBuffer | None = None
    #: parameters read together after an optimizer step, or carried to this step's start
    #: (``nanwatch.hooks.measure.optimizer_check``), in execution order among ``rows``
    batches: list[ParamBatch] = field(default_factory=list)
    #: how many of ``batches`` the last ``flat()`` holds (its layout, like ``layout``)
    flat_batches: int = 0
    #: a watched GradScaler was enabled at the step's end (``nanwatch.hooks.remedies.loss_scaling``): the report
    #: carries ``loss_scale`` and ``scaler_overflow`` (None without one)
    loss_scaling: bool = False


class StepSoFar(NamedTuple):
    """The open step as the differential replay needs it (``Recorder.so_far``)."""

    first: SiteKey | None
    masked_rows: int
    compiled: bool
    kinds: dict[str, str]
    """Each site measured so far, by name: its kind (the birth's kind, when the birth is a site)."""


class Recorder:
    """Writes one step's stats; ``swap()`` hands the finished step over and starts the next.

    Training thread, except ``decode``/``getter``/``step_skipped``, which the reporter thread calls on a
    step already handed over (a StepState from ``swap``): no caller reaches into its buffers."""

    def __init__(self, device: torch.device | str, *, group=None, reduce: bool = True) -> None:
        """``group``: the training process group the guard's flag is reduced over (None: the default
        group); ``reduce=False``: each rank decides alone (``MonitorConfig.guard_reduce``)."""
        self.buf = SlotBuffer(device)
        self._group = group
        self._reduction = FlagReduction(group) if reduce else None
        #: training calls apart from the rest (eval, generate): the weight guard's flag is one log's rows
        self.obs = {"train": ObservationLog(), "other": ObservationLog()}
        self.state = StepState()
        #: the last tensor read, its version and row: a tensor read twice in a row, unchanged, is read once
        #: (in backward the same gradient flows into a block's output and its MLP's, through the residual)
        self._last: tuple[weakref.ref, int, str, BufKey, int] | None = None
        #: an evaluation's own record and buffers, kept for reuse between windows (``enter_eval``)
        self._eval_set: tuple[StepState, dict[str, ObservationLog], SlotBuffer] | None = None
        #: while an eval window is open: the training record it put aside (state, logs, buffer, last read)
        self._aside: tuple | None = None

    # ---- hot path -------------------------------------------------------------------------------
    def tensor(self, site: str, kind: str, phase: str, x: torch.Tensor, stage: str = "train") -> None:
        """Measure one call of a site: one ``aminmax`` (no other device op)."""
        key = (site, phase, stage)
        state = self.state
        meta = state.sites.get(key)
        if meta is None:
            meta = state.sites[key] = _SiteMeta(kind, x.dtype)
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

    def logit_heads(self, layer: str, source: str, per_head: torch.Tensor) -> None:
        """Max a per-head logit figure (bound or exact) into the layer's slots."""
        n = per_head.numel()
        prev = self.state.logits.get((layer, source))
        self.state.logits[(layer, source)] = (source, n) if prev is None or prev[1] == n else prev
        self.buf.maximize_many((source, layer, n), self._local(per_head))

    def forward_begin(self, position_ids: str, mask: str) -> ForwardMeta:
        forwards = self.state.forwards
        if len(forwards) >= MAX_FORWARDS:  # e.g. generate(): later forwards share the last record
            return forwards[-1]
        meta = ForwardMeta(len(forwards), position_ids, mask)
        forwards.append(meta)
        return meta

    def forward_count(self, meta: ForwardMeta, name: str, value: torch.Tensor, *, how: str = "sum") -> None:
        key = ("fwd", meta.index, name)
        if how == "sum":
            self.buf.add(key, self._local(value))
        else:
            self.buf.maximize(key, self._local(value))

    @property
    def acc_dtype(self) -> torch.dtype:
        """The dtype slots accumulate in (float64; float32 on MPS): sum into it to stay exact."""
        return self.buf.dtype

    def slot_add(self, key, value: torch.Tensor) -> None:
        """Add a 0-d device value into the sum slot ``key`` (RLHF sums and counts)."""
        self.buf.add(key, value)

    def slot_max(self, key, value: torch.Tensor) -> None:
        """Max a 0-d device value into the max slot ``key``."""
        self.buf.maximize(key, self._local(value))

    def slot_assign(self, key, value: torch.Tensor) -> None:
        """Set the slot ``key`` to a 0-d device value (the last write of the step wins)."""
        self.buf.assign(key, self._local(value))

    def loss_scale(self, key, scale: torch.Tensor) -> None:
        """This step ran under dynamic loss scaling, whose scale is ``scale`` (a device value, read at the
        step's end into slot ``key``)."""
        self.slot_assign(key, scale)
        self.state.loss_scaling = True

    def mark_rlhf(self, kl_optimised: str | None) -> None:
        """This step has RLHF stats; ``kl_optimised`` names the KL estimator the loss uses, if known."""
        self.state.rlhf = kl_optimised or True

    def note_guard_skipped(self, flag: torch.Tensor) -> None:
        """The weight guard's decision for one optimizer step (a device flag, 1.0: skipped)."""
        self.buf.maximize(GUARD_SKIPPED, flag)

    def param_batch(self, batch: ParamBatch) -> None:
        """Parameters read together (``nanwatch.hooks.measure.optimizer_check``): placed after the rows recorded so
        far in execution order; its values brought to the buffer's device as float32 (device ops only)."""
        batch.pos = len(self.state.rows)
        batch.values = self._local(batch.values.detach().float())
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
        """The differential replay's verdict on the open step."""
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

    def nonfinite_flag(self) -> torch.Tensor:
        """1.0 when a training site held NaN or Inf so far in this step, else 0.0: a 0-d float32 tensor on
        the buffer's device, from device ops only (reading it on the host is a sync)."""
        flag = self.obs["train"].any_nonfinite()
        batches = self.state.batches
        if batches:  # parameters an optimizer step wrote, or this step started from
            values = batches[0].values if len(batches) == 1 else torch.cat([b.values for b in batches])
            bad = ~torch.isfinite(values).all()
            flag = bad if flag is None else flag.to(bad.device) | bad
        if flag is None:
            return torch.zeros((), dtype=torch.float32, device=self.buf.device)
        return self._local(flag).to(torch.float32)

    def job_nonfinite_flag(self) -> torch.Tensor:
        """:meth:`nonfinite_flag`, reduced (MAX) over the training process group under torch.distributed:
        a collective, so every rank calls it under the same condition, never a local value. The lowest
        faulting rank goes into the buffer for the report (``nonfinite_rank``): device ops only."""
        flag = self.nonfinite_flag()
        if self._reduction is None or not reduction_active(self._group):
            return flag
        flag, lowest = self._reduction.reduce(flag)
        self.buf.maximize(NONFINITE_RANK, self._local(lowest))
        return self._local(flag)

    def _local(self, x: torch.Tensor) -> torch.Tensor:
        """Bring a small result to the buffer's device. Asynchronous towards a GPU; towards a CPU buffer
        (a CUDA tensor in a model whose parameters are on the CPU) it must be blocking, or CPU ops
        would read it before the copy lands."""
        if x.device == self.buf.device:
            return x
        return x.to(self.buf.device, non_blocking=self.buf.device.type == "cuda")

    @property
    def trained(self) -> bool:
        """The open step ran a training forward (eager or compiled)."""
        c = self.state.coverage
        return bool(c.train_forwards or c.compiled_forwards)

    # ---- evaluation windows ------------------------------------------------------------------------
    @property
    def evaluating(self) -> bool:
        """An eval window is open: measurements go to the evaluation's own record."""
        return self._aside is not None

    def enter_eval(self) -> None:
        """Record into an evaluation's own record and buffers from now on, the training step's (open or not)
        put aside untouched: an evaluation run inside or between training steps is reported on its own, its
        values never reach the training step's first offender or the weight guard's flag."""
        if self._aside is not None:
            return
        if self._eval_set is None:
            self._eval_set = (StepState(), {"train": ObservationLog(), "other": ObservationLog()},
                              SlotBuffer(self.buf.device))
        self._aside = (self.state, self.obs, self.buf, self._last)
        self.state, self.obs, self.buf = self._eval_set
        self.state.stage = "eval"
        self._last = None

    def leave_eval(self) -> None:
        """Back to the training record put aside by :meth:`enter_eval` (call :meth:`swap` first to hand the
        evaluation's record over)."""
        if self._aside is None:
            return
        self._eval_set = (self.state, self.obs, self.buf)
        self.state, self.obs, self.buf, self._last = self._aside
        self._aside = None

    # ---- step boundary ---------------------------------------------------------------------------
    def flat(self) -> torch.Tensor:
        """Everything the step measured, as one float64 device tensor (device ops only): the used rows of
        every observation buffer, then the slots. Its layout goes into the step state for ``decode``."""
        parts, layout = [], []
        for name, log in self.obs.items():
            segs, lay = log.segments(self.buf.device)
            parts += segs
            layout += [(name, k, n) for k, n in lay]
        self.state.layout = layout
        self.state.flat_batches = len(self.state.batches)
        parts += [b.values.to(torch.float64) for b in self.state.batches]
        return torch.cat([*parts, self.buf.data[: self.buf.size].to(torch.float64)])

    def so_far(self) -> StepSoFar:
        """The open step decoded on the host now: one sync (the replay's, once per run)."""
        values = self.flat().tolist()  # sync-ok: once per run, to find the first offender
        _, _, _, prints, first = self.decode(self.state, values)
        c = self.state.coverage
        return StepSoFar(first, sum(f.fully_masked_rows for f in prints),
                         bool(c.compiled_forwards or c.compiled_calls),
                         {key[0]: meta.kind for key, meta in self.state.sites.items()})

    def nonfinite_phases(self) -> set[str]:
        """The phases of the open step's non-finite training sites, decoded on the host now: one sync (replay
        mode only, to tell a loss-scale overflow from an incident)."""
        values = self.flat().tolist()  # sync-ok: replay mode, a step whose non-finite flag is already set
        sites = self.decode(self.state, values)[0]
        return {s.phase for s in sites if s.stage == "train" and (s.nan or s.inf)}

    def swap(self) -> StepState:
        """Hand the finished step over and start the next (the buffers are reused from the start)."""
        state, self.state = self.state, StepState(stage=self.state.stage)
        state.slots = self.buf
        self._last = None  # rows are reused from the start: never alias across steps
        for log in self.obs.values():
            log.reset()
        self.buf.reset()
        return state

    # ---- decoding (reporter thread) --------------------------------------------------------------
    def getter(self, state: StepState, values: list[float]):
        """``get(kind, key, default)``: a slot's value in a host copy of ``flat()``, or ``default`` if the
        slot is not in that copy (never written, or allocated after the copy was taken)."""
        buf = state.slots if state.slots is not None else self.buf
        # the slots follow the observation rows and the parameter batches
        base = sum(2 * n for _, _, n in state.layout) + sum(len(b.names) for b in state.batches[: state.flat_batches])

        def get(kind: str, key, default: float = 0.0) -> float:
            i = buf.index(kind, key)
            return default if i is None or base + i >= len(values) else values[base + i]

        return get

    def step_skipped(self, state: StepState, values: list[float]) -> bool | None:
        """Whether a weight guard skipped the step's update; None when no guard decided in it."""
        skipped = self.getter(state, values)("max", GUARD_SKIPPED, -math.inf)
        return None if skipped == -math.inf else skipped > 0

    def nonfinite_rank(self, state: StepState, values: list[float]) -> int | None:
        """The lowest rank whose step held a non-finite value, from the guard's reduction; None when no
        rank's did, or nothing was reduced."""
        lowest = self.getter(state, values)("max", NONFINITE_RANK, -math.inf)
        return int(-lowest) if math.isfinite(lowest) else None

    def batches_seen(self, state: StepState, values: list[float]) -> list[BatchSeen]:
        """The parameter batches in a host copy of ``flat()``, decoded (reporter thread, or ``so_far``)."""
        off = sum(2 * n for _, _, n in state.layout)
        out = []
        for b in state.batches[: state.flat_batches]:
            out.append(read_batch(b, values[off : off + len(b.names)]))
            off += len(b.names)
        return out

    def decode(self, state: StepState, values: list[float]):
        """Turn a host copy of ``flat()`` into (sites, sdpa, logits, fingerprints, first offender). A training
        step's first offender is never an eval-stage site (a forward run in eval mode inside the step): the
        step's remedies and its replay are about training."""
        offsets, off = {}, 0
        for log, bufkey, n in state.layout:
            offsets[(log, bufkey)] = off
            off += 2 * n
        get = self.getter(state, values)
        per_site: dict[SiteKey, _Observed] = {}
        first = None
        seen_batches = self.batches_seen(state, values)
        # a batch's first non-finite parameter, at the batch's place in execution order
        batch_first = sorted((s.batch.pos, (s.batch.names[s.bad[0][0]], s.batch.phase, "train"))
                             for s in seen_batches if s.bad)
        for i, (key, log, bufkey, row) in enumerate(state.rows):
            if first is None and batch_first and batch_first[0][0] <= i:
                first = batch_first[0][1]
            base = offsets.get((log, bufkey))
            if base is None:  # a row taken after the copy was made (cannot happen within a step)
                continue
            lo, hi = values[base + 2 * row], values[base + 2 * row + 1]
            seen = per_site.setdefault(key, _Observed())
            if lo != lo or hi != hi:
                seen.nan += 1
            elif math.isinf(lo) or math.isinf(hi):
                seen.inf += 1
            else:
                seen.amax = max(seen.amax, -lo, hi)
                seen.top = max(seen.top, hi)
                continue
            if first is None and (key[2] != "eval" or state.stage == "eval"):
                first = key
        if first is None and batch_first:
            first = batch_first[0][1]
        sites = []
        for key in state.order:
            meta, seen = state.sites[key], per_site.get(key, _Observed())
            if meta.kind in QUIET_KINDS and not (seen.nan or seen.inf):
                continue
            amax = seen.amax if seen.amax >= 0 or not meta.numel else math.nan  # nothing finite: not "safe"
            # An Inf is an overflow that already happened: no headroom left, whatever the finite values say.
            headroom = math.inf if seen.inf else amax / finfo_max(meta.dtype)
            sites.append(SiteStat(
                site=key[0], kind=meta.kind, phase=key[1], stage=key[2], dtype=dtype_name(meta.dtype),
                calls=meta.calls, numel=meta.numel, nan=seen.nan, inf=seen.inf, amax=amax, headroom=headroom))
        sites += self._batch_sites(state, seen_batches)
        routers = {key[0]: seen.top for key, seen in per_site.items()  # an MoE router's largest logit
                   if key[1] == "forward" and state.sites[key].kind == "router" and seen.top > -math.inf}
        sdpa = [SdpaCall(site=k[0], backend=k[1], predicted=k[2], confirmed=k[3], dtype=k[4], shape=k[5],
                         reason=k[6], stage=k[7], calls=n) for k, n in state.sdpa.items()]
        logits = self._decode_logits(state, get, routers)
        prints = []
        for f in state.forwards:
            resets = get("sum", ("fwd", f.index, "resets"))
            packed = f.packed_checked and resets > 0
            mask = "packed_block" if packed and f.mask_4d_seen and f.mask in ("none", "4d") else f.mask
            rows = get("max", ("fwd", f.index, "masked_rows"), 0.0)  # -inf: no mask seen this forward
            prints.append(Fingerprint(
                forward=f.index, position_ids=f.position_ids, mask=mask,
                fully_masked_rows=int(rows) if math.isfinite(rows) and rows > 0 else 0,
                packed=packed, plain_causal=f.plain_causal, cross_doc_leak=packed and f.plain_causal))
        return sites, sdpa, logits, prints, first

    @staticmethod
    def _batch_sites(state: StepState, seen_batches: list[BatchSeen]) -> list[SiteStat]:
        """The non-finite parameters of the step's batches as sites: the first ``MAX_NAMED`` of each, and
        none that the step's own rows already name (the rotating check reads parameters too)."""
        sites, named = [], set(state.sites)
        for s in seen_batches:
            b = s.batch
            for i, nan in s.bad[:MAX_NAMED]:
                key = (b.names[i], b.phase, "train")
                if key in named:
                    continue
                named.add(key)
                sites.append(SiteStat(site=b.names[i], kind="param", phase=b.phase, stage="train", dtype=b.dtypes[i],
                                      calls=1, numel=b.numels[i], nan=int(nan), inf=int(not nan), amax=math.nan,
                                      headroom=math.nan if nan else math.inf))
        return sites

    @staticmethod
    def _decode_logits(state: StepState, get, routers: dict[str, float]) -> list[LogitStat]:
        out = [LogitStat(layer=layer, bound=top, source="router") for layer, top in routers.items()]
        by_layer: dict[str, dict[str, list[float]]] = {}
        for (layer, source), (_, n) in state.logits.items():
            by_layer.setdefault(layer, {})[source] = [get("max", ((source, layer, n), j), -math.inf)
                                                      for j in range(n)]
        for layer, srcs in by_layer.items():
            exact = srcs.get("exact") or srcs.get("scores")
            heads = srcs.get("lse") or exact
            source = "lse" if "lse" in srcs else ("scores" if "scores" in srcs else "exact")
            out.append(LogitStat(layer=layer, bound=max(heads), source=source,
                                 exact=max(exact) if exact else None, per_head=heads))
        return out
