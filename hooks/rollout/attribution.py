"""Rollout attribution: which module's precision explains the mismatch between the rollout and the trainer.

When the rollout engine (vLLM, SGLang, an HF ``generate`` copy) scores tokens in a lower precision than the
trainer, every module's rounding adds to Δlogp = trainer − rollout. :func:`attribute_mismatch` re-runs the
worst sequences outside the step and lowers one module at a time:

1. the sequences: the completion is the last ``C = rollout_logprobs.shape[1]`` tokens of ``input_ids``
   (TRL's convention); the trainer's logprob of token ``t`` is ``log_softmax(logits[:, t-1] / T)`` at
   ``input_ids[:, t]``. The ``max_sequences`` sequences with the largest mean |Δlogp| over the completion
   mask are kept; ``observed_abs_mean`` is their mean |Δlogp| trainer vs rollout;
2. the trainer's forward **entirely in fp32**, then with **one unit lowered** to ``rollout_dtype`` (its
   parameters and its floating inputs cast to it, its output cast back to fp32), then with **every unit
   lowered** (``lowered_abs_mean``: mean |Δlogp| fp32 vs every unit lowered);
3. units, found from the module tree (no model's names are assumed): the children that hold parameters of
   each module on the path from the root to the largest ``ModuleList`` (the repeated blocks), and that
   list's children: for an HF causal LM the embedding, each decoder block, the final norm and ``lm_head``.
   Then the children that hold parameters of the unit that explains most (a block: its attention, MLP and
   norms), so the name is as specific as the evidence supports (``model.layers.1.mlp``, ``lm_head``);
4. each unit's ``abs_mean`` is mean |Δlogp| fp32 vs that unit lowered alone, its ``share`` that over
   ``lowered_abs_mean``. ``module`` names, most specific first:

   - the unit whose lowering alone reproduces the rollout's own Δlogp **token by token**: ``explained`` =
     1 − mean|(rollout − trainer) − (lowered − fp32)| / mean|rollout − trainer| at least :data:`NAME_SHARE`.
     This is what the rollout actually computes in low precision, when it computes the same ops (an HF
     copy with only ``lm_head`` in bf16: 1.00 for ``lm_head``, below 0 for every other unit);
   - else the unit with the largest ``share``, when it is at least :data:`NAME_SHARE` (0.5: lowering it
     alone reproduces at least half of what lowering everything does, so no other unit can be as large a
     cause; independent units' rounding errors add roughly in quadrature, so with *k* equal causes each
     share is about 1/√k, under 0.5 from k = 5: nothing is then named and the note lists the top three).
     A rollout engine with kernels of its own (vLLM's) does not round token by token as the trainer's
     modules do (an HF copy entirely in bf16 decoding with a KV cache: ``explained`` 0.15 with every unit
     lowered), so this is the usual case: it names the module whose precision costs the most.

   ``lowered_abs_mean`` near ``observed_abs_mean`` says the precision explains what was observed; far below
   it, something else does (a kernel, the sampler, a weight sync). Below :data:`NAME_SHARE` of it the
   attribution is **withheld** (``module`` None, the note leading with the share explained): stale weights
   once got ``model.layers.0.self_attn`` named while lowering every module explained 2 % of the mismatch. Not found: one child lowered inside a
   block whose other children's lowering costs more (the block leads neither by match nor by share).

**Outside the step, leaving nothing behind.** Under ``torch.no_grad`` (no autograd graph), autocast off,
in eval mode (each module's own training flag restored after), the CPU and CUDA RNG states saved and
restored. No copy of the model: forward pre- and post-hooks on each module that holds floating tensors of
its own swap those tensors' ``.data`` for a cast copy (fp32, or ``rollout_dtype`` inside a lowered unit)
for the duration of that module's call and then put the original storage back, so at most one module's
cast copy exists at a time (plus the lowered unit's); a parameter is the same object with the same storage
after (tested bit-exact, with the RNG state and the training flags). A deep copy of a 7B model would double
its memory; casting the whole model in place would need its fp32 copy at once. Parameters held directly by
a module that is no unit (rare) stay fp32 in every run. An exception mid-forward restores every swap.

**Collective-safe, like the differential re-run** (``nanwatch.hooks.forensics.rerun``): it runs on one rank
alone, outside the step, so a forward must issue no collective. Under DDP it runs the inner module (whose
forward communicates nothing); a model whose forward gathers (FSDP/FSDP2, DTensor parameters, DeepSpeed
ZeRO-3, SyncBatchNorm: ``nanwatch.hooks.measure.collective.collective_forward``) is refused, with no forward
run, and the attribution's note says which wrapper.

Cost: with ``U`` top-level units (``L + 3`` for an HF LM of ``L`` blocks) and ``K`` children in the block
named, ``U + K + 2`` forwards of ``max_sequences`` sequences without grad (one more over the batch when the
trainer's logprobs were not kept), once per request; memory of one such forward, in fp32.
:func:`attribution_cost` counts it from the model and the sequences' shape without running anything (what
``nanwatch replay`` checks a capsule against before it redoes one: its ``--max-run-s`` and ``--max-bytes``).

:class:`RolloutAttributor` is what the Monitor holds: the batch kept by reference at each ``rlhf()`` call,
a request from the reporter thread on a drift or outlier event, and the run at the next ``rlhf()`` call that
keeps a batch: the weights are then those that scored it (at the step's end an optimizer step has moved
them, enough on the tiny test model to hide which module's rounding the rollout shows).
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch

from nanwatch.hooks.measure.collective import collective_forward
from nanwatch.wire import ModuleShare, RolloutAttribution

__all__ = ["NAME_SHARE", "AttributionCost", "RolloutAttributor", "attribute_mismatch", "attribution_cost", "units_of"]

log = logging.getLogger("nanwatch")

#: the share (of the every-unit-lowered mismatch) at which a unit lowered alone is named
NAME_SHARE = 0.5
_MAX_SHARES = 16  # RolloutAttribution.modules' wire bound


def _holds_params(m: torch.nn.Module) -> bool:
    return next(m.parameters(), None) is not None


def units_of(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """The top-level units of ``model``, in module order: the children that hold parameters of each module on
    the path from the root to the ``ModuleList``/``ModuleDict`` with the most such children (the repeated
    blocks), and that list's children; without such a list, the root's children that hold parameters."""
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, (torch.nn.ModuleList, torch.nn.ModuleDict))]
    best = max(lists, key=lambda nm: sum(map(_holds_params, nm[1].children())), default=None)
    path = best[0].split(".") if best is not None and best[0] else []
    prefixes = {".".join(path[:i]) for i in range(len(path) + 1)}  # "" (the root) ... the list itself
    units = []
    for name, module in model.named_modules():
        parent = name.rsplit(".", 1)[0] if "." in name else ""
        if name and parent in prefixes and name not in prefixes and _holds_params(module):
            units.append((name, module))
    return units


def _children_units(name: str, module: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    return [(f"{name}.{n}", m) for n, m in module.named_children() if _holds_params(m)]


class AttributionCost(NamedTuple):
    """What :func:`attribute_mismatch` will cost, counted before it runs."""

    forwards: int
    """Forwards of all the sequences: the fp32 one, every unit lowered, each unit and each child of the
    largest block alone (and one more without the trainer's logprobs)."""
    flops: float
    """All of them: 2 per parameter per token, and the attention's QK and AV products (4 × length² × heads ×
    head_dim per sequence and layer, from the config)."""
    activation_bytes: int
    """One forward's float32 activations: a block's hidden and MLP states per token, the logits kept (three
    copies: logits, scaled, log-softmax), and with eager attention one layer's length² scores."""


def _sizes(model: torch.nn.Module) -> dict[str, int]:
    """The config's sizes (an HF config's own names, through ``get_text_config``); 0 for what it lacks."""
    cfg = getattr(model, "config", None)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    out = {k: getattr(cfg, k, None) for k in ("num_hidden_layers", "num_attention_heads", "hidden_size",
                                              "intermediate_size", "vocab_size", "head_dim")}
    out = {k: v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 0 for k, v in out.items()}
    out["head_dim"] = out["head_dim"] or out["hidden_size"] // max(1, out["num_attention_heads"])
    out["eager"] = int(getattr(cfg, "_attn_implementation", None) == "eager")
    return out


def attribution_cost(model: torch.nn.Module, *, sequences: int, length: int, completion: int,
                     trainer_logprobs: bool = True) -> AttributionCost:
    """What :func:`attribute_mismatch` of ``sequences`` × ``length`` tokens (the last ``completion`` scored)
    would cost, from the module tree and the config, without running anything. An estimate, not a timer:
    an upper bound for a dense transformer, loose for a model whose config lacks the usual names."""
    units = units_of(model)
    forwards = len(units) + max((len(_children_units("", m)) for _, m in units), default=0) + 2 + (not trainer_logprobs)
    z = _sizes(model)
    params = sum(p.numel() for p in model.parameters())
    tokens = sequences * length
    attention = 4 * sequences * length * length * z["num_attention_heads"] * z["head_dim"] * z["num_hidden_layers"]
    flops = float(forwards) * (2 * params * tokens + attention)
    hidden = 4 * z["hidden_size"] + 2 * (z["intermediate_size"] or 4 * z["hidden_size"])
    scores = z["eager"] * sequences * max(1, z["num_attention_heads"]) * length * length
    nbytes = 4 * (tokens * hidden + 3 * sequences * (completion + 1) * z["vocab_size"] + scores)
    return AttributionCost(forwards, flops, nbytes)


def _cast(x: Any, dtype: torch.dtype) -> Any:
    """``x`` with its floating tensors (in tuples, lists and dicts, HF outputs included) as ``dtype``."""
    if isinstance(x, torch.Tensor):
        return x.to(dtype) if x.is_floating_point() and x.dtype != dtype else x
    if isinstance(x, dict):  # an HF ModelOutput is a dict: updated in place (the call's own fresh object)
        for k, v in list(x.items()):
            x[k] = _cast(v, dtype)
        return x
    if isinstance(x, tuple):
        items = [_cast(v, dtype) for v in x]
        return type(x)(*items) if hasattr(x, "_fields") else tuple(items)
    if isinstance(x, list):
        return [_cast(v, dtype) for v in x]
    return x


class _Precision:
    """The hooks that run a model in fp32 with some units lowered, without a copy of the model.

    Each module holding floating parameters or buffers of its own has its tensors' ``.data`` swapped for a
    cast copy while it runs (the dtype of the innermost lowered unit around it, else fp32) and restored after;
    each unit, when lowered, casts its floating inputs to the low dtype and its output back to fp32."""

    def __init__(self, model: torch.nn.Module, units: list[tuple[str, torch.nn.Module]], low: torch.dtype) -> None:
        self.low, self.lowered = low, set()  # ids of the lowered units
        self._dtypes: list[torch.dtype] = [torch.float32]
        self._swaps: list[tuple[torch.Tensor, torch.Tensor]] = []  # (tensor, its original .data), LIFO
        self._marks: list[int] = []
        self._handles: list[Any] = []
        for _, unit in units:  # first: a unit's dtype is pushed before its own tensors are cast
            self._handles += [unit.register_forward_pre_hook(self._enter_unit, with_kwargs=True),
                              unit.register_forward_hook(self._leave_unit, always_call=True)]
        for m in model.modules():
            own = [t for t in (*m.parameters(recurse=False), *m.buffers(recurse=False)) if t.is_floating_point()]
            if own:
                self._handles += [m.register_forward_pre_hook(self._enter(own)),
                                  m.register_forward_hook(self._leave, always_call=True)]

    def _enter_unit(self, module, args, kwargs):
        if id(module) not in self.lowered:
            return None
        self._dtypes.append(self.low)
        return _cast(args, self.low), _cast(dict(kwargs), self.low)

    def _leave_unit(self, module, args, output):
        if id(module) not in self.lowered:
            return None
        self._dtypes.pop()
        return _cast(output, torch.float32)

    def _enter(self, own: list[torch.Tensor]):
        def enter(module, args) -> None:
            self._marks.append(len(self._swaps))
            dtype = self._dtypes[-1]
            for t in own:
                if t.dtype != dtype:
                    self._swaps.append((t, t.data))
                    t.data = t.data.to(dtype)
        return enter

    def _leave(self, module, args, output) -> None:
        self._restore(self._marks.pop() if self._marks else 0)

    def _restore(self, to: int) -> None:
        while len(self._swaps) > to:
            t, data = self._swaps.pop()
            t.data = data

    def remove(self) -> None:
        """Every swap undone (an exception mid-forward included) and every hook removed."""
        self._restore(0)
        self._marks.clear()
        del self._dtypes[1:]
        for h in self._handles:
            h.remove()


def _logprobs(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor | None, c: int, temperature: float,
              accepts: set[str]) -> torch.Tensor:
    """``[n, c]`` float32: log_softmax(logits[:, t-1] / T) at ``ids[:, t]`` over the last ``c`` tokens."""
    kwargs: dict[str, Any] = {"input_ids": ids}
    if mask is not None:
        kwargs["attention_mask"] = mask
    if "use_cache" in accepts:
        kwargs["use_cache"] = False
    if "logits_to_keep" in accepts:
        kwargs["logits_to_keep"] = c + 1
    out = model(**kwargs)
    logits = out if isinstance(out, torch.Tensor) else getattr(out, "logits", None)
    if logits is None:
        logits = out[0]
    logits = logits[:, -(c + 1):-1].float() / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[:, -c:, None]).squeeze(-1)


