"""``nanwatch bench``: what nanwatch costs a training step, side by side with the alternatives.

One process, one model, one optimizer; variants of the same step, interleaved round-robin so that
drift (thermal, allocator, other load) hits every variant alike:

* ``bare``: forward, the next-token logprobs from the logits (``log_softmax`` and ``gather``; the loss is
  their negative mean, the work of HF's own loss), backward, AdamW step;
* ``aminmax_floor``: plain hooks doing one ``aminmax`` of every tensor nanwatch reads, where it reads
  it, and nothing else (``nanwatch.bench.floor``): the floor;
* ``nanwatch``: the same inside ``with mon.step(n):`` with ``nanwatch.attach(model, run_id="bench")``
  at its defaults, and ``mon.rlhf(logprobs=, old_logprobs=, rollout_logprobs=)`` on the step's logprobs (the
  RLHF and rollout statistics counted in; the spike baseline runs at its defaults). Step numbers keep counting
  across rounds, so the exact-logit sampling and the parameter sweep happen at their real rates;
* ``nanwatch_guard``: the same with the weight guard on the optimizer (``attach(..., optimizer=opt)``; the
  optimizer is a fused AdamW in every variant, so the guard's cost is the only difference);
* ``debug_underflow_overflow``: transformers' ``DebugUnderflowOverflow(model)`` (a fresh one per
  round; it keeps no handles, so its hooks are removed from the modules' hook dicts afterwards);
* ``detect_anomaly``: ``torch.autograd.detect_anomaly()`` around forward+backward.

The dtype is ``auto`` unless ``--dtype`` says otherwise (:func:`choose_dtype`, printed on the first line): bf16
on CUDA and on a CPU with bf16 units, else fp32, so that the default run finishes in minutes on any CPU.

Per-step times are reported as a ratio to bare and as added milliseconds; a round's figure is the mean of
its steps (a step that reads more than the others, the exact-logit or the sweep's, counts at its rate, which a
median would hide). The numbers that
matter are nanwatch's added time against DebugUnderflowOverflow's, and against the floor's: one read of
each monitored tensor and gradient of a step, timed in the same rounds (the least any monitor that reads
each of them once can cost). Added times are paired: the median over rounds of each round's difference
to the bare round beside it. transformers is imported lazily:
``nanwatch.hooks`` itself never needs it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

import torch

from nanwatch.bench.floor import Floor

__all__ = ["SDPA_BACKENDS", "BenchConfig", "VARIANTS", "build", "choose_dtype", "main", "next_token_logprobs",
           "rlhf_feed", "run", "sdpa_context"]

VARIANTS = ("bare", "aminmax_floor", "nanwatch", "nanwatch_guard", "debug_underflow_overflow", "detect_anomaly")
#: ``--sdpa-backend``: the name -> ``torch.nn.attention.SDPBackend`` member (None: torch's own choice)
SDPA_BACKENDS = {"default": None, "math": "MATH", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                 "cudnn": "CUDNN_ATTENTION"}
_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
           "float16": torch.float16, "fp32": torch.float32, "float32": torch.float32}


@dataclass(kw_only=True, slots=True)
class BenchConfig:
    """One benchmark run: the model shape, the batch, and how many steps each variant gets."""

    device: str = "cpu"
    """``cpu`` or ``cuda`` (on CUDA every timed step is bracketed by ``torch.cuda.synchronize()``)."""

    dtype: str = "auto"
    """Parameter and activation dtype: bf16, fp16 or fp32; ``auto`` (the default) is resolved at construction
    by :func:`choose_dtype` to what the device runs natively (bf16 on CUDA and on a CPU with bf16 units, else
    fp32), the reason kept in ``dtype_choice``."""

    dtype_choice: str | None = None
    """Why ``auto`` chose the dtype it did (set at construction; None when the dtype was given)."""

    layers: int = 4
    """Decoder layers of the tiny Qwen3."""

    batch: int = 4
    """Sequences per step."""

    seq: int = 256
    """Tokens per sequence."""

    hidden: int = 256
    """Hidden size; heads x head_dim need not equal it (Qwen3 projects)."""

    heads: int = 8
    """Query heads."""

    kv_heads: int = 4
    """Key/value heads (grouped-query attention)."""

    head_dim: int = 32
    """Per-head width."""

    intermediate: int = 768
    """MLP width."""

    vocab: int = 4096
    """Vocabulary size (the lm_head output is batch x seq x vocab)."""

    steps: int = 8
    """Timed steps per variant per round."""

    repeats: int = 6
    """Rounds; every round runs every variant once, in a rotated order."""

    warmup: int = 2
    """Untimed steps per variant before the first round."""

    threads: int | None = 2
    """``torch.set_num_threads`` for the run (None: leave torch's default)."""

    variants: tuple[str, ...] = VARIANTS
    """Which variants to run; ``bare`` is always included (everything is relative to it)."""

    sdpa_backend: str = "default"
    """The attention kernel every variant's step runs on: ``default`` (torch picks), or ``math``, ``flash``,
    ``efficient``, ``cudnn`` (each step under ``torch.nn.attention.sdpa_kernel`` of that one backend). A
    backend that cannot run this step (this device, dtype or shape) is reported as unavailable, not a crash:
    on a CPU ``flash`` runs torch's CPU flash kernel; ``efficient`` and ``cudnn`` have no CPU kernel."""

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' was asked for but torch.cuda.is_available() is False")
        if self.dtype == "auto":
            self.dtype, self.dtype_choice = choose_dtype(self.device)
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)} or 'auto', got {self.dtype!r}")
        for name in ("layers", "batch", "seq", "hidden", "heads", "kv_heads", "head_dim", "intermediate",
                     "vocab", "steps", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {self.warmup}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")
        unknown = [v for v in self.variants if v not in VARIANTS]
        if unknown:
            raise ValueError(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
        self.variants = ("bare",) + tuple(v for v in VARIANTS[1:] if v in self.variants)
        if self.sdpa_backend not in SDPA_BACKENDS:
            raise ValueError(f"sdpa_backend must be one of {list(SDPA_BACKENDS)}, got {self.sdpa_backend!r}")


def _cpu_flags() -> str:
    """The ``flags`` line of ``/proc/cpuinfo`` ("" where there is none: not Linux, or unreadable)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1] for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def choose_dtype(device: str, *, cpu_flags: str | None = None, capability: str | None = None) -> tuple[str, str]:
    """``--dtype auto``: the dtype ``device`` runs natively, and why (one line). On CUDA bf16. On a CPU bf16
    only where it has bf16 units (``avx512_bf16`` or ``amx_bf16`` among ``cpu_flags``, default the flags of
    ``/proc/cpuinfo``) and torch runs its AVX-512 kernels (``capability``, default
    ``torch.backends.cpu.get_cpu_capability()``; ``ATEN_CPU_CAPABILITY=avx2`` turns them off), else fp32:
    without them bf16 is emulated (measured on an AVX2-only AMD EPYC: a bare step of the bench model took
    9.5 s in bf16 against 0.3 s in fp32, and a default run never finished)."""
    if device == "cuda":
        return "bf16", "auto: bf16 on CUDA"
    flags = set((_cpu_flags() if cpu_flags is None else cpu_flags).split())
    units = [f for f in ("avx512_bf16", "amx_bf16") if f in flags]
    cap = torch.backends.cpu.get_cpu_capability() if capability is None else capability
    if units and cap.upper().startswith("AVX512"):
        return "bf16", f"auto: bf16, this CPU has bf16 units ({', '.join(units)}) and torch uses them ({cap})"
    why = (f"its bf16 units ({', '.join(units)}) are unused by torch's {cap} kernels" if units
           else "this CPU has no bf16 units (no avx512_bf16 or amx_bf16 flag)")
    return "fp32", f"auto: fp32, {why}: bf16 would be emulated, ~30x slower a step; --dtype bf16 to run it anyway"


@dataclass(slots=True)
class _Variant:
    name: str
    round_: Callable[[], contextlib.AbstractContextManager]  # set up / tear down around one round
    step: Callable[[int], contextlib.AbstractContextManager]  # around forward+backward (+opt step)
    rlhf: Callable[[torch.Tensor], None] = lambda lp: None  # inside the step, given the step's logprobs
    times_ms: list[float] = field(default_factory=list)
    round_means_ms: list[float] = field(default_factory=list)  # one per round, paired with bare's


def lm_step(mon, model: torch.nn.Module, opt: torch.optim.Optimizer, ids: torch.Tensor) -> Callable[[int], None]:
    """``step(n)``: one monitored training step of a causal LM on ``ids`` (the benches' unit of work)."""

    def step(n: int) -> None:
        with mon.step(n):
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()

    return step


def build(cfg: BenchConfig):
    """The model of ``cfg`` (a tiny Qwen3, sdpa), its fused AdamW and a batch of token ids."""
    from nanwatch.bench.tiny_models import tiny_qwen3

    model = tiny_qwen3(
        "sdpa", vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim, max_position_embeddings=max(cfg.seq, 64), use_cache=False,
    ).to(device=cfg.device, dtype=_DTYPES[cfg.dtype]).train()
    # A tiny learning rate keeps the weights (and so the work per step) steady across variants.
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)  # fused: the weight guard is free
    ids = torch.randint(0, cfg.vocab, (cfg.batch, cfg.seq), generator=torch.Generator().manual_seed(0))
    return model, opt, ids.to(cfg.device)


def _remove_debug_hooks(model: torch.nn.Module, debugger) -> int:
    """DebugUnderflowOverflow registers ``forward_hook`` on every module and keeps no handle."""
    removed = 0
    for module in model.modules():
        for hid, hook in list(module._forward_hooks.items()):
            if hook == debugger.forward_hook:
                del module._forward_hooks[hid]
                module._forward_hooks_with_kwargs.pop(hid, None)
                module._forward_hooks_always_called.pop(hid, None)
                removed += 1
    return removed


def _variants(cfg: BenchConfig, model: torch.nn.Module, opt: torch.optim.Optimizer, floor: Floor) -> list[_Variant]:
    null = contextlib.nullcontext
    state: dict = {}

    @contextlib.contextmanager
    def nanwatch_round(guard: bool = False) -> Iterator[None]:
        from nanwatch import attach

        mon = attach(model, run_id="bench", optimizer=opt if guard else None)
        state["mon"] = mon
        try:
            yield
        finally:
            mon.last_report()  # drain the reporter thread outside the timed steps
            mon.close()
            state.pop("mon", None)

    counter = iter(range(1 << 62))

    def nanwatch_step(_: int):
        return state["mon"].step(next(counter))

    feed = rlhf_feed(cfg.batch, cfg.seq, cfg.device)

    def nanwatch_rlhf(lp: torch.Tensor) -> None:
        feed(state["mon"], lp)

    @contextlib.contextmanager
    def debug_round() -> Iterator[None]:
        from transformers.debug_utils import DebugUnderflowOverflow

        dbg = DebugUnderflowOverflow(model)
        try:
            yield
        finally:
            if _remove_debug_hooks(model, dbg) == 0:
                raise RuntimeError("bench: could not find DebugUnderflowOverflow's hooks to remove")

    @contextlib.contextmanager
    def anomaly_step(_: int) -> Iterator[None]:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "Anomaly Detection has been enabled..." on every enter
            with torch.autograd.detect_anomaly():
                yield

    table = {
        "bare": _Variant("bare", null, lambda n: null()),
        "aminmax_floor": _Variant("aminmax_floor", floor.round, floor.step),
        "nanwatch": _Variant("nanwatch", nanwatch_round, nanwatch_step, nanwatch_rlhf),
        "nanwatch_guard": _Variant("nanwatch_guard", lambda: nanwatch_round(guard=True), nanwatch_step,
                                   nanwatch_rlhf),
        "debug_underflow_overflow": _Variant("debug_underflow_overflow", debug_round, lambda n: null()),
        "detect_anomaly": _Variant("detect_anomaly", null, anomaly_step),
    }
    return [table[name] for name in cfg.variants]


def next_token_logprobs(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The forward and the logprob of each next token (``log_softmax`` and ``gather``: the work of HF's own
    loss, whose negative mean the benches' step backpropagates), ``[B, S - 1]`` float32."""
    logits = model(input_ids=ids, use_cache=False).logits
    return logits[:, :-1].float().log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def rlhf_feed(batch: int, seq: int, device: str, *, mask: bool = False) -> Callable[[object, torch.Tensor], None]:
    """``feed(mon, lp)``: ``mon.rlhf`` on a step's logprobs as an RLHF trainer calls it, the old logprobs
    ``lp`` itself and the sampler's ``lp`` plus noise of ~1e-4: under the mismatch's drift floor (1e-3), the
    clean steady state, no rollout event (and no attribution) in any round. ``mask``: also a completion mask
    (bool, the first quarter of each sequence, the prompt, masked out), built once, before the steps."""
    g = torch.Generator().manual_seed(1)
    noise = (1e-4 * torch.randn(batch, seq - 1, generator=g)).to(device)
    completion = None
    if mask:
        completion = torch.ones(batch, seq - 1, dtype=torch.bool)
        completion[:, : (seq - 1) // 4] = False
        completion = completion.to(device)

    def feed(mon, lp: torch.Tensor) -> None:
        old = lp.detach()
        mon.rlhf(logprobs=lp, old_logprobs=old, rollout_logprobs=old + noise, mask=completion)

    return feed


def sdpa_context(name: str) -> contextlib.AbstractContextManager:
    """``sdpa_kernel`` of the one backend ``name`` names (``default``: no restriction)."""
    member = SDPA_BACKENDS[name]
    if member is None:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel(getattr(SDPBackend, member))


def unavailable(cfg: BenchConfig, model, opt, ids) -> str | None:
    """Why this step cannot run on ``cfg.sdpa_backend`` (one untimed bare step under it), or None."""
    if cfg.sdpa_backend == "default":
        return None
    try:
        with sdpa_context(cfg.sdpa_backend):
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    except RuntimeError as exc:  # "No available kernel. Aborting execution." and the reasons torch warned
        return f"sdpa backend {cfg.sdpa_backend!r} cannot run this step on {cfg.device}: {str(exc).splitlines()[0]}"
    finally:
        opt.zero_grad(set_to_none=True)
    return None


def _timed_steps(cfg: BenchConfig, model, opt, ids, variant: _Variant, n: int, *, record: bool) -> None:
    sync = torch.cuda.synchronize if cfg.device == "cuda" else (lambda: None)
    times: list[float] = []
    with variant.round_():
        for i in range(n):
            opt.zero_grad(set_to_none=True)
            sync()
            t0 = time.perf_counter()
            with sdpa_context(cfg.sdpa_backend), variant.step(i):
                lp = next_token_logprobs(model, ids)
                variant.rlhf(lp)
                (-lp.mean()).backward()
                opt.step()  # inside the step: the weight guard reads this step's flag
            sync()
            times.append((time.perf_counter() - t0) * 1e3)
    if record:
        variant.times_ms.extend(times)
        variant.round_means_ms.append(statistics.fmean(times))


def run(cfg: BenchConfig, *, log: Callable[[str], None] = print) -> dict:
    """Run the benchmark; returns the results as a JSON-ready dict (with ``unavailable``, the reason, and no
    variants when ``cfg.sdpa_backend`` cannot run this step)."""
    prev_threads = torch.get_num_threads()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    try:
        model, opt, ids = build(cfg)
        why = unavailable(cfg, model, opt, ids)
        if why is not None:
            log(f"nanwatch bench: {why}")
            return {"config": asdict(cfg), "machine": _machine(cfg), "params": sum(p.numel() for p in model.parameters()),
                    "unavailable": why, "variants": {}}
        floor = Floor(model, optimizer=opt)
        variants = _variants(cfg, model, opt, floor)
        log(_describe(cfg, model))
        for v in variants:
            _timed_steps(cfg, model, opt, ids, v, cfg.warmup, record=False)
        floor.step_ms.clear()
        floor.step_reads.clear()
        for r in range(cfg.repeats):
            k = r % len(variants)  # rotate which variant goes first
            for v in variants[k:] + variants[:k]:
                _timed_steps(cfg, model, opt, ids, v, cfg.steps, record=True)
    finally:
        torch.set_num_threads(prev_threads)
    return _results(cfg, model, variants, floor.summary() if "aminmax_floor" in cfg.variants else None)


def _describe(cfg: BenchConfig, model: torch.nn.Module) -> str:
    params = sum(p.numel() for p in model.parameters())
    return (f"nanwatch bench: tiny Qwen3 (sdpa) {cfg.layers} layers, hidden {cfg.hidden}, {cfg.heads} heads / "
            f"{cfg.kv_heads} kv heads x head_dim {cfg.head_dim}, intermediate {cfg.intermediate}, vocab "
            f"{cfg.vocab}, {params / 1e6:.2f}M params; batch {cfg.batch} x {cfg.seq} tokens, {cfg.dtype}, "
            f"AdamW; attention on {cfg.sdpa_backend} sdpa; {cfg.device}, torch threads {torch.get_num_threads()}; {cfg.repeats} rounds x "
            f"{cfg.steps} steps per variant (+{cfg.warmup} warmup)")


def _results(cfg: BenchConfig, model: torch.nn.Module, variants: list[_Variant], floor: dict | None) -> dict:
    med = {v.name: statistics.median(v.times_ms) for v in variants}
    bare = med["bare"]
    best = {v.name: min(v.times_ms) for v in variants}
    # Paired: each round of a variant runs next to a round of bare, so the ratio of the two round means
    # cancels the slow drifts of a shared machine; the median over rounds is the steadiest figure.
    bare_rounds = next(v.round_means_ms for v in variants if v.name == "bare")
    paired = {v.name: statistics.median(a / b for a, b in zip(v.round_means_ms, bare_rounds, strict=True))
              for v in variants}
    # added time, paired the same way: the median over rounds of each round's difference to bare
    paired_added = {v.name: statistics.median(a - b for a, b in zip(v.round_means_ms, bare_rounds, strict=True))
                    for v in variants}
    rows = {v.name: {"median_ms": med[v.name], "ratio": med[v.name] / bare, "added_ms": med[v.name] - bare,
                     "paired_ratio": paired[v.name], "paired_added_ms": paired_added[v.name],
                     "ratio_of_min": best[v.name] / best["bare"], "min_ms": best[v.name], "max_ms": max(v.times_ms), "n": len(v.times_ms),
                     "times_ms": v.times_ms} for v in variants}
    key = None
    if "nanwatch" in rows and "debug_underflow_overflow" in rows:
        dbg_added = rows["debug_underflow_overflow"]["paired_added_ms"]
        key = rows["nanwatch"]["paired_added_ms"] / dbg_added if dbg_added > 0 else None
    vs_floor = None
    if "nanwatch" in rows and floor is not None and floor["ms"] > 0:
        vs_floor = rows["nanwatch"]["paired_added_ms"] / floor["ms"]
    return {
        "config": asdict(cfg),
        "machine": _machine(cfg),
        "params": sum(p.numel() for p in model.parameters()),
        "variants": rows,
        "nanwatch_added_vs_debug_added": key,
        "floor": floor,
        "nanwatch_added_vs_floor": vs_floor,
    }


def _machine(cfg: BenchConfig) -> dict:
    return {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "torch": torch.__version__, "cuda_device": torch.cuda.get_device_name() if cfg.device == "cuda" else None}


def format_table(results: dict) -> str:
    # min-based ratios are shown too: on a shared box, load from other processes inflates some steps
    lines = [f"{'variant':<26} {'median ms':>10} {'x bare':>7} {'x paired':>9} {'added ms':>9} {'paired +ms':>10} "
             f"{'min ms':>8} {'x bare(min)':>11} {'max ms':>8} {'n':>4}"]
    for name, row in results["variants"].items():
        lines.append(f"{name:<26} {row['median_ms']:>10.1f} {row['ratio']:>7.3f} {row['paired_ratio']:>9.3f} "
                     f"{row['added_ms']:>+9.1f} {row['paired_added_ms']:>+10.2f} {row['min_ms']:>8.1f} "
                     f"{row['ratio_of_min']:>11.3f} {row['max_ms']:>8.1f} {row['n']:>4}")
    key = results["nanwatch_added_vs_debug_added"]
    if key is not None:
        inv = f" (DebugUnderflowOverflow adds {1 / key:.1f}x more)" if key > 0 else ""
        lines.append(f"nanwatch added time / DebugUnderflowOverflow added time (paired) = {key:.3f}{inv}")
    floor = results["floor"]
    if floor is not None:
        vs = results["nanwatch_added_vs_floor"]
        lines.append(f"floor: one aminmax of each of the {floor['reads']:.1f} tensors a step reads (mean), where "
                     f"nanwatch reads them = {floor['ms']:.2f} ms a step (mean of {floor['steps']}; "
                     f"{100 * floor['ms'] / results['variants']['bare']['median_ms']:.2f} % of bare)"
                     + (f"; nanwatch added time (paired) = {vs:.2f}x the floor" if vs is not None else ""))
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    d = BenchConfig()
    p = argparse.ArgumentParser(prog="nanwatch bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=d.device, choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="auto", choices=["auto", *sorted(_DTYPES)],
                   help="auto (default): bf16 on CUDA and on a CPU with bf16 units, else fp32")
    for name in ("layers", "batch", "seq", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab",
                 "steps", "repeats", "warmup"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name), dest=name)
    p.add_argument("--threads", type=int, default=d.threads, help="torch.set_num_threads (0: leave as is)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset (bare always runs)")
    p.add_argument("--sdpa-backend", default=d.sdpa_backend, choices=list(SDPA_BACKENDS), dest="sdpa_backend",
                   help="run every step on this attention kernel (exit 4 when it cannot run this step)")
    p.add_argument("--json", dest="json_path", metavar="PATH", help="also write the results as JSON here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    opts = {k: v for k, v in vars(args).items() if k not in ("json_path", "variants", "threads")}
    try:
        cfg = BenchConfig(**opts, threads=args.threads or None,
                          variants=tuple(v.strip() for v in args.variants.split(",") if v.strip()))
    except ValueError as exc:
        print(f"nanwatch bench: {exc}")
        return 2
    print(f"nanwatch bench: dtype {cfg.dtype}" + (f" ({cfg.dtype_choice})" if cfg.dtype_choice else " (--dtype)"))
    results = run(cfg)
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(results, f, indent=2)
    if "unavailable" in results:
        return 4
    print(format_table(results))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
