"""``nanwatch bench profile``: where nanwatch's added time per step goes, component by component.

One process, one model (the tiny Qwen3 of issue #30: 4 layers, hidden 256, 8 query / 4 key-value heads of
32, batch 4 x 256 tokens, sdpa), one fused AdamW; each step is forward, the next-token logprobs from the
logits (``log_softmax`` and ``gather``, the loss is their negative mean: the work of HF's own loss),
backward and the optimizer step. Arms, interleaved round-robin (the order rotating each round), each a
fresh ``nanwatch.attach(model, optimizer=opt, ...)`` per round:

* ``bare``: no nanwatch;
* ``defaults``: nanwatch at its defaults, the weight guard on the optimizer, and ``mon.rlhf(logprobs=,
  old_logprobs=, rollout_logprobs=)`` on the step's logprobs (the rollout statistics counted in);
* one arm per component with only that component turned off (:data:`COMPONENTS`): the component's cost is
  ``defaults`` minus that arm, paired per round (the median over rounds of each round's difference);
* ``exact_logit_every_step``: ``exact_logit_every=1``, so that the exact attention-logit computation, which
  the defaults run one step in 100, is measured per step it runs (it minus ``defaults``) and amortised.

Also measured in every nanwatch arm: the reporter thread's CPU time per report (its own CPU clock,
``time.pthread_getcpuclockid``; on a machine with few cores it takes CPU from torch's threads) and the
training thread's host time in ``Monitor.end_step``, of which the slot buffer copy (``Reporter.capture``,
and on CUDA its event).
Reported per dtype: component -> added ms and % of the bare step. Nothing here is asserted about speed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from nanwatch.bench import host_timers
from nanwatch.bench.step import BenchConfig, build, next_token_logprobs, rlhf_feed

__all__ = ["COMPONENTS", "ProfileConfig", "main", "run"]

#: component arm -> (MonitorConfig fields that turn only it off, what turning it off removes)
COMPONENTS: dict[str, tuple[dict[str, Any], str]] = {
    "coarse_off": ({"coarse": False}, "coarse=False: the block and block-part sites (decoder blocks, attention "
                   "and MLP outputs, norms, embeddings), forward and backward; attention sites and logits stay"),
    "grads_off": ({"grads": False}, "grads=False: every site's backward read (the gradient into it)"),
    "logits_off": ({"logits": False}, "logits=False: the lm_head output's read, forward and backward"),
    "param_sweep_on": ({"param_check_every": 8}, "param_check_every=8 (a negative row: it adds work; off by "
                       "default since #35): the rotating parameter and optimizer-state sweep, 1/8 of them at "
                       "each step start"),
    "optimizer_check_off": ({"optimizer_check": False}, "optimizer_check=False: the post-step _foreach_norm "
                            "over the updated parameters"),
    "guard_off": ({"guard": "off"}, "guard='off': the weight guard's flag on the fused AdamW (and with it the "
                  "differential rerun, which is on by default only with a weight guard)"),
    "fingerprint_off": ({"fingerprint": False}, "fingerprint=False: the forward's input layout record"),
    "rerun_off": ({"rerun": False}, "rerun=False: the differential rerun's hooks, idle on a clean step"),
    "capsule_off": ({"capsule": False}, "capsule=False: the capsule's hooks, idle on a clean step"),
    "rlhf_off": ({}, "no mon.rlhf(logprobs=, old_logprobs=, rollout_logprobs=) call: the RLHF and rollout "
                 "statistics (the logprobs are computed in every arm: they are the loss)"),
    "spikes_off": ({"spike_factor": 0}, "spike_factor=0: the spike baseline (reporter thread only)"),
    "replica_off": ({"replica_check_every": 0}, "replica_check_every=0: the replica check, which a single "
                    "process never runs: nothing to remove, a null control (its row is the noise)"),
}
ARMS = ("bare", "defaults", *COMPONENTS, "exact_logit_every_step")
_EXACT = {"exact_logit_every": 1}


@dataclass(kw_only=True, slots=True)
class ProfileConfig:
    """The model, the batch and how long to measure (defaults: issue #30's model)."""

    device: str = "cpu"
    dtype: str = "bf16"
    layers: int = 4
    batch: int = 4
    seq: int = 256
    hidden: int = 256
    heads: int = 8
    kv_heads: int = 4
    head_dim: int = 32
    intermediate: int = 768
    vocab: int = 4096
    steps: int = 4
    """Timed steps per arm per round (the round's value is their mean)."""
    rounds: int = 10
    warmup: int = 1
    """Untimed steps per arm, once, before the first round."""
    threads: int | None = 2
    arms: tuple[str, ...] = ARMS
    """Which arms to run; ``bare`` and ``defaults`` always run (every figure is relative to them)."""
    timers: bool = False
    """Also clock each entry point of nanwatch on the training thread in the ``defaults`` arm
    (``nanwatch.bench.host_timers``; about a microsecond a call, in every nanwatch arm alike)."""

    def bench_config(self) -> BenchConfig:
        """The same shape as ``nanwatch bench``'s config (validated there)."""
        return BenchConfig(device=self.device, dtype=self.dtype, layers=self.layers, batch=self.batch,
                           seq=self.seq, hidden=self.hidden, heads=self.heads, kv_heads=self.kv_heads,
                           head_dim=self.head_dim, intermediate=self.intermediate, vocab=self.vocab,
                           steps=self.steps, repeats=self.rounds, warmup=self.warmup, threads=self.threads,
                           variants=("bare",))

    def __post_init__(self) -> None:
        self.bench_config()
        unknown = [a for a in self.arms if a not in ARMS]
        if unknown:
            raise ValueError(f"unknown arms {unknown}; choose from {list(ARMS)}")
        self.arms = tuple(a for a in ARMS if a in ("bare", "defaults") or a in self.arms)


@dataclass(slots=True)
class _Arm:
    name: str
    options: dict[str, Any] | None  # None: bare (no nanwatch)
    rlhf: bool
    round_ms: list[float] = field(default_factory=list)  # the mean step of each round
    reporter_ms: list[float] = field(default_factory=list)  # reporter-thread CPU per report, each round
    step_end_ms: list[float] = field(default_factory=list)  # training thread: Monitor.end_step per step
    capture_ms: list[float] = field(default_factory=list)  # of which the slot buffer copy (Reporter.capture)
    entry_ms: dict[str, list[float]] = field(default_factory=dict)  # ``timers``: ms a step per entry point


def _arm(name: str) -> _Arm:
    if name == "bare":
        return _Arm(name, None, rlhf=False)
    options = _EXACT if name == "exact_logit_every_step" else COMPONENTS.get(name, ({}, ""))[0]
    return _Arm(name, dict(options), rlhf=name != "rlhf_off")


def _thread_cpu_s(thread: threading.Thread | None) -> float | None:
    """CPU seconds ``thread`` has used so far (its own clock), or None where the platform has none."""
    if thread is None:
        return None
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
    except (AttributeError, OSError, TypeError):
        return None


class _Runner:
    """Runs one arm's round: attach (unless bare), ``steps`` timed steps, drain the reporter, close."""

    def __init__(self, cfg: ProfileConfig, clocks: dict[str, float] | None = None) -> None:
        self.cfg = cfg
        self.clocks = clocks  # host_timers.timing()'s seconds, when --timers
        self.model, self.opt, self.ids = build(cfg.bench_config())
        self.feed = rlhf_feed(cfg.batch, cfg.seq, cfg.device)
        self.sync = torch.cuda.synchronize if cfg.device == "cuda" else (lambda: None)
        self.counter = 0  # step numbers count across arms and rounds: sampled work runs at its real rate

    def _work(self, mon, rlhf: bool) -> None:
        lp = next_token_logprobs(self.model, self.ids)
        if rlhf and mon is not None:
            self.feed(mon, lp)
        (-lp.mean()).backward()
        self.opt.step()  # inside the step: the weight guard reads this step's flag

    def round(self, arm: _Arm, n: int, *, record: bool) -> None:
        from nanwatch import attach

        before = set(threading.enumerate())
        mon = None if arm.options is None else attach(self.model, run_id="bench-profile", optimizer=self.opt,
                                                       **arm.options)
        reporter = next((t for t in threading.enumerate() if t not in before and t.name == "nanwatch-reporter"),
                        None)
        times, step_end = [], _Timed(mon.end_step if mon is not None else None)
        if mon is not None:
            mon.end_step = step_end  # Monitor.step() closes the step with it
        cpu0 = cpu1 = _thread_cpu_s(reporter)
        _CAPTURE.seconds = 0.0
        if self.clocks is not None:
            self.clocks.update(dict.fromkeys(self.clocks, 0.0))
        try:
            for _ in range(n):
                self.opt.zero_grad(set_to_none=True)
                self.sync()
                t0 = time.perf_counter()
                with mon.step(self.counter) if mon is not None else contextlib.nullcontext():
                    self._work(mon, arm.rlhf)
                self.sync()
                times.append((time.perf_counter() - t0) * 1e3)
                self.counter += 1
            if mon is not None:
                mon.last_report()  # every report of the round built: the thread's CPU so far is theirs
                cpu1 = _thread_cpu_s(reporter)
        finally:
            if mon is not None:
                mon.close()
        if record and n:
            arm.round_ms.append(statistics.fmean(times))  # a mean: a step that reads more (the sweep's) counts at its rate
            if mon is not None:
                arm.step_end_ms.append(step_end.seconds * 1e3 / n)
                arm.capture_ms.append(_CAPTURE.seconds * 1e3 / n)
                if cpu0 is not None and cpu1 is not None:
                    arm.reporter_ms.append((cpu1 - cpu0) * 1e3 / n)
                if self.clocks is not None and arm.name == "defaults":
                    for key, sec in self.clocks.items():
                        arm.entry_ms.setdefault(key, []).append(sec * 1e3 / n)


class _Timed:
    """``fn`` with the seconds spent in it added up (``seconds``)."""

    def __init__(self, fn: Callable | None) -> None:
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t


_CAPTURE = _Timed(None)  # Reporter.capture, timed while run() runs: the slot buffer copy (and CUDA event)


@contextlib.contextmanager
def _timing_capture():
    from nanwatch.hooks.report.reporter import Reporter

    original = Reporter.capture
    _CAPTURE.fn = original

    def capture(self, *args, **kwargs):
        return _CAPTURE(self, *args, **kwargs)

    Reporter.capture = capture
    try:
        yield
    finally:
        Reporter.capture = original


def run(cfg: ProfileConfig, *, log: Callable[[str], None] = print) -> dict:
    """Measure; returns the results as a JSON-ready dict."""
    prev_threads = torch.get_num_threads()
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    try:
        clocking = host_timers.timing() if cfg.timers else contextlib.nullcontext(None)
        with warnings.catch_warnings(), _timing_capture(), clocking as clocks:
            warnings.simplefilter("ignore")
            runner = _Runner(cfg, clocks)
            arms = [_arm(name) for name in cfg.arms]
            log(_describe(cfg, runner.model))
            for arm in arms:
                runner.round(arm, cfg.warmup, record=False)
            for r in range(cfg.rounds):
                k = r % len(arms)
                for arm in arms[k:] + arms[:k]:
                    runner.round(arm, cfg.steps, record=True)
    finally:
        torch.set_num_threads(prev_threads)
    return _results(cfg, runner.model, arms)


def _describe(cfg: ProfileConfig, model: torch.nn.Module) -> str:
    params = sum(p.numel() for p in model.parameters())
    return (f"nanwatch bench profile: tiny Qwen3 (sdpa) {cfg.layers} layers, hidden {cfg.hidden}, {cfg.heads}/"
            f"{cfg.kv_heads} heads x {cfg.head_dim}, intermediate {cfg.intermediate}, vocab {cfg.vocab}, "
            f"{params / 1e6:.2f}M params; batch {cfg.batch} x {cfg.seq}, {cfg.dtype}, fused AdamW; {cfg.device}, "
            f"torch threads {torch.get_num_threads()}; {len(cfg.arms)} arms x {cfg.rounds} rounds x {cfg.steps} "
            f"steps (+{cfg.warmup} warmup)")


def _paired(a: list[float], b: list[float]) -> dict[str, float]:
    """Median and quartiles over rounds of each round's ``a - b``."""
    d = sorted(x - y for x, y in zip(a, b, strict=True))
    q = statistics.quantiles(d, n=4, method="inclusive") if len(d) > 1 else [d[0], d[0], d[0]]
    return {"ms": statistics.median(d), "q1_ms": q[0], "q3_ms": q[2]}


def _row(what: str, paired: dict[str, float], bare_ms: float, **extra: Any) -> dict[str, Any]:
    return {"what": what, "added_ms": paired["ms"], "q1_ms": paired["q1_ms"], "q3_ms": paired["q3_ms"],
            "pct_of_bare": 100 * paired["ms"] / bare_ms, **extra}


def _med(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _results(cfg: ProfileConfig, model: torch.nn.Module, arms: list[_Arm]) -> dict:
    by = {a.name: a for a in arms}
    bare, dflt = by["bare"], by["defaults"]
    bare_ms = statistics.median(bare.round_ms)
    rows = {"total": _row("nanwatch at defaults (weight guard, rlhf(rollout_logprobs=)) minus bare",
                          _paired(dflt.round_ms, bare.round_ms), bare_ms, reporter_ms=_med(dflt.reporter_ms),
                          step_end_ms=_med(dflt.step_end_ms), capture_ms=_med(dflt.capture_ms))}
    for name, (_, what) in COMPONENTS.items():
        if name in by:
            arm = by[name]
            rows[name] = _row(what, _paired(dflt.round_ms, arm.round_ms), bare_ms, reporter_ms=_med(arm.reporter_ms),
                              reporter_saved_ms=(_med(dflt.reporter_ms) - _med(arm.reporter_ms))
                              if arm.reporter_ms and dflt.reporter_ms else None)
    if "exact_logit_every_step" in by:
        p = _paired(by["exact_logit_every_step"].round_ms, dflt.round_ms)
        rows["exact_logit"] = _row("one exact attention-logit computation (exact_logit_every=1 minus defaults); "
                                   "amortised at the default 1 step in 100", p, bare_ms,
                                   amortised_ms=p["ms"] / 100, amortised_pct=p["ms"] / bare_ms)
    return {
        "config": asdict(cfg),
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "torch": torch.__version__, "threads": cfg.threads},
        "params": sum(p.numel() for p in model.parameters()),
        "bare_ms": bare_ms, "defaults_ms": statistics.median(dflt.round_ms),
        "components": rows,
        "entry_points": _entry_points(dflt, bare_ms),
        "arms": {a.name: {"round_ms": a.round_ms, "reporter_ms": a.reporter_ms, "step_end_ms": a.step_end_ms,
                           "capture_ms": a.capture_ms}
                 for a in arms},
    }


def _entry_points(dflt: _Arm, bare_ms: float) -> dict[str, dict[str, Any]] | None:
    """``--timers``: each entry point's ms a step in the defaults arm (median over rounds), with what runs there."""
    if not dflt.entry_ms:
        return None
    what = {f"{c or m.rsplit('.', 1)[1]}.{f}": w for m, c, f, w in host_timers.ENTRY_POINTS}
    rows = {key: {"ms": statistics.median(v), "pct_of_bare": 100 * statistics.median(v) / bare_ms, "what": what[key]}
            for key, v in dflt.entry_ms.items()}
    return dict(sorted(rows.items(), key=lambda kv: -kv[1]["ms"]))


def format_table(results: dict) -> str:
    cfg = results["config"]
    lines = [f"{cfg['dtype']}: bare step {results['bare_ms']:.1f} ms, defaults {results['defaults_ms']:.1f} ms "
             f"(medians over {cfg['rounds']} rounds); added = paired median over rounds [quartiles]",
             f"{'component':<22} {'added ms':>9} {'[q1, q3]':>16} {'% of bare':>9} {'reporter ms/report':>19}"]
    for name, row in results["components"].items():
        rep = row.get("reporter_ms")
        rep_s = "" if rep is None else f"{rep:.3f}"
        if row.get("reporter_saved_ms") is not None:
            rep_s += f" ({-row['reporter_saved_ms']:+.3f})"
        lines.append(f"{name:<22} {row['added_ms']:>+9.2f} [{row['q1_ms']:+6.2f}, {row['q3_ms']:+6.2f}] "
                     f"{row['pct_of_bare']:>+8.2f}% {rep_s:>19}")
    total = results["components"]["total"]
    lines.append(f"training thread, host time a step in Monitor.end_step: {total['step_end_ms']:.3f} ms, of which "
                 f"the slot buffer copy (+ CUDA event) {total['capture_ms']:.3f} ms")
    if "exact_logit" in results["components"]:
        ex = results["components"]["exact_logit"]
        lines.append(f"exact attention logit: {ex['added_ms']:+.2f} ms on a step it runs; amortised at 1 in 100: "
                     f"{ex['amortised_ms']:+.3f} ms ({ex['amortised_pct']:+.3f}% of bare)")
    lines.append("component rows: defaults minus the arm with only that component off; reporter column: that "
                 "arm's reporter-thread CPU per report (in brackets: minus defaults')")
    entries = results.get("entry_points")
    if entries:
        lines.append("training thread, defaults arm, clocked per entry point (ms a step, median over rounds):")
        for key, row in entries.items():
            lines.append(f"  {row['ms']:7.3f} ms {row['pct_of_bare']:6.2f}%  {key:<30} {row['what']}")
        total = sum(row["ms"] for row in entries.values())
        lines.append(f"  {total:7.3f} ms {100 * total / results['bare_ms']:6.2f}%  (sum), plus the reporter thread's "
                     f"{results['components']['total']['reporter_ms'] or 0:.3f} ms of CPU a report")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    d = ProfileConfig()
    p = argparse.ArgumentParser(prog="nanwatch bench profile", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=d.device, choices=["cpu", "cuda"])
    p.add_argument("--dtype", default=d.dtype, choices=["bf16", "fp16", "fp32"])
    for name in ("layers", "batch", "seq", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab",
                 "steps", "rounds", "warmup"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name), dest=name)
    p.add_argument("--threads", type=int, default=d.threads, help="torch.set_num_threads (0: leave as is)")
    p.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset (bare, defaults always run)")
    p.add_argument("--timers", action="store_true", help="also clock nanwatch's entry points in the defaults arm")
    p.add_argument("--json", dest="json_path", metavar="PATH", help="also write the results as JSON here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    opts = {k: v for k, v in vars(args).items() if k not in ("json_path", "arms", "threads")}
    try:
        cfg = ProfileConfig(**{k: v for k, v in opts.items() if k != "timers"}, timers=args.timers,
                            threads=args.threads or None,
                            arms=tuple(a.strip() for a in args.arms.split(",") if a.strip()))
    except ValueError as exc:
        print(f"nanwatch bench profile: {exc}")
        return 2
    results = run(cfg)
    print(format_table(results))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
