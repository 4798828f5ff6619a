"""Differential rerun: classify a run's first non-finite step before choosing the remedy.

The training forwards of each step are kept by reference (their inputs and the RNG state at their start;
nothing is copied). When a step turns out non-finite, the micro-batch is re-run, forward only and without
grad, before the next optimizer step (the weight guard skipped this one, so the weights are those it ran
with):

1. on the same path, same inputs, same RNG: finite means **not reproducible** (suspect hardware or a
   race: the incident names the rank and host);
2. the inputs themselves: non-finite rows that are all fully masked query rows (pad rows of a left-padded
   batch are fully masked on every clean step too: they are blamed only when they are where the value was
   born), a non-finite floating input, or a parameter of the birth module already non-finite, is
   **data/mask**;
3. under fp32 attention, and on the SDPA math kernel: if either is finite the fast path was at fault,
   **precision** (a fallback helps); if both are non-finite too, **data/mask** (no precision switch helps).

On the culprit micro-batch a drill-down re-runs the same path once more with every module watched: the
first module to *finish* with a non-finite output, from a finite input, is where the value was born (a
leaf such as ``mlp.down_proj``); if that module's input was already non-finite, the value was born in the
enclosing module's own arithmetic (the attention kernel inside ``self_attn``), with its own parameters that
were already non-finite and the exact count of non-finite elements it produced, and the path the value then
took. That module's
faulting call (its arguments, parameters, RNG and settings) is what an incident capsule holds
(``nanwatch.hooks.forensics.capsule``; ``nanwatch replay CAPSULE`` re-runs it anywhere).

Non-finite means: at the first offender's module, at any attention call's query or output, or at the
model's output. The cost is up to three forwards of one micro-batch without grad (activation memory of one
forward, no more), once per run, plus, to decide when to run it, the step's non-finite flag on the host
(``MonitorConfig.forensics.rerun``, on by default): read at the step's end on the CPU, where it is free; on an
accelerator copied without a host read and decided a step later (``nanwatch.hooks.forensics.rerun_flags``).
First, every parameter and optimizer-state tensor is read once (``nanwatch.hooks.forensics.incident_tensors``):
a parameter an unchecked optimizer update wrote non-finite is class ``optimizer``, with no rerun. It does
not run when it cannot be sound: a NaN born in backward (the rerun
re-runs forwards), no kept forward, compiled code in the step (the probes, and so the fp32 path, are off
inside graphs), or no weight guard (the weights already moved). The incident then says ``not_classified``
and why.

Many ranks: the rerun runs on the rank whose step was non-finite, alone, outside the user's step. That is
sound only where a forward issues no collective. Under DDP it calls the inner module (the Monitor's model
is the user's, inside the wrapper), whose forward communicates nothing, and every rank skipped the step
(the guard's reduction), so the weights are those the step ran with. Under FSDP, DTensor parameters,
DeepSpeed ZeRO-3 or SyncBatchNorm a forward gathers from every rank: one rank re-running it hung the job
(measured, FSDP2 on 2 gloo ranks), so there the rerun does not run and the incident says which wrapper
(``nanwatch.hooks.measure.collective.collective_forward``). Running it on every rank together would need the
ranks to agree on every branch of the search (which micro-batch, which path), a collective per branch.

:class:`DifferentialRerun` is what the Monitor holds: rerun mode's per-step decision (the step's flag, the
scaler's overflow excepted, once per run) and the capsule writer it fills. "rerun" is the
differential re-run's word; "replay" means only a capsule's (``nanwatch replay``).
"""

from __future__ import annotations

import logging
import socket
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from nanwatch.hooks.config import ForensicsConfig
from nanwatch.hooks.directives.directive_state import DirectiveState
from nanwatch.hooks.forensics import rerun_flags
from nanwatch.hooks.forensics.capsule import CapsuleWriter, capsule_settings
from nanwatch.hooks.forensics.incident_tensors import optimizer_birth, read_tensors, state_note
from nanwatch.hooks.forensics.rerun_flags import FlagsInFlight
from nanwatch.hooks.instrument.probes import Probes, first_tensor
from nanwatch.hooks.measure.collective import collective_forward
from nanwatch.hooks.measure.decode import StepSoFar, decode_step, nonfinite_phases, step_facts, step_so_far
from nanwatch.hooks.measure.inputs import dead_rows
from nanwatch.hooks.measure.kept_forward import KeptForward, freeze
from nanwatch.hooks.measure.recorder import Recorder, StepState
from nanwatch.hooks.measure.scaler_overflow import SCALER_FOUND, handled_by_scaler, loss_scaling
from nanwatch.wire import Incident

