"""The roofline model and the tables of ``nanwatch bench kernels`` (:mod:`nanwatch.bench.kernels`).

The model (H100 SXM, bf16 dense), printed with every table:

* the bare step takes its FLOPs at :data:`MFU` of :data:`PEAK_FLOPS`;
* nanwatch adds its extra bytes read at :data:`BW_FRACTION` of :data:`PEAK_BW`, plus :data:`LAUNCH_S` for each
  extra kernel (nanwatch's kernels are small: their launches, not their math, are what they cost);
* the modelled ratio is (bare + added) / bare. Host Python is left out: on a GPU it overlaps the device's
  work as long as nothing syncs, which is why the syncs are counted.
"""

from __future__ import annotations

__all__ = ["BW_FRACTION", "LAUNCH_S", "MFU", "PEAK_BW", "PEAK_FLOPS", "format_report", "roofline"]

PEAK_FLOPS = 989e12  # H100 SXM, bf16 dense
MFU = 0.45
PEAK_BW = 3.35e12  # H100 SXM HBM3, bytes/s
BW_FRACTION = 0.85
LAUNCH_S = 5e-6
_PHASES = ("begin", "forward", "rlhf", "backward", "optimizer", "end")


def _get(c, key: str) -> float:
    return c[key] if isinstance(c, dict) else getattr(c, key)


def roofline(r: dict) -> dict:
    """The modelled H100 times (ms) and ratio of one shape's results (``bare``/``extra`` by phase, ``flops``)."""
    extra_bytes = sum(_get(r["extra"][p], "bytes") for p in _PHASES)
    extra_kernels = sum(_get(r["extra"][p], "kernels") for p in _PHASES)
    bare_ms = 1e3 * r["flops"] / (MFU * PEAK_FLOPS)
    bytes_ms = 1e3 * extra_bytes / (BW_FRACTION * PEAK_BW)
    launch_ms = 1e3 * extra_kernels * LAUNCH_S
    return {"bare_ms": bare_ms, "bytes_ms": bytes_ms, "launch_ms": launch_ms, "added_ms": bytes_ms + launch_ms,
            "ratio": (bare_ms + bytes_ms + launch_ms) / bare_ms if bare_ms > 0 else None,
            "extra_bytes": extra_bytes, "extra_kernels": extra_kernels,
            "extra_syncs": sum(_get(r["extra"][p], "syncs") for p in _PHASES)}


def assumptions() -> str:
    return (f"roofline (H100 SXM, bf16): bare = FLOPs / ({MFU:.0%} of {PEAK_FLOPS / 1e12:.0f} TFLOP/s); "
            f"nanwatch = extra bytes / ({BW_FRACTION:.0%} of {PEAK_BW / 1e12:.2f} TB/s) + extra kernels x "
            f"{LAUNCH_S * 1e6:.0f} us; ratio = (bare + nanwatch) / bare. Host time not modelled (hidden while "
            f"nothing syncs).")


def _shape_line(name: str, s: dict, dtype: str) -> str:
    depth = (f"counted at {' and '.join(map(str, s['counted']))}, linear in depth" if len(s["counted"]) > 1
             else "as counted")
    return (f"== {name}: Qwen3-shaped, {s['layers']} layers ({depth}), hidden {s['hidden']}, intermediate {s['intermediate']}, {s['heads']}/{s['kv_heads']} "
            f"heads x {s['head_dim']}, vocab {s['vocab']}{' (tied)' if s['tie'] else ''}; seq {s['seq']}, "
            f"micro-batch 1, {dtype}")


def _phase_table(r: dict) -> list[str]:
    lines = [f"  {'phase':<10} {'bare kern':>10} {'bare MB':>11} {'bare sync':>9} | {'+kernels':>9} {'+MB read':>10} "
             f"{'+syncs':>7}"]
    tot = {k: 0.0 for k in ("bk", "bb", "bs", "ek", "eb", "es")}
    for p in _PHASES:
        b, e = r["bare"][p], r["extra"][p]
        row = (_get(b, "kernels"), _get(b, "bytes") / 1e6, _get(b, "syncs"), _get(e, "kernels"),
               _get(e, "bytes") / 1e6, _get(e, "syncs"))
        for k, v in zip(tot, row, strict=True):
            tot[k] += v
        lines.append(f"  {p:<10} {row[0]:>10.1f} {row[1]:>11.1f} {row[2]:>9.2f} | {row[3]:>+9.1f} {row[4]:>+10.1f} "
                     f"{row[5]:>+7.2f}")
    lines.append(f"  {'step':<10} {tot['bk']:>10.1f} {tot['bb']:>11.1f} {tot['bs']:>9.2f} | {tot['ek']:>+9.1f} "
                 f"{tot['eb']:>+10.1f} {tot['es']:>+7.2f}")
    return lines


def _top(r: dict, key: str, n: int = 10) -> list[str]:
    fns = sorted(r["by_function"].items(), key=lambda kv: -_get(kv[1], key))[:n]
    unit = "MB" if key == "bytes" else "kernels"
    lines = [f"  top {n} nanwatch functions by {'bytes read' if key == 'bytes' else 'kernels'} (entry > leaf):"]
    for name, c in fns:
        v = _get(c, key) / 1e6 if key == "bytes" else _get(c, key)
        other = _get(c, "kernels") if key == "bytes" else _get(c, "bytes") / 1e6
        lines.append(f"    {v:>10.1f} {unit:<7} ({other:.1f} {'kernels' if key == 'bytes' else 'MB'})  {name}")
    return lines


def format_report(results: dict) -> str:
    """The tables: per shape, by phase, bare and nanwatch's extra; nanwatch's top functions; the roofline."""
    plan = results["plan"]
    options = ", ".join(f"{k}={v!r}" for k, v in results.get("options", {}).items())
    lines = [f"nanwatch bench kernels on {results['device']}, {results.get('dtype', '?')} (torch {results['torch']}); "
             f"nanwatch.attach(model, optimizer=opt{', ' + options if options else ''}) at the defaults otherwise; "
             f"per step, the mean over every cadence {plan['cadences']} (cycle {plan['cycle']} steps)",
             "kernels: ops that launch device work (views, allocations, syncs not counted); MB read: sum of the "
             "kernels' tensor inputs; syncs: item()/bool()/data-dependent shapes/blocking copies to the host"]
    for name, r in results["shapes"].items():
        lines += ["", _shape_line(name, r["shape"], results.get("dtype", "?")), *_phase_table(r)]
        if r.get("cuda_sync_warnings") is not None:
            lines.append(f"  syncs CUDA's set_sync_debug_mode('warn') reported, by phase: {r['cuda_sync_warnings']}")
        lines += _top(r, "bytes") + _top(r, "kernels")
        rf = r["roofline"]
        ratio = f"x{rf['ratio']:.3f}" if rf["ratio"] is not None else "n/a"
        if name == "tiny":  # a launch-bound toy: the ratio says nothing about a GPU-sized step
            ratio += " (tiny: not a GPU-sized step, read the counts only)"
        lines.append(f"  H100 roofline: bare step {rf['bare_ms']:.2f} ms ({r['flops'] / 1e12:.1f} TFLOP); nanwatch "
                     f"+{rf['added_ms']:.3f} ms ({rf['extra_bytes'] / 1e9:.3f} GB read: {rf['bytes_ms']:.3f} ms; "
                     f"{rf['extra_kernels']:.0f} kernels: {rf['launch_ms']:.3f} ms); modelled {ratio}; "
                     f"{rf['extra_syncs']:+.2f} host syncs a step")
    lines += ["", assumptions()]
    return "\n".join(lines)
