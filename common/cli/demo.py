"""``nanwatch demo``: the whole loop on one CPU, in about a minute.

A real collector (uvicorn on loopback, SQLite in a temp dir) and a tiny HF Qwen3 trained in fp16 with
eager attention. Part-way through, layer 0's query/key norms jump (the attention-logit growth that long
runs see); fp16's QK matmul then overflows and the attention output turns NaN. nanwatch names the site
and step, the collector's default rule answers with an ``fp32`` directive, the trainer applies it at the
directive's step, and training goes on with finite losses. Nothing is simulated but the weight jump.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

__all__ = ["main"]


def _model(seed: int):
    import torch

    from nanwatch.bench.tiny_models import tiny_qwen3

    return tiny_qwen3("eager", dtype=torch.float16, seed=seed, vocab_size=64, max_position_embeddings=128,
                      use_cache=False)


def _batch(step: int, seq: int = 32):
    import torch

    # a learnable toy task: each row counts upward from a random start (mod vocab)
    g = torch.Generator().manual_seed(step)
    start = torch.randint(0, 64, (4, 1), generator=g)
    return (start + torch.arange(seq)) % 64


def _get(url: str) -> bytes:
    from nanwatch.tokens import token_from_env

    req = urllib.request.Request(url)
    token = token_from_env("NANWATCH_TOKEN")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.read()


@contextlib.contextmanager
def _collector(url: str | None, db_dir: Path) -> Iterator[str]:
    """An external collector's URL as it is, or a real one started here on loopback (default settings)."""
    if url is not None:
        yield url.rstrip("/")
        return
    from nanwatch.monitor.server import BackgroundServer
    from nanwatch.monitor.settings import Settings

    # the embedded default: its own SQLite file, whatever database URL the environment names
    settings = Settings(host="127.0.0.1", port=0, db_path=str(db_dir / "nanwatch.db"), log_level="warning",
                        database_url=None, database_url_file=None)
    with BackgroundServer(settings) as srv:
        yield srv.url


def run(*, steps: int, spike_at: int, db_dir: Path, seed: int = 0, quiet: bool = False,
        collector: str | None = None, run_id: str = "demo") -> dict:
    """The demo, returning what happened; ``main`` prints it. ``collector``: report to that collector
    (its own settings apply) instead of starting one. Everything at defaults: no margin, no check of
    its own; the weight guard keeps the NaN step out of the weights."""
    import torch

    import nanwatch

    say = (lambda *a: None) if quiet else print
    rows: list[dict] = []
    with _collector(collector, db_dir) as url:
        say(f"collector: {url}" + ("" if collector else " (in-process, SQLite in a temp dir)"))
        model = _model(seed)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, fused=True)  # fused: the guard costs no sync
        attn = model.model.layers[0].self_attn
        say(f"model: Qwen3 2 layers, fp16, eager attention, fused SGD; logit growth injected at step {spike_at}\n")
        say(f"{'step':>4}  {'loss':>7}  {'non-finite':>10}  {'first offender':<36} {'mode':<6} {'update':<7} note")
        with nanwatch.attach(model, run_id=run_id, collector=url, optimizer=opt) as mon:
            for n in range(steps):
                note = ""
                if n == spike_at:
                    with torch.no_grad():
                        attn.q_norm.weight.mul_(100.0)
                        attn.k_norm.weight.mul_(100.0)
                    note = "q/k norms x100: fp16 QK overflows"
                    broke_at = time.monotonic()
                ids = _batch(n)
                with mon.step(n):
                    loss = model(input_ids=ids, labels=ids).loss
                    loss.backward()
                    opt.step()  # the weight guard skips it in a step that saw a non-finite value
                    opt.zero_grad()
                r = mon.last_report()
                bad = sum(s.nan + s.inf for s in r.sites)
                row = {"step": n, "loss": float(loss.detach()), "nonfinite": bad, "first_offender": r.first_offender,
                       "mode": r.attention_mode, "version": r.directive_version, "skipped": r.step_skipped,
                       "incident": r.incident.cls if r.incident else None}
                if not note and rows and rows[-1]["mode"] != row["mode"]:
                    note = f"directive v{r.directive_version} applied, {time.monotonic() - broke_at:.2f} s after the NaN step began"
                if row["incident"]:
                    note = (note + "; " if note else "") + f"rerun: {row['incident']}"
                rows.append(row)
                fo = f"{r.first_offender} ({r.first_offender_phase})" if r.first_offender else "-"
                update = "skipped" if r.step_skipped else "applied"
                say(f"{n:>4}  {row['loss']:>7.3f}  {bad:>10}  {fo:<36} {row['mode']:<6} {update:<7} {note}")
            # what the collector shows while the run is live (its per-rank series leave when it ends); the
            # first render shows new counters at 0 (born at zero, so increase() counts the first NaN), the
            # second at their value, as Prometheus's second scrape would
            _get(url + "/metrics")
            metrics = [ln for ln in _get(url + "/metrics").decode().splitlines()
                       if ln.startswith(("nanwatch_nonfinite_calls_total", "nanwatch_directive_info",
                                         "nanwatch_attention_mode", "nanwatch_attention_logit_max"))
                       and f'run_id="{run_id}"' in ln]
        state = json.loads(_get(f"{url}/v1/runs/{run_id}"))
    return {"rows": rows, "events": state.get("events", []), "metrics": metrics}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="nanwatch demo", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--spike-at", type=int, default=8)
    p.add_argument("--collector", help="report to this collector (default: start one in-process)")
    p.add_argument("--run-id", default="demo")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="nanwatch-demo-") as d:
        out = run(steps=args.steps, spike_at=args.spike_at, db_dir=Path(d),
                  collector=args.collector, run_id=args.run_id)
    print("\ncollector events:")
    for e in out["events"]:
        print(f"  step {e['step']}: {e['kind']:<26} {e['site'] or '':<28} {e['actor'] or ''}")
    print("\n/metrics (excerpt):")
    for ln in out["metrics"]:
        print("  " + ln)
    rows = out["rows"]
    broke = [r["step"] for r in rows if r["nonfinite"]]
    fixed = [r for r in rows if r["mode"] == "fp32"]
    recovered = bool(broke) and bool(fixed) and all(math.isfinite(r["loss"]) and not r["nonfinite"]
                                                    for r in fixed)
    if recovered:
        skipped = [r["step"] for r in rows if r["skipped"]]
        print(f"\nNaN first seen at step {broke[0]} in {rows[broke[0]]['first_offender']} "
              f"(rerun: {rows[broke[0]]['incident']}); fp32 directive applied at step {fixed[0]['step']}, "
              f"{fixed[0]['step'] - broke[0]} step(s) later; optimizer steps skipped by the weight guard: "
              f"{skipped}; every step since is finite.")
        return 0
    print("\ndemo did not recover: see the table above")
    return 1