__all__ = ["DifferentialRerun", "classify", "defers", "open_capsules", "rerun"]

log = logging.getLogger("nanwatch")


def _nonfinite_input(kept: KeptForward) -> bool:
    tensors = [x for x in (*kept.args, *kept.kwargs.values()) if isinstance(x, torch.Tensor)]
    return any(bool((~torch.isfinite(t)).any()) for t in tensors if t.is_floating_point())  # sync-ok: rerun


def _named_module_of(model: torch.nn.Module, site: str | None) -> tuple[str, torch.nn.Module] | None:
    """(FQN, module) a site is measured at (``x.query`` and ``x.log_probs`` are read inside module ``x``)."""
    if site is None:
        return None
    modules = dict(model.named_modules())
    for name in (site, site.rsplit(".", 1)[0]):
        if name in modules:
            return name, modules[name]
    return None


def _module_of(model: torch.nn.Module, site: str | None) -> torch.nn.Module | None:
    """The module a site is measured at (``x.query`` and ``x.log_probs`` are read inside module ``x``)."""
    named = _named_module_of(model, site)
    return named[1] if named is not None else None


def _first_call(module: torch.nn.Module, sink: list) -> Any:
    """A forward pre-hook handle that puts ``module``'s first call (its arguments by reference, the CPU RNG
    state at its start) into ``sink``: the call a not-reproducible incident's capsule holds."""
    def enter(mod, args, kwargs) -> None:
        if not sink:  # an HF cache as it stood at the call's start, not as the call leaves it
            sink.append((*freeze(args, dict(kwargs))[:2], torch.get_rng_state()))

    return module.register_forward_pre_hook(enter, with_kwargs=True)


def _run(model: torch.nn.Module, probes: Probes, kept: KeptForward, watch: torch.nn.Module | None) -> bool:
    """Re-run one forward without grad on its own RNG state; True when it is non-finite at ``watch``'s
    output, at any attention call's query or output (a fused kernel can hide a NaN query), or at the
    model's output."""
    def record(module, args, output) -> None:
        t = first_tensor(output)
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            probes.rerun.saw(t)

    handle = watch.register_forward_hook(record) if watch is not None else None
    torch.set_rng_state(kept.cpu_rng)
    if kept.cuda_rng:
        torch.cuda.set_rng_state_all(kept.cuda_rng)
    try:
        with probes.rerun.rerunning_forward() as seen, torch.no_grad():
            record(model, (), model(*kept.args, **kept.kwargs))
    finally:
        if handle is not None:
            handle.remove()
    return not bool(torch.stack(seen).all()) if seen else False  # sync-ok: rerun, once per run


def _first_input(args, kwargs) -> torch.Tensor | None:
    """The floating tensor a module's input stands for: its first positional one, else ``hidden_states``."""
    t = first_tensor(args) if args else kwargs.get("hidden_states")
    return t if isinstance(t, torch.Tensor) and t.is_floating_point() else None


#: one module's finish in the drill-down: (FQN, module, any non-finite output, how many, its input already
#: non-finite, the non-finite rows ``[B, S]`` or None), all device tensors
_Record = tuple[str, torch.nn.Module, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]


