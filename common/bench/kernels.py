"""``nanwatch bench kernels``: what nanwatch adds to a training step on the device, as counts (kernels launched,
bytes read, host syncs) by phase of the step, and what those counts cost on an H100 by a roofline model.

Why counts: on a GPU nanwatch's cost is the kernels it launches and the bytes they read (and any host sync),
not the host Python that a 2-core CPU stopwatch sees; counts do not move with a noisy machine. The step is
``nanwatch bench``'s (:mod:`nanwatch.bench.step`): forward, next-token logprobs, ``mon.rlhf(logprobs=,
old_logprobs=, rollout_logprobs=, mask=)``, backward, fused AdamW ``step()``/``zero_grad()``, with
``nanwatch.attach(model, run_id=..., optimizer=opt)`` at its defaults (weight guard on), against the same step
bare. Phases: ``begin`` (the step opens, up to the first forward), ``forward``, ``rlhf``, ``backward``,
``optimizer``, ``end`` (the step closes). Every op is counted by :class:`nanwatch.bench.dispatch_count.OpCounter`
(its docstring says what a kernel, a byte read and a sync are); nanwatch's extra is attached minus bare, per
phase, and its ops are also split by the nanwatch function that issued them.

**Every cadence.** Each ``*_every`` field of ``MonitorConfig`` above 1 at its default (read at run time) is a
cadence. The small ones (at most 64 steps) are covered by windows of C consecutive steps, C their least
common multiple; each larger one (e.g. ``exact_logit_every``) by one more window that holds one step it fires
on, whose excess over the plain window is weighted by how often that step comes in the full cycle (the least
common multiple of them all). The figure is a mean per step over the whole cycle. Every window runs once
uncounted first (a cadence's first firing allocates its slots: a cost once per run, not per cycle), then
again one cycle later, counted.

**Real shapes without the compute.** On ``--device meta`` (the default) the model is built on the meta device
at the real width, so nothing is computed and nanwatch takes its accelerator branches. Layers are identical,
so 2 and 4 layers are counted and every figure is extrapolated linearly to the real depth. The seams of
:mod:`nanwatch.bench.kernel_seams` make the meta device stand for a GPU; none changes nanwatch's code or what
it launches: autocast is reported off for ``meta`` (torch has no autocast state for it); fused AdamW accepts
``meta`` parameters; and the model's attention runs the flash kernel's meta implementation (a GPU's choice at
these shapes; on meta, torch would take the math path with its fp32 upcast), which nanwatch's backend
prediction is told too. ``--device cpu`` counts on real CPU tensors (the tiny shape only); ``--device cuda``
on real CUDA tensors, at the same counted depths (the 4-layer model of 8B width fits in about 25 GB), with
``torch.cuda.set_sync_debug_mode("warn")`` counting the syncs CUDA itself reports beside the counter's.

**Roofline (H100, bf16).** The bare step's time is its FLOPs (``torch.utils.flop_counter.FlopCounterMode``,
which counts causal attention as full) at 45 % of 989 TFLOP/s; nanwatch's added time is its extra bytes at
85 % of 3.35 TB/s plus 5 us per extra kernel; the modelled ratio is (bare + added) / bare.

Example usage::

    nanwatch bench kernels                       # 1.7B- and 8B-shaped, meta device, a few minutes
    nanwatch bench kernels --shapes tiny --json /tmp/k.json
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, fields

import torch

from nanwatch.bench.dispatch_count import Counts, OpCounter, nanwatch_sources
from nanwatch.bench.kernel_report import format_report, roofline
from nanwatch.bench.kernel_seams import meta_seams

__all__ = ["PHASES", "SHAPES", "Shape", "cadence_plan", "count_shape", "main", "run"]

PHASES = ("begin", "forward", "rlhf", "backward", "optimizer", "end")
_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
_LARGE = 64  # cadences above this many steps get a window of their own


@dataclass(frozen=True, slots=True)
class Shape:
    """A Qwen3-shaped model: its width, its real depth, and the depths counted (extrapolated linearly)."""

    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    seq: int
    tie: bool
    counted: tuple[int, ...] = (2, 4)


SHAPES = {
    "tiny": Shape("tiny", 2, 64, 128, 4, 2, 16, 128, 64, False, counted=(2,)),  # the tests' TINY_QWEN3
    "1.7b": Shape("1.7b", 28, 2048, 6144, 16, 8, 128, 151936, 4096, True),
    "8b": Shape("8b", 36, 4096, 12288, 32, 8, 128, 151936, 4096, False),
}


def cadence_plan(config=None) -> dict:
    """The windows that cover every cadence of ``config`` (default: ``MonitorConfig``'s defaults):
    ``{"cadences", "window", "cycle", "windows": [(first_step, weight_per_step, label)]}``. The mean per step
    is ``sum(weight * window_total)`` over the windows (the plain window's weight makes the per-step mean of
    its C steps; each event window adds its excess over the plain one at its frequency in the cycle)."""
    from nanwatch.hooks import MonitorConfig
    from nanwatch.hooks.config import FLAT_OPTIONS

    config = config or MonitorConfig(run_id="kernels")
    cad = {name: config.option(name) for name in FLAT_OPTIONS if name.endswith("_every")}
    weights = config.weights  # optimizer_check_every None: resolved by the device; the modelled
    if weights.optimizer_check and weights.optimizer_check_every is None:
        from nanwatch.hooks.remedies.step_remedies import ACCELERATOR_CHECK_EVERY  # accelerator's cadence

        cad["optimizer_check_every"] = ACCELERATOR_CHECK_EVERY
    cad = {k: v for k, v in cad.items() if isinstance(v, int) and not isinstance(v, bool) and v > 1}
    small = [v for v in cad.values() if v <= _LARGE]
    large = sorted({v for v in cad.values() if v > _LARGE})
    window = math.lcm(*small) if small else 1
    cycle = math.lcm(window, *large)
    if cycle > 10**9:
        raise ValueError(f"the cadences {cad} make a cycle of {cycle} steps: too long to average over")

    def pattern(n: int) -> frozenset[int]:
        return frozenset(g for g in large if n % g == 0)

    # how many steps of the cycle fire exactly the large cadences S (inclusion-exclusion over supersets)
    patterns: dict[frozenset[int], int] = {}
    subsets = [frozenset(g for i, g in enumerate(large) if m >> i & 1) for m in range(1, 1 << len(large))]
    for s in subsets:
        patterns[s] = sum((-1) ** (len(t) - len(s)) * (cycle // math.lcm(*t)) for t in subsets if t >= s)
    first = window + 1  # after a warm-up window of steps 1..C
    windows = [(first, 1.0 / window, "plain")]
    at = first + window
    for s, count in sorted(patterns.items(), key=lambda kv: math.lcm(*kv[0])):
        if count <= 0:
            continue
        step = math.lcm(*s)
        while step - window // 2 + 1 < at or pattern(step) != s or any(
                pattern(n) for n in range(step - window // 2 + 1, step + window - window // 2 + 1) if n != step):
            step += math.lcm(*s)
        start = step - window // 2 + 1
        label = "+".join(f"{k}={v}" for k, v in cad.items() if v in s)
        windows.append((start, count / cycle, label))
        windows[0] = (first, windows[0][1] - count / cycle, "plain")
        at = start + window
    return {"cadences": cad, "window": window, "cycle": cycle, "windows": windows}


def _build(shape: Shape, layers: int, device: str, dtype: torch.dtype):
    from nanwatch.bench.tiny_models import tiny_qwen3

    with torch.device(device):
        model = tiny_qwen3(
            "sdpa", vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
            num_hidden_layers=layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
            head_dim=shape.head_dim, max_position_embeddings=shape.seq, use_cache=False,
            tie_word_embeddings=shape.tie).to(dtype).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=True)
    ids = torch.randint(0, shape.vocab, (1, shape.seq), generator=torch.Generator().manual_seed(0)).to(device)
    return model, opt, ids


class _BareStep:
    """The bare step's ``mon``: its ``step`` does nothing, its ``rlhf`` takes the arguments and does nothing
    (so the feed's own op, the rollout logprobs' sum, is counted in both steps)."""

    def step(self, n: int) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def rlhf(self, **kwargs) -> None:
        pass


def _step(counter: OpCounter, mon, model, opt, ids, feed, n: int) -> None:
    from nanwatch.bench.step import next_token_logprobs

    counter.phase = "begin"
    window = mon.step(n)
    window.__enter__()
    try:
        counter.phase = "forward"
        lp = next_token_logprobs(model, ids)
        counter.phase = "rlhf"
        feed(mon, lp)
        counter.phase = "backward"
        (-lp.mean()).backward()
        counter.phase = "optimizer"
        opt.step()
        opt.zero_grad(set_to_none=True)
        counter.phase = "end"
    finally:
        window.__exit__(None, None, None)


def _steps(device: str, mon, model, opt, ids, feed, numbers, *, attribute: bool, flops: bool = False):
    """Run the steps ``numbers`` under one counter; returns it (and the FLOPs, when asked)."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = OpCounter(device=device, nanwatch_dirs=nanwatch_sources() if attribute else None)
    flop_mode = FlopCounterMode(display=False) if flops else contextlib.nullcontext()
    with _cuda_sync_debug(device, counter), flop_mode, counter:
        for n in numbers:
            _step(counter, mon, model, opt, ids, feed, n)
    return counter, (flop_mode.get_total_flops() if flops else None)


@contextlib.contextmanager
def _cuda_sync_debug(device: str, counter: OpCounter) -> Iterator[None]:
    """On CUDA: ``set_sync_debug_mode("warn")`` and its warnings counted by phase (``counter.cuda_syncs``)."""
    if torch.device(device).type != "cuda":
        yield
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.synchronize()
        counter.watch_cuda(caught)
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(0)


def count_shape(shape: Shape, layers: int, *, device: str = "meta", dtype: torch.dtype = torch.bfloat16,
                options: dict | None = None, plan: dict | None = None) -> dict:
    """Per-step counts of ``shape`` at ``layers`` on ``device``: bare and attached (at the defaults plus
    ``options``), by phase, nanwatch's ops by function, and the bare step's FLOPs."""
    import nanwatch
    from nanwatch.bench.step import rlhf_feed
    from nanwatch.hooks import MonitorConfig

    plan = plan or cadence_plan(MonitorConfig.from_options(run_id="kernels", **(options or {})))
    with meta_seams(device):
        model, opt, ids = _build(shape, layers, device, dtype)
        feed = rlhf_feed(1, shape.seq, device, mask=True)
        bare_mon = _BareStep()
        _steps(device, bare_mon, model, opt, ids, feed, (1, 2), attribute=False)  # AdamW's state, warm caches
        bare, flops = _steps(device, bare_mon, model, opt, ids, feed, (3,), attribute=False, flops=True)
        mon = nanwatch.attach(model, run_id="kernels", optimizer=opt, **(options or {}))
        try:
            c, cycle = plan["window"], plan["cycle"]
            # warm-up: a window of plain steps, then every window once (a cadence's first firing allocates its
            # slots); then the same windows one cycle later, counted: the same step numbers modulo each cadence
            _steps(device, mon, model, opt, ids, feed, range(1, c + 1), attribute=False)
            for first, _, _ in plan["windows"]:
                _steps(device, mon, model, opt, ids, feed, range(first, first + c), attribute=False)
            phases = {p: Counts() for p in PHASES}
            by_fn: dict[str, Counts] = {}
            cuda_syncs = None if bare.cuda_syncs is None else {p: 0.0 for p in PHASES}
            for first, weight, _ in plan["windows"]:
                counter, _ = _steps(device, mon, model, opt, ids, feed, range(first + cycle, first + cycle + c),
                                    attribute=True)
                for p in PHASES:
                    phases[p].add(counter.totals.get(p, Counts()), weight)
                for k, v in counter.by_function.items():
                    by_fn.setdefault(k, Counts()).add(v, weight)
                for p, v in (counter.cuda_syncs or {}).items():
                    cuda_syncs[p] += v * weight
        finally:
            mon.close()
    return {"bare": {p: bare.totals.get(p, Counts()) for p in PHASES}, "attached": phases, "by_function": by_fn,
            "flops": flops, "bare_sync_sites": bare.sync_sites,
            "cuda_sync_warnings": None if cuda_syncs is None else {"bare": bare.cuda_syncs, "attached": cuda_syncs}}


def _extrapolate(runs: dict[int, dict], layers: int) -> dict:
    """Linear in depth from the counted depths (one depth: as counted)."""
    ds = sorted(runs)
    lo, hi = runs[ds[0]], runs[ds[-1]]
    f = 0.0 if len(ds) == 1 else (layers - ds[0]) / (ds[-1] - ds[0])

    def lin(a: float, b: float) -> float:
        return a + (b - a) * f

    def counts(a: Counts, b: Counts) -> Counts:
        return Counts(lin(a.kernels, b.kernels), lin(a.bytes, b.bytes), lin(a.syncs, b.syncs), lin(a.h2d, b.h2d))

    out = {k: {p: counts(lo[k][p], hi[k][p]) for p in PHASES} for k in ("bare", "attached")}
    out["extra"] = {p: out["attached"][p].minus(out["bare"][p]) for p in PHASES}
    out["by_function"] = {k: counts(lo["by_function"].get(k, Counts()), hi["by_function"].get(k, Counts()))
                          for k in set(lo["by_function"]) | set(hi["by_function"])}
    out["flops"] = lin(lo["flops"], hi["flops"])
    out["bare_sync_sites"] = hi["bare_sync_sites"]
    out["cuda_sync_warnings"] = hi["cuda_sync_warnings"]  # as counted at the deepest depth
    return out


def run(shapes: Sequence[str], *, device: str = "meta", dtype: str = "bf16", options: dict | None = None,
        log: Callable[[str], None] = print) -> dict:
    """Count every shape in ``shapes`` on ``device`` in ``dtype`` (bf16 or fp32), nanwatch attached with
    ``options`` (flat option names, as ``nanwatch.attach`` takes them) over its defaults; the results (see
    ``--json``)."""
    from nanwatch.hooks import MonitorConfig

    plan = cadence_plan(MonitorConfig.from_options(run_id="kernels", **(options or {})))  # what is attached
    threads = torch.get_num_threads()
    if device != "cuda":
        torch.set_num_threads(1)  # counts do not depend on threads; on a shared CPU one thread is fastest
    try:
        return _run(shapes, plan, device=device, dtype=_DTYPES[dtype], options=options, log=log)
    finally:
        torch.set_num_threads(threads)


def _run(shapes, plan, *, device, dtype, options, log) -> dict:
    log(f"nanwatch bench kernels: {device}, {dtype}, options {options or 'none'}; cadences {plan['cadences']}: windows of {plan['window']} steps, "
        f"cycle {plan['cycle']} steps ({len(plan['windows'])} windows, each run once to warm up and once counted)")
    results = {"device": device, "dtype": str(dtype).removeprefix("torch."), "options": options or {},
               "torch": torch.__version__, "plan": {**plan, "windows": [list(w) for w in
               plan["windows"]]}, "shapes": {}}
    for name in shapes:
        shape = SHAPES[name]
        runs = {n: count_shape(shape, n, device=device, dtype=dtype, options=options, plan=plan)
                for n in shape.counted}
        r = _extrapolate(runs, shape.layers)
        r["shape"] = {f.name: getattr(shape, f.name) for f in fields(shape)}
        r["roofline"] = roofline(r)
        results["shapes"][name] = r
    return results


def _jsonable(results: dict) -> dict:
    def conv(x):
        if isinstance(x, Counts):
            return x.as_dict()
        if isinstance(x, dict):
            return {str(k): conv(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [conv(v) for v in x]
        return x

    return conv(results)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nanwatch bench kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="1.7b,8b", help=f"comma-separated, of {list(SHAPES)} (default 1.7b,8b)")
    p.add_argument("--device", default="meta", choices=["meta", "cpu", "cuda"],
                   help="meta (default): real shapes, nothing computed; cpu: real tensors, tiny only; cuda: real")
    p.add_argument("--dtype", default="auto", choices=["auto", *_DTYPES],
                   help="auto (default): bf16, except on a CPU without bf16 units (then fp32; nanwatch bench's choice)")
    p.add_argument("--config", action="append", default=[], metavar="FIELD=VALUE",
                   help="an attach() option over the defaults (repeatable), e.g. --config exact_logit_every=0")
    p.add_argument("--json", dest="json_path", metavar="PATH", help="also write the results as JSON here")
    return p


def _options(pairs: list[str]) -> dict:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"--config {pair!r}: expected FIELD=VALUE")
        try:
            out[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            out[key.strip()] = value.strip()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(argv) if argv is not None else None)
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown or not shapes:
        print(f"nanwatch bench kernels: unknown shapes {unknown}; choose from {list(SHAPES)}")
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("nanwatch bench kernels: --device cuda, but torch.cuda.is_available() is False")
        return 2
    if args.device == "cpu" and any(s != "tiny" for s in shapes):
        print("nanwatch bench kernels: --device cpu computes for real: only --shapes tiny (use meta for the rest)")
        return 2
    dtype = args.dtype
    if dtype == "auto":
        from nanwatch.bench.step import choose_dtype

        dtype = "bf16" if args.device == "meta" else choose_dtype(args.device)[0]
    try:
        options = _options(args.config)
        from nanwatch.hooks import MonitorConfig

        MonitorConfig.from_options(run_id="kernels", **options)
    except (ValueError, TypeError) as exc:
        print(f"nanwatch bench kernels: {exc}")
        return 2
    results = _jsonable(run(shapes, device=args.device, dtype=dtype, options=options))
    print(format_report(results))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
