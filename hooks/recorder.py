"""One step's measurements: host-side bookkeeping (names, order, shapes) plus device-side values.

The hot path (``tensor``, ``sdpa``, ``logit_*``, ``forward_*``) only launches device ops into the
SlotBuffer and appends to host dicts. ``decode`` turns a host copy of the buffer back into wire objects;
it runs on the reporter thread, never in a hook.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from nanwatch.hooks.dtypes import finfo_max
from nanwatch.hooks.finite import finite_stats
from nanwatch.hooks.slot_buffer import SlotBuffer
from nanwatch.wire import Fingerprint, Incident, LogitStat, SdpaCall, SiteStat, dtype_name

__all__ = ["Counts", "ForwardMeta", "Recorder", "SiteKey", "StepState"]

#: A site's key in one step: (site, pass, stage).
SiteKey = tuple[str, str, str]
#: The slot summing every non-finite value of the step's training sites (the weight guard's flag).
TRAIN_NONFINITE = ("train", "nonfinite")

#: Forwards fingerprinted per step; the wire allows 256, a training step rarely has more than a few.
MAX_FORWARDS = 64


@dataclass(slots=True)
class _SiteMeta:
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


@dataclass(slots=True)
class StepState:
    """Host-side record of one step; handed to the reporter thread at step end and never touched again."""

    order: list[SiteKey] = field(default_factory=list)
    calls: int = 0
    sites: dict[SiteKey, _SiteMeta] = field(default_factory=dict)
    sdpa: dict[tuple, int] = field(default_factory=dict)
    logits: dict[str, tuple[str, int]] = field(default_factory=dict)
    forwards: list[ForwardMeta] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    #: RLHF stats were recorded: True, or the name of the KL estimator the trainer optimises
    rlhf: bool | str = False
    #: what the step covered (see ``nanwatch.wire.Coverage``; ``unmeasured`` is derived from it at decode)
    coverage: Counts = field(default_factory=lambda: Counts())
    #: attention layers measured in a training forward (each should get a logit figure)
    attention_layers: set[str] = field(default_factory=set)
    #: the differential replay's verdict on this step (``nanwatch.hooks.replay``), when it ran
    incident: Incident | None = None


class Recorder:
    """Writes one step's stats; ``swap()`` hands the finished step over and starts the next."""

    def __init__(self, device: torch.device | str) -> None:
        self.buf = SlotBuffer(device)
        self.state = StepState()

    # ---- hot path -------------------------------------------------------------------------------
    def tensor(self, site: str, kind: str, phase: str, x: torch.Tensor, stage: str = "train") -> None:
        key = (site, phase, stage)
        meta = self.state.sites.get(key)
        if meta is None:
            meta = self.state.sites[key] = _SiteMeta(kind, x.dtype)
            self.state.order.append(key)
        meta.calls += 1
        meta.numel += x.numel()
        nan, inf, amax = finite_stats(x)  # reduce where x lives; only the scalars travel
        nan, inf = self._local(nan), self._local(inf)
        self.buf.add(("nan", key), nan)
        self.buf.add(("inf", key), inf)
        if stage == "train":  # what the weight guard reads: any non-finite value in this training step
            self.buf.add(TRAIN_NONFINITE, nan + inf)
        self.buf.maximize(("amax", key), self._local(amax))
        # Execution order of the first bad call, on the device: -ordinal where this call held a
        # non-finite value, else -inf; the max over calls is the earliest bad one (grad accumulation
        # revisits sites, so first registration is not first in time).
        self.state.calls += 1
        first = torch.where((nan + inf) > 0, -float(self.state.calls), -math.inf)
        self.buf.maximize(("first", key), self._local(first))

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

    def cover(self, *, forwards: int = 0, train: bool = False, compiled_forwards: int = 0, attention: int = 0,
              probed: int = 0, recomputed: int = 0, compiled: int = 0, logits: bool = False,
              layer: str | None = None) -> None:
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

    def nonfinite_count(self) -> torch.Tensor:
        """Non-finite values seen so far in this step's training sites: a 1-element view of the device
        buffer, so reading it on the device costs nothing; reading it on the host is a sync."""
        i = self.buf.slot("sum", TRAIN_NONFINITE)
        return self.buf.data[i : i + 1]

    def _local(self, x: torch.Tensor) -> torch.Tensor:
        """Bring a small result to the buffer's device. Asynchronous towards a GPU; towards a CPU buffer
        (a CUDA tensor in a model whose parameters are on the CPU) it must be blocking, or CPU ops
        would read it before the copy lands."""
        if x.device == self.buf.device:
            return x
        return x.to(self.buf.device, non_blocking=self.buf.device.type == "cuda")

    # ---- step boundary ---------------------------------------------------------------------------
    def swap(self) -> StepState:
        state, self.state = self.state, StepState()
        return state

    # ---- decoding (reporter thread) --------------------------------------------------------------
    def getter(self, values: list[float]):
        """``get(kind, key, default)``: a slot's value in a host copy, or ``default`` if the slot is not
        in that copy (never written, or allocated after the copy was taken)."""
        buf = self.buf

        def get(kind: str, key, default: float = 0.0) -> float:
            i = buf.index(kind, key)
            return default if i is None or i >= len(values) else values[i]

        return get

    def decode(self, state: StepState, values: list[float]):
        """Turn a host copy of the buffer into (sites, sdpa, logits, fingerprints, first offender)."""
        get = self.getter(values)
        sites, first, earliest = [], None, -math.inf
        for key in state.order:
            meta = state.sites[key]
            nan, inf = int(get("sum", ("nan", key))), int(get("sum", ("inf", key)))
            amax = get("max", ("amax", key), math.nan)
            if meta.numel and nan + inf >= meta.numel:
                amax = math.nan  # no finite value: 0.0 would read as "safe"
            # An Inf is an overflow that already happened: no headroom left, whatever the finite values say.
            headroom = math.inf if inf else amax / finfo_max(meta.dtype)
            mark = get("max", ("first", key), -math.inf)
            if nan + inf and mark > earliest:
                first, earliest = key, mark
            sites.append(SiteStat(
                site=key[0], kind=meta.kind, phase=key[1], stage=key[2], dtype=dtype_name(meta.dtype),
                calls=meta.calls, numel=meta.numel, nan=nan, inf=inf, amax=amax, headroom=headroom))
        sdpa = [SdpaCall(site=k[0], backend=k[1], predicted=k[2], confirmed=k[3], dtype=k[4], shape=k[5],
                         reason=k[6], stage=k[7], calls=n) for k, n in state.sdpa.items()]
        logits = self._decode_logits(state, get)
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
    def _decode_logits(state: StepState, get) -> list[LogitStat]:
        by_layer: dict[str, dict[str, list[float]]] = {}
        for (layer, source), (_, n) in state.logits.items():
            by_layer.setdefault(layer, {})[source] = [get("max", ((source, layer, n), j), -math.inf)
                                                      for j in range(n)]
        out = []
        for layer, srcs in by_layer.items():
            exact = srcs.get("exact") or srcs.get("scores")
            heads = srcs.get("lse") or exact
            source = "lse" if "lse" in srcs else ("scores" if "scores" in srcs else "exact")
            out.append(LogitStat(layer=layer, bound=max(heads), source=source,
                                 exact=max(exact) if exact else None, per_head=heads))
        return out