class _Finishes:
    """The drill-down's hooks on every named module: each finish recorded in finishing order with its call
    (arguments by reference and, with ``capture``, the CPU RNG state at its start), and the query rows the
    first 4-D attention mask leaves empty (``masked``, ``[B, Q]``)."""

    def __init__(self, capture: bool) -> None:
        self.capture = capture
        self.records: list[_Record] = []
        self.calls: list[tuple[tuple, dict, torch.Tensor | None]] = []  # per record: the call, its CPU RNG
        self.masked: list[torch.Tensor] = []
        self._started: dict[int, list[tuple]] = {}  # per module: (CPU RNG, the call frozen) at each start

    def hooks(self, model: torch.nn.Module) -> list:
        named = [(n, m) for n, m in model.named_modules() if n]
        handles = [m.register_forward_hook(partial(self._finish, n), with_kwargs=True) for n, m in named]
        if self.capture:
            handles += [m.register_forward_pre_hook(self._enter, with_kwargs=True) for _, m in named]
        return handles

    def _enter(self, module, args, kwargs) -> None:  # the RNG state and HF caches a capsule replays the call from
        self._started.setdefault(id(module), []).append((torch.get_rng_state(), *freeze(args, kwargs)[:2]))

    def _finish(self, name: str, module, args, kwargs, output) -> None:
        started = self._started.get(id(module))
        rng, call_args, call_kwargs = started.pop() if started else (None, args, kwargs)
        mask = kwargs.get("attention_mask")
        if not self.masked and isinstance(mask, torch.Tensor) and mask.dim() == 4:
            self.masked.append(dead_rows(mask).all(dim=1))
        t = first_tensor(output)
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            bad, x = ~torch.isfinite(t), _first_input(args, kwargs)
            fed = ((~torch.isfinite(x)).any() if x is not None
                   else torch.zeros((), dtype=torch.bool, device=t.device))
            rows = bad.flatten(2).any(dim=-1) if bad.dim() >= 3 else None  # [B, S, ...] -> [B, S]
            self.records.append((name, module, bad.any(), bad.sum(), fed.to(t.device), rows))
            self.calls.append((call_args, call_kwargs, rng))


def _drill(model: torch.nn.Module, probes: Probes, kept: KeptForward, capture: bool = False
           ) -> dict[str, Any]:
    """The birth module, its non-finite parameters and output count, and the downstream path.

    Modules are taken in the order they finish. The first one with a non-finite output is the birth if its
    input was finite (a leaf such as ``mlp.down_proj``). If its input was already non-finite, the value was
    born in the enclosing module's own code between its children (the attention kernel inside
    ``self_attn``, say): the birth is that parent. With ``capture``, ``_call`` is also returned: the birth
    module, its call's arguments (by reference) and the CPU RNG state at the call's start, for a capsule."""
    seen = _Finishes(capture)
    handles = seen.hooks(model)
    try:
        _run(model, probes, kept, None)
    finally:
        for h in handles:
            h.remove()
    if not seen.records:
        return {}
    flags = torch.stack([torch.stack((r[2], r[4])) for r in seen.records]).tolist()  # sync-ok: incident, once
    bad = [(r, fed) for r, (flag, fed) in zip(seen.records, flags, strict=True) if flag]
    return _birth(model, probes, seen, bad) if bad else {}


def _birth(model: torch.nn.Module, probes: Probes, seen: _Finishes, bad: list[tuple[_Record, bool]]
           ) -> dict[str, Any]:
    """``_drill``'s verdict from the non-finite finishes ``bad`` (in finishing order, with whether each one's
    input was already non-finite)."""
    (name, module, _, count, _, rows), fed = bad[0]
    modules = dict(model.named_modules())
    if fed and "." in name and name.rsplit(".", 1)[0] in modules:  # born in the parent's own code
        name = name.rsplit(".", 1)[0]
        module = modules[name]
        count, rows = next(((r[3], r[5]) for r, _ in bad if r[0] == name), (count, rows))
    call = next((c for r, c in zip(seen.records, seen.calls, strict=True) if r[0] == name), None)
    params = {}
    for pname, t in module.named_parameters(recurse=False):
        n = int((~torch.isfinite(t)).sum())  # sync-ok: the incident, once
        if n:
            params[pname] = n
    # the path at the granularity of the coarse sites (blocks and their children) and the head, or of
    # every module when there are no coarse sites
    coarse = probes.coarse_ids
    path: list[str] = []
    for (later, mod, *_), _ in bad:
        if (later != name and later not in path and len(path) < 16
                and (not coarse or id(mod) in coarse or later == probes.head)):
            path.append(later)
    # The fully masked query rows are to blame only where the birth's non-finite rows are among them (every
    # clean step of a left-padded batch has them too); where the shapes do not line up, nothing is blamed.
    masked = seen.masked
    fits = bool(masked) and rows is not None and rows.shape == masked[0].shape
    rows_masked = (fits and bool(rows.any())  # sync-ok: the incident, once
                   and not bool((rows & ~masked[0].to(rows.device)).any()))  # sync-ok: once
    out = {"birth": name, "birth_params": params, "birth_elements": int(count), "path": path,
           "rows_masked": rows_masked}
    if seen.capture and call is not None:
        out["_call"] = (module, *call)
    return out