def _abs_mean(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    d = (a - b).abs()
    ok = mask & torch.isfinite(d)
    n = int(ok.sum())  # sync-ok: the attribution, outside the step, on request
    return float(d.masked_fill(~ok, 0).sum()) / n if n else float("nan")  # sync-ok: the attribution


@contextmanager
def _outside_the_step(model: torch.nn.Module, device: torch.device) -> Iterator[None]:
    """No grad, autocast off, eval mode; each module's training flag and the RNG states as they were after."""
    flags = [(m, m.training) for m in model.modules()]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if device.type == "cuda" else []
    try:
        with torch.no_grad(), torch.autocast(device.type, enabled=False):
            model.eval()
            yield
    finally:
        for m, training in flags:
            m.training = training
        torch.set_rng_state(cpu_rng)
        if cuda_rng:
            torch.cuda.set_rng_state_all(cuda_rng)


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def _worst(trainer: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor, n: int) -> torch.Tensor:
    """The indices of the ``n`` sequences with the largest mean |Δlogp| over their finite masked tokens."""
    d = (trainer - rollout).abs()
    ok = mask & torch.isfinite(d)
    per = d.masked_fill(~ok, 0).sum(-1) / ok.sum(-1).clamp(min=1)
    per = per.masked_fill(ok.sum(-1) == 0, -1.0)
    return per.topk(min(n, per.numel())).indices


def attribute_mismatch(model: torch.nn.Module, input_ids: torch.Tensor, rollout_logprobs: torch.Tensor, *,
                       attention_mask: torch.Tensor | None = None, completion_mask: torch.Tensor | None = None,
                       trainer_logprobs: torch.Tensor | None = None, rollout_dtype: torch.dtype = torch.bfloat16,
                       temperature: float = 1.0, cause: str = "drift", step: int = 0, max_sequences: int = 8
                       ) -> RolloutAttribution:
    """Name the module whose lowering to ``rollout_dtype`` alone reproduces the rollout mismatch (see the
    module docstring). ``trainer_logprobs`` (``[B, C]``, the step's own): used to pick the worst sequences and
    for ``observed_abs_mean``; without it the model's own forward (no hooks, its own dtypes) gives them.
    Raises on a malformed input; refuses (a note, nothing run) a model whose forward issues collectives."""
    start = time.perf_counter()
    base = {"step": step, "cause": cause, "rollout_dtype": str(rollout_dtype).removeprefix("torch.")}
    model = _unwrapped(model)
    wrapper = collective_forward(model)
    if wrapper:
        return RolloutAttribution(**base, note=f"not run: {wrapper}; a forward re-run on this rank alone would "
                                  "wait for the other ranks (a hang)")
    c = rollout_logprobs.shape[1]
    device = input_ids.device
    mask = (completion_mask.bool() if completion_mask is not None
            else torch.ones(rollout_logprobs.shape, dtype=torch.bool, device=device))
    accepts = set(inspect.signature(model.forward).parameters)
    with _outside_the_step(model, device):
        if trainer_logprobs is None:
            trainer_logprobs = torch.cat([
                _logprobs(model, input_ids[i:i + max_sequences],
                          None if attention_mask is None else attention_mask[i:i + max_sequences], c, temperature,
                          accepts) for i in range(0, input_ids.shape[0], max_sequences)])
        pick = _worst(trainer_logprobs.detach().float(), rollout_logprobs.float(), mask, max_sequences)
        ids, am = input_ids[pick], None if attention_mask is None else attention_mask[pick]
        mask = mask[pick]
        observed = _abs_mean(trainer_logprobs.detach().float()[pick], rollout_logprobs.float()[pick], mask)
        target = rollout_logprobs.float()[pick] - trainer_logprobs.detach().float()[pick]
        figures = _lower_each(model, ids, am, mask, c, temperature, accepts, rollout_dtype, target)
    return _verdict(base, figures, sequences=int(pick.numel()), observed=observed,
                    seconds=time.perf_counter() - start)


def _lower_each(model, ids, am, mask, c, temperature, accepts, low, target) -> dict[str, Any]:
    """The fp32 forward, every top-level unit lowered, each one lowered alone, then each child of the one
    that explains most lowered alone: {"lowered": abs_mean, "units": {name: (abs_mean, explained)},
    "children": [names]}. ``explained``: 1 − mean|target − Δ| / mean|target|, Δ = that forward − fp32 and
    ``target`` the observed rollout − trainer, token by token."""
    top = units_of(model)
    scale = _abs_mean(target, torch.zeros_like(target), mask)
    hooks = _Precision(model, top + [u for _, m in top for u in _children_units("", m)], low)
    units: dict[str, tuple[float, float]] = {}
    children: list[tuple[str, torch.nn.Module]] = []
    try:
        fp32 = _logprobs(model, ids, am, c, temperature, accepts)

        def lowered(group: list[tuple[str, torch.nn.Module]]) -> tuple[float, float]:
            hooks.lowered = {id(m) for _, m in group}
            try:
                lp = _logprobs(model, ids, am, c, temperature, accepts)
            finally:
                hooks.lowered = set()
            return _abs_mean(lp, fp32, mask), 1 - _abs_mean(lp - fp32, target, mask) / scale

        every = lowered(top)[0] if top else float("nan")
        units = {name: lowered([(name, m)]) for name, m in top}
        if units:
            children = _children_units(_leading(units, every), dict(top)[_leading(units, every)])
            if len(children) > 1:
                units.update({name: lowered([(name, m)]) for name, m in children})
    finally:
        hooks.remove()
    return {"lowered": every, "units": units, "children": [n for n, _ in children] if len(children) > 1 else []}


def _leading(units: dict[str, tuple[float, float]], every: float) -> str:
    """The unit that explains most: the best token-by-token match when one reaches NAME_SHARE, else the
    largest share."""
    best = max(units, key=lambda n: units[n][1])
    return best if units[best][1] >= NAME_SHARE else max(units, key=lambda n: units[n][0])


def _verdict(base: dict[str, Any], figures: dict[str, Any], *, sequences: int, observed: float,
             seconds: float) -> RolloutAttribution:
    """The attribution from the measured figures: the most specific unit that reproduces the observed
    Δlogp token by token (explained >= NAME_SHARE), else the most specific whose share reaches NAME_SHARE."""
    every, units = figures["lowered"], figures["units"]
    if not units:
        return RolloutAttribution(**base, sequences=sequences, observed_abs_mean=_finite(observed),
                                  seconds=seconds, note="no unit holds parameters: nothing to lower")
    share = {n: a / every if every > 0 else 0.0 for n, (a, _) in units.items()}
    ranked = sorted(units, key=lambda n: -share[n])
    order = [n for n in ranked if n in figures["children"]][:1] + [n for n in ranked if n not in figures["children"]][:1]
    matched = sorted((n for n in units if units[n][1] >= NAME_SHARE), key=lambda n: (n not in figures["children"], -units[n][1]))
    if matched:
        named, note = matched[0], (f"{matched[0]} lowered alone reproduces the observed Δlogp token by token "
                                   f"({units[matched[0]][1]:.2f} of it): the rollout computes it in {base['rollout_dtype']}")
    else:
        named = next((n for n in order if share[n] >= NAME_SHARE), None)
        note = (f"{named} lowered alone reproduces {share[named]:.2f} of the mismatch of every unit lowered"
                if named else "no unit lowered alone reproduces half of the mismatch of every unit lowered: "
                "the top ones are " + ", ".join(f"{n} ({share[n]:.2f})" for n in ranked[:3]))
    modules = [ModuleShare(module=n, abs_mean=units[n][0], share=share[n]) for n in ranked[:_MAX_SHARES]]
    explains = every / observed if observed > 0 else 1.0
    if explains < NAME_SHARE:  # precision is not what was observed: naming a module would send the user astray
        note = (f"withheld: lowering every module to {base['rollout_dtype']} explains {explains:.0%} of the observed "
                f"mismatch ({every:.3g} of mean |Δlogp| {observed:.3g}), so no module's precision is the cause; "
                f"look at the weight sync (stale weights) and the sampler first. Had it been precision: {note}")
        named = None
    return RolloutAttribution(**base, sequences=sequences, observed_abs_mean=_finite(observed),
                              lowered_abs_mean=_finite(every), module=named, modules=modules, seconds=seconds,
                              note=note)


def _finite(x: float) -> float | None:
    return x if x == x and abs(x) != float("inf") else None


class RolloutAttributor:
    """The Monitor's rollout attribution: the last batch kept by reference, a request from the reporter
    thread, the run at the next ``rlhf()`` call on the training thread; once per run unless asked again.

    Example usage::

        attributor = RolloutAttributor(rollout_dtype="bfloat16", capsules=writer)
        attributor.keep(input_ids=ids, rollout_logprobs=rlp, logprobs=lp, completion_mask=mask)  # rlhf()
        attributor.request("drift", step=n)            # reporter thread: a drift event was classified
        attribution = attributor.run_requested(model)  # training thread: None unless one ran
    """

    def __init__(self, *, rollout_dtype: str | torch.dtype = "bfloat16", temperature: float = 1.0,
                 max_sequences: int = 8, capsules: Any = None) -> None:
        self.rollout_dtype = getattr(torch, rollout_dtype) if isinstance(rollout_dtype, str) else rollout_dtype
        if not isinstance(self.rollout_dtype, torch.dtype) or not self.rollout_dtype.is_floating_point:
            raise ValueError(f"rollout_dtype must name a floating torch dtype, got {rollout_dtype!r}")
        self.temperature, self.max_sequences, self.capsules = temperature, max_sequences, capsules
        self._lock = threading.Lock()
        self._kept: dict[str, Any] | None = None
        self._asked: tuple[str, int] | None = None
        self._done = False

    def keep(self, *, input_ids: torch.Tensor, rollout_logprobs: torch.Tensor, logprobs: torch.Tensor | None = None,
             attention_mask: torch.Tensor | None = None, completion_mask: torch.Tensor | None = None) -> None:
        """The step's batch, by reference (no copy, no sync); training thread."""
        self._kept = {"input_ids": input_ids, "rollout_logprobs": rollout_logprobs.detach(),
                      "trainer_logprobs": None if logprobs is None else logprobs.detach(),
                      "attention_mask": attention_mask, "completion_mask": completion_mask}

    def request(self, cause: str, step: int, *, again: bool = False) -> bool:
        """Ask for an attribution at the next ``rlhf()`` call that keeps a batch (any thread); False when one already ran this run
        (``again=True`` asks anyway)."""
        with self._lock:
            if self._done and not again:
                return False
            self._done = False
            self._asked = (cause, step)
            return True

    def run_requested(self, model: torch.nn.Module) -> RolloutAttribution | None:
        """Run the requested attribution on the kept batch (training thread, outside the step). Never raises:
        a failure warns and returns None."""
        with self._lock:
            asked, kept = self._asked, self._kept
            if asked is None or kept is None:
                return None
            self._asked, self._done = None, True
        try:
            result = attribute_mismatch(model, kept["input_ids"], kept["rollout_logprobs"],
                                        attention_mask=kept["attention_mask"],
                                        completion_mask=kept["completion_mask"],
                                        trainer_logprobs=kept["trainer_logprobs"], rollout_dtype=self.rollout_dtype,
                                        temperature=self.temperature, cause=asked[0], step=asked[1],
                                        max_sequences=self.max_sequences)
        except Exception as exc:  # noqa: BLE001 - monitoring must not break the step
            log.warning("nanwatch: rollout attribution failed: %s: %s (training goes on)", type(exc).__name__,
                        str(exc)[:200])
            return None
        where = self._capsule(model, kept, result)
        return result.model_copy(update={"capsule": where}) if where else result

    def _capsule(self, model: torch.nn.Module, kept: dict[str, Any], result: RolloutAttribution) -> str | None:
        """The capsule that redoes it anywhere (``nanwatch replay``): the worst sequences again, both logprob
        sets, the model's config and state; None when capsules are off or it was refused."""
        if self.capsules is None or result.lowered_abs_mean is None or not self.capsules.wants("attribution"):
            return None
        mask = kept["completion_mask"]
        rollout, trainer = kept["rollout_logprobs"].float(), kept["trainer_logprobs"]
        ok = (mask.bool() if mask is not None else torch.ones_like(rollout, dtype=torch.bool))
        pick = _worst(trainer.float(), rollout, ok, self.max_sequences) if trainer is not None else \
            torch.arange(min(self.max_sequences, rollout.shape[0]), device=rollout.device)
        inputs = {k: v[pick] for k, v in kept.items() if isinstance(v, torch.Tensor)}
        extra = {"rollout_dtype": result.rollout_dtype, "temperature": self.temperature,
                 "attribution": result.model_dump(mode="json")}
        return self.capsules.capture_model(kind="attribution", step=result.step, model=_unwrapped(model),
                                           inputs=inputs, extra=extra)