class _Verdict:
    """Makes the rerun's Incident: the step's facts, the seconds it took, and the capsule of the call it
    captured (``call``: at most one, ``(FQN, module, args, kwargs, CPU RNG, what it is of)``)."""

    def __init__(self, *, step: int, site: str | None, phase: str | None, masked_rows: int, rank: int,
                 capsules: Any, device: str) -> None:
        self.start = time.perf_counter()
        self.base: dict[str, Any] = {"step": step, "site": site, "phase": phase,
                                     "fully_masked_rows": masked_rows,
                                     "host": f"{socket.gethostname()} rank {rank}", "device": device}
        self.capsules = capsules
        self.call: list[tuple] = []

    def wants(self, cls: str) -> bool:
        return self.capsules is not None and self.capsules.wants(cls)

    def done(self, cls: str, note: str = "", **outcomes: Any) -> Incident:
        seconds = time.perf_counter() - self.start
        incident = Incident(cls=cls, note=note, seconds=seconds, **self.base, **outcomes)
        if self.call and self.capsules is not None:  # never raises; None when not captured
            name, module, args, kwargs, rng, of = self.call[0]
            where = self.capsules.capture(incident=incident, name=name, module=module, args=args,
                                          kwargs=kwargs, rng=rng, of=of)
            if where is not None:
                incident = incident.model_copy(update={"capsule": where})
        return incident


def _why_not(model: torch.nn.Module, *, phase: str | None, kept: list[KeptForward], weight_guard_on: bool,
             compiled: bool) -> str:
    """Why a rerun of this step would not be sound ("" when it would be)."""
    wrapper = collective_forward(model)
    if wrapper:
        return (f"{wrapper}: a forward re-run on this rank alone would wait for the other ranks (a hang), "
                "so the rerun does not run under it")
    # before "backward": a compiled forward is not probed, so a NaN born inside its graph is first seen in
    # backward, which does not make backward its birthplace
    if compiled:
        return ("compiled code ran in the step: its forward is not probed inside graphs (the value may have "
                "been born there, whatever pass first showed it) and the fp32 path is not applied")
    if phase == "backward":
        return ("the non-finite value was first seen in backward; the rerun re-runs forwards only, so "
                "there is no capsule (a backward birth is not captured nor replayed)")
    if not kept:
        return "no training forward was kept this step"
    if not weight_guard_on:
        return "no weight guard: the weights moved since the step, so a rerun would not be that step"
    return ""


def _culprit(model: torch.nn.Module, probes: Probes, kept: list[KeptForward],
             named: tuple[str, torch.nn.Module] | None, site: str | None, verdict: _Verdict
             ) -> KeptForward | None:
    """The first kept micro-batch whose re-run on the same path is non-finite, or None. A not-reproducible
    incident has no drill-down (nothing non-finite to follow), so its capsule is the first offender's module
    with the call it received in the re-run of the first kept micro-batch: what training fed it (same inputs,
    same RNG, the weights guarded), for a replay on another host."""
    watch = named[1] if named is not None else None
    first_call: list[tuple] = []
    hook = _first_call(watch, first_call) if watch is not None and verdict.wants("not_reproducible") else None
    try:
        culprit = next((k for k in kept if _run(model, probes, k, watch)), None)
    finally:
        if hook is not None:
            hook.remove()
    if culprit is None and first_call and named is not None:
        of = {"of": "first_offender", "site": site, "micro_batch": 0, "micro_batches": len(kept),
              "note": "the re-run was finite: this is the first offender's call in the re-run of the "
                      "step's first kept micro-batch, the inputs training fed it"}
        verdict.call.append((named[0], watch, *first_call[0], of))
    return culprit


def _search(model: torch.nn.Module, probes: Probes, directive_state: DirectiveState, kept: list[KeptForward],
            named: tuple[str, torch.nn.Module] | None, site: str | None, kinds: dict[str, str],
            verdict: _Verdict) -> Incident:
    """The rerun proper (see the module docstring): the culprit micro-batch, its drill-down, then the fp32
    and math paths."""
    watch = named[1] if named is not None else None
    culprit = _culprit(model, probes, kept, named, site, verdict)
    if culprit is None:
        return verdict.done("not_reproducible", "the same path on the same inputs was finite", same="finite")
    drilled = _drill(model, probes, culprit, capture=verdict.capsules is not None)
    if "_call" in drilled:
        verdict.call.append((drilled.get("birth", ""), *drilled.pop("_call"), {"of": "birth"}))
    rows_masked = drilled.pop("rows_masked", False)
    base = verdict.base
    base.update(drilled)
    if "birth" in base:
        birth = base["birth"]  # a site the step did not measure (an eval-only one, say) has its kind from install
        base["birth_kind"] = kinds.get(birth) or probes.coarse_kinds.get(birth) or (
            "logits" if birth == probes.head else "module")
    with directive_state.forced("fp32"):
        fp32 = _run(model, probes, culprit, watch)
    with directive_state.forced("eager_to_sdpa"), sdpa_kernel(SDPBackend.MATH):
        math_ = _run(model, probes, culprit, watch)
    outcomes = {"same": "nonfinite", "fp32": "nonfinite" if fp32 else "finite",
                "math": "nonfinite" if math_ else "finite"}
    if rows_masked or _nonfinite_input(culprit) or base.get("birth_params"):
        note = ("fully masked query rows" if rows_masked
                else "a non-finite input" if not base.get("birth_params")
                else f"a parameter of {base['birth']} was already non-finite")
        return verdict.done("data_mask", f"{note}: no precision switch helps", **outcomes)
    if fp32 and math_:
        return verdict.done("data_mask", "every path is non-finite", **outcomes)
    return verdict.done("precision", "only the fast path is non-finite: a fallback helps", **outcomes)


def rerun(*, model: torch.nn.Module, probes: Probes, directive_state: DirectiveState, kept: list[KeptForward],
          step: int, site: str | None, phase: str | None, masked_rows: int, weight_guard_on: bool,
          compiled: bool, rank: int, kinds: dict[str, str] | None = None, capsules: Any = None,
          optimizers: Sequence[torch.optim.Optimizer] = (), unread_updates: bool = False, stale: str = ""
          ) -> Incident:
    """Classify the step; see the module docstring. Never raises into training: a rerun that fails is
    ``not_classified`` with the error in ``note``. With ``capsules`` (a
    ``nanwatch.hooks.forensics.capsule.CapsuleWriter``), a drilled-down incident also gets a capsule of its
    birth module's faulting call (``Incident.capsule``), and a not-reproducible one a capsule of its first
    offender's call in the re-run. ``weight_guard_on``: a weight guard kept the step out of the weights (else
    the weights moved, and a rerun would not be that step); ``stale``: why the weights may have moved since
    all the same (a flag that reached the host late, ``nanwatch.hooks.forensics.rerun_flags``).

    First every parameter and the state of ``optimizers`` are read once
    (``nanwatch.hooks.forensics.incident_tensors``): a parameter non-finite after an optimizer update the
    optimizer check did not read (``unread_updates``) is an ``optimizer`` birth, no rerun needed."""
    verdict = _Verdict(step=step, site=site, phase=phase, masked_rows=masked_rows, rank=rank,
                       capsules=capsules, device=next((p.device.type for p in model.parameters()), "cpu"))
    why_not = stale or _why_not(model, phase=phase, kept=kept, weight_guard_on=weight_guard_on, compiled=compiled)
    if why_not:
        return verdict.done("not_classified", why_not)
    saved_rng = torch.get_rng_state()
    saved_cuda = torch.cuda.get_rng_state_all() if any(k.cuda_rng for k in kept) else []
    named = _named_module_of(model, site)
    try:
        bad = read_tensors(model, list(optimizers))
        if bad.params and unread_updates:
            return verdict.done("optimizer", **optimizer_birth(bad, step=step, phase=phase))
        incident = _search(model, probes, directive_state, kept, named, site, kinds or {}, verdict)
        if bad.state:
            incident = incident.model_copy(update={"note": f"{incident.note}; {state_note(bad)}"[:1000]})
        return incident
    except Exception as exc:  # noqa: BLE001 - monitoring must not break the step
        return verdict.done("not_classified", f"the rerun failed: {type(exc).__name__}: {str(exc)[:200]}")
    finally:
        torch.set_rng_state(saved_rng)
        if saved_cuda:
            torch.cuda.set_rng_state_all(saved_cuda)


def classify(*, rec: Recorder, model: torch.nn.Module, probes: Probes, directive_state: DirectiveState,
             step: int, facts: StepSoFar, kept: list[KeptForward], weight_guard_on: bool, rank: int,
             capsules: Any = None, optimizers: Sequence[torch.optim.Optimizer] = (), unread_updates: bool = False,
             stale: str = "") -> Incident | None:
    """Step ``step``, known to be non-finite, described by ``facts`` (its first offender, masked rows...):
    classify it by a rerun of its ``kept`` forwards and put the verdict into the recorder's open step, for
    that step's report (the step's own, or on an accelerator a later one: the incident carries its step).
    None when the value was born in an optimizer update the optimizer check read (forward and backward were
    finite): there is nothing to re-run, and the report names it (``nanwatch.hooks.measure.optimizer_check``)."""
    first = facts.first
    if first is not None and first[1] == "optimizer":
        return None
    incident = rerun(model=model, probes=probes, directive_state=directive_state, kept=kept, step=step,
                     site=first[0] if first else None, phase=first[1] if first else None,
                     masked_rows=facts.masked_rows, weight_guard_on=weight_guard_on, compiled=facts.compiled,
                     rank=rank, kinds=facts.kinds, capsules=capsules, optimizers=optimizers,
                     unread_updates=unread_updates, stale=stale)
    rec.set_incident(incident)
    # INFO: the report's own line (nanwatch.hooks.report.local_log) tells the incident at WARNING, once,
    # with its step, site and birth; two lines for one incident would read as two
    log.info("nanwatch: step %d: first non-finite step classified %s (%s)", step, incident.cls, incident.note)
    return incident


def open_capsules(config: ForensicsConfig, *, run_id: str, rank: int) -> CapsuleWriter | None:
    """The capsule writer a rerun fills, from the Monitor's options and ``NANWATCH_CAPSULE_*``; None when
    capsules are off. The options were checked by ForensicsConfig; a bad variable turns capsules off, warned."""
    try:
        on, count, folder, limit = capsule_settings(config.capsule, config.capsule_max, config.capsule_dir,
                                                    config.capsule_max_bytes)
    except ValueError as exc:
        log.warning("nanwatch: incident capsules off: %s", exc)
        return None
    if not on:
        return None
    return CapsuleWriter(run_id=run_id, rank=rank, directory=folder, max_count=count, max_bytes=limit)


def defers(device: torch.device) -> bool:
    """Whether a model on ``device`` has its rerun decided a step later, from its flag copied without a host
    read (an accelerator), rather than at the step's end (the CPU, where the read is free). The tests' seam:
    forcing True runs the accelerator's path on the CPU."""
    return device.type != "cpu"


class DifferentialRerun:
    """Rerun mode for one Monitor (``MonitorConfig.forensics.rerun``; on whenever a weight guard is effective): the
    first time a step's non-finite flag is set (a loss-scale overflow the scaler handled excepted), classify
    that step by a rerun before its weights move. Holds the capsule writer the rerun fills. Training thread.

    When: on the CPU reading the flag is free, so the step is decided at its end. On an accelerator the flag
    goes to the host without a read (``nanwatch.hooks.forensics.rerun_flags``) and the step is decided at the
    next step start, or else at the next optimizer pre-step, once it has landed (never waiting for it); its
    incident then lands in that later step's report, with its own ``step``. ``defer`` says which (a test may
    set it, to run the accelerator's path on the CPU).

    Example usage::

        rerun = DifferentialRerun(cfg.forensics, run_id="r1", rank=0, device=device, rec=rec, model=model_ref, probes=probes,
                                  directive_state=state, optimizers=hooks.optimizers)
        rerun.at_step_start()             # an earlier step's flag landed set: classified now
        ...                               # the step; its forwards kept while a weight guard is effective
        rerun.before_update()             # an optimizer's pre-step (its guard's): the same, else too late
        rerun.at_step_end(n, scaling=scaling, weight_guard_on=hooks.effective)
        rerun.handed_over(data, state)    # the step's values and record, as the report's copy took them
        rerun.close(timeout=10.0)         # a capsule still being written is finished (bounded)
    """

    def __init__(self, config: ForensicsConfig, *, run_id: str, rank: int, device: torch.device, rec: Recorder,
                 model: Callable[[], torch.nn.Module | None], probes: Probes, directive_state: DirectiveState,
                 optimizers: Callable[[], list[torch.optim.Optimizer]] = list,
                 unread_updates: Callable[[], bool] = bool) -> None:
        #: rerun mode: ``MonitorConfig.forensics.rerun`` (None: on), effective while a weight guard is
        self.on = config.rerun is not False
        #: decide a step later, from its flag copied without a host read (an accelerator), rather than at its end
        self.defer = defers(device)
        #: the steps' flags on their way to the host (``defer``)
        self.flags = FlagsInFlight(landed=rerun_flags.landed)
        #: the capsule writer (None: capsules off)
        self.capsules = open_capsules(config, run_id=run_id, rank=rank)
        self._rank, self._rec, self._model = rank, rec, model
        self._probes, self._directive_state = probes, directive_state
        self._optimizers, self._unread_updates = optimizers, unread_updates
        self._unread = False  # an optimizer update the optimizer check did not read ran before this step
        self._step: int | None = None  # the open step
        self._done = False  # the run's first non-finite step was classified: once per run

    def at_step_start(self, step: int | None = None) -> None:
        """A step starts: whether an update the optimizer check did not read ran before it; and (``defer``)
        an earlier step whose flag has landed set is classified now, its incident in this step's report."""
        self._step = step
        self._unread = bool(self._unread_updates())
        if self.defer and not self._done:
            self._decide()

    def before_update(self) -> None:
        """An optimizer's pre-step (``defer``): a flag that has landed set is classified now, while the
        weights are still the faulting step's; the flags still in flight go stale (the update may move them)."""
        if self.defer and not self._done and len(self.flags):
            self._decide()
            self.flags.update_may_run(self._step)

    def at_step_end(self, step: int, *, scaling: Any, weight_guard_on: bool) -> Incident | None:
        """Step ``step`` ends normally (``scaling``: the Monitor's ``LossScaling``, or None): classify it if
        it is the run's first non-finite one and its forwards were kept; with ``defer``, send its flag."""
        if self._done or not self._probes.rerun.keep_inputs:
            return None
        if self.defer:
            self.flags.send(step, self._rec.nonfinite_flag(), kept=list(self._probes.rerun.kept),
                            weight_guard_on=weight_guard_on, unread_updates=self._unread,
                            mode=self._directive_state.mode)
            return None
        if not bool(self._rec.nonfinite_flag()):  # sync-ok: rerun mode on the CPU (free there)
            return None
        # an overflow the scaler handled (it found inf/NaN, and only gradients were non-finite): no incident
        if (scaling is not None and scaling.overflow_found()  # sync-ok: rerun mode, flag set
                and nonfinite_phases(self._rec) <= {"backward"}):
            return None
        self._done = True
        return classify(rec=self._rec, model=self._model(), probes=self._probes,
                        directive_state=self._directive_state, step=step, facts=step_so_far(self._rec),
                        kept=list(self._probes.rerun.kept), weight_guard_on=weight_guard_on, rank=self._rank,
                        capsules=self.capsules, optimizers=self._optimizers(), unread_updates=self._unread)

    def handed_over(self, data: torch.Tensor, state: StepState) -> None:
        """The step just ended was handed to the reporter (``defer``): its values and record stay referenced
        with its flag, for the decode a rerun of it needs."""
        if self.defer:
            self.flags.handed_over(data, state)

    def _decide(self) -> None:
        flag = self.flags.first_set()
        if flag is None or flag.state is None or flag.data is None:
            return
        stats = decode_step(flag.state, flag.data.tolist())  # sync-ok: the incident path, once per run
        if loss_scaling(flag.state) and handled_by_scaler(stats.slot("max", SCALER_FOUND, 0.0) > 0, stats.sites):
            return  # dynamic loss scaling at work: no incident (the scaler skipped the update)
        self._done = True
        self.flags.clear()
        # the path the step ran: a fallback asked for on its own report may be in force by now
        with self._directive_state.forced(flag.mode):
            classify(rec=self._rec, model=self._model(), probes=self._probes,
                     directive_state=self._directive_state, step=flag.step, facts=step_facts(flag.state, stats),
                     kept=flag.kept, weight_guard_on=flag.weight_guard_on, rank=self._rank,
                     capsules=self.capsules, optimizers=self._optimizers(), unread_updates=flag.unread_updates,
                     stale=flag.stale)

    def close(self, timeout: float) -> None:
        """A capsule still being written is finished (bounded wait)."""
        self.flags.clear()
        if self.capsules is not None:
            self.capsules.join(timeout)
