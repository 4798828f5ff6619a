"""``nanwatch replay CAPSULE``: re-run an incident capsule's birth module under several settings, anywhere,
and say what reproduced (the replay itself: ``nanwatch.hooks.forensics.replay``). This module is the command:
its arguments, and the table (or ``--json``) it prints.

Every string a capsule carries reaches the terminal through ``printable`` (no escape sequence, bidi override
nor line break of the file's own). Exit code 0: the non-finite value reproduced; 1: not reproducible here;
2: cannot replay (one line on stderr, whatever the capsule provokes).

Example usage::

    nanwatch replay /runs/capsules/grpo-0412-step1200.capsule --try same,fp32,math
    nanwatch replay incident.capsule --device cuda --json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from typing import Any

from nanwatch.readable import printable

__all__ = ["main"]


def _attribution_table(result: dict[str, Any]) -> str:
    result = _shown(result)
    a, rec = result["attribution"], result["recorded"]
    lines = [f"capsule  {result['capsule']}",
             f"rollout attribution of step {rec['step']}, recorded on {rec['host']} ({rec['device']}); redone on "
             f"{result['device']}: {a['sequences']} sequences, {a['rollout_dtype']}",
             f"observed mean |dlogp| {a['observed_abs_mean']}, every unit lowered {a['lowered_abs_mean']}",
             f"{'unit':<48} {'abs_mean':>10} {'share':>6}"]
    lines += [f"{m['module']:<48} {m['abs_mean']:>10.3g} {m['share']:>6.2f}" for m in a["modules"]]
    lines.append(f"module   {result['module']} (recorded: {result['recorded_module']}; "
                 f"{'the same' if result['same'] else 'another one here'}){': ' + a['note'] if a['note'] else ''}")
    return "\n".join(lines)


_MEANING = {"precision": "non-finite on the recorded path, finite under another setting: a precision fallback helps",
            "data_mask": "non-finite under every setting that ran: the inputs or weights carry it (no precision "
                         "switch helps)",
            "not_reproducible": "finite under the recorded settings on this host: replay it on the host that "
                                "raised it and on another; reproducible only there points at that host "
                                "(silent data corruption), nowhere at a race or a fault outside this module",
            "undecided": "non-finite under every setting that ran, but without fp32 whether a precision switch "
                         "helps (precision) or the inputs or weights carry it (data_mask) is not decided here"}


def _shown(x: Any) -> Any:
    """``x`` with every string in it (keys too) through ``printable``: what a capsule says reaches the terminal
    escaped (no escape sequence, bidi override nor line break of its own), as ``nanwatch status`` shows it."""
    if isinstance(x, str):
        return printable(x)
    if isinstance(x, dict):
        return {_shown(k): _shown(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_shown(v) for v in x]
    return x


def _table(result: dict[str, Any]) -> str:
    result = _shown(result)  # the capsule's strings (fqn, host, class, dropped, notes) are the file's words
    rec = result["recorded"]
    lines = [f"capsule  {result['capsule']}",
             f"module   {result['fqn']} ({result['class_path']})",
             f"recorded on {rec['host']} ({rec['device']}): {rec['incident_cls']}, "
             f"{rec['birth_elements']} non-finite elements; forward replayed on {result['device']}"]
    if result["capture"].get("of") == "first_offender":
        lines.append("call     the first offender's call in the trainer's finite re-run (no birth was found there): "
                     "the inputs training fed it")
    if result["dropped"]:
        lines.append(f"not recorded: {'; '.join(result['dropped'][:4])}")
    lines.append(f"{'setting':<10} {'reproduces':<11} {'non-finite':>10} {'max |x| finite':>15}  note")
    for r in result["rows"]:
        if r["status"] in ("finite", "nonfinite"):
            rep = "yes" if r["status"] == "nonfinite" else "no"
            mx = f"{r['max_abs']:.4g}" if math.isfinite(r["max_abs"]) else "inf"
            note = f"{r['dtype']}, {r['elements']} elements, {r['sdpa_calls']} SDPA calls"
            if not r["sdpa_calls"] and r["setting"] not in ("same", "fp32"):
                note += " (no SDPA call: this kernel choice changed nothing)"
            lines.append(f"{r['setting']:<10} {rep:<11} {r['nonfinite']:>10} {mx:>15}  {note}")
        else:
            lines.append(f"{r['setting']:<10} {r['status']:<11} {'-':>10} {'-':>15}  {r.get('note', '')}")
    hooks = result.get("hooks") or []
    if hooks:
        lines.append(f"hooks    the module had {len(hooks)} forward hook(s) in training that a capsule cannot carry "
                     f"(code): {'; '.join(hooks[:4])}{'; ...' if len(hooks) > 4 else ''}")
    if result["cls"] == "not_reproducible" and hooks:
        lines.append("class    not_reproducible: finite here, but the module ran with the hooks above in training, "
                     "and a hook that changes its output is not replayed: suspect a hook before the hardware")
        return "\n".join(lines)
    lines.append(f"class    {result['cls']}: {_MEANING[result['cls']]}")
    if result["cls"] == "undecided":
        lines.append(f"         {result['undecided']}: add --try fp32 to decide it; the trainer recorded class "
                     f"{rec['incident_cls']}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    from nanwatch.hooks.forensics.replay import SETTINGS, Bounds, CapsuleError, offline, replay_capsule

    p = argparse.ArgumentParser(prog="nanwatch replay", description="Re-run an incident capsule's birth module's "
                                "forward under several settings; exit 0 if the non-finite value reproduced, 1 if "
                                "not, 2 if it cannot be replayed here (a backward birth is not replayed).")
    p.add_argument("capsule", help="a .capsule file written by the trainer (NANWATCH_CAPSULE_DIR)")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    p.add_argument("--try", dest="settings", default=",".join(SETTINGS),
                   help=f"comma-separated settings (default {','.join(SETTINGS)})")
    p.add_argument("--json", action="store_true", help="print the verdict as JSON")
    d = Bounds()
    p.add_argument("--max-params", type=int, default=d.max_params,
                   help=f"refuse a module with more parameters, counted before it is built (default {d.max_params:,})")
    p.add_argument("--max-bytes", type=int, default=d.max_bytes, help="refuse a module whose parameters and buffers "
                   f"(and the fp32 setting's copy) take more bytes, counted before it is built (default {d.max_bytes:,})")
    p.add_argument("--max-build-s", type=float, default=d.max_build_s,
                   help=f"refuse a module that takes longer to build (default {d.max_build_s:g} s)")
    p.add_argument("--max-run-s", type=float, default=d.max_run_s,
                   help="stop a replay that runs longer; an attribution capsule whose sequences (count x length) "
                        "would take longer, counted before it runs, is refused (default "
                        f"{d.max_run_s:g} s)")
    a = p.parse_args(argv)
    offline()  # before anything imports transformers
    settings = [s.strip() for s in a.settings.split(",") if s.strip()]
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown:
        p.error(f"unknown settings {unknown}: choose from {','.join(SETTINGS)}")
    try:
        bounds = Bounds(a.max_params, a.max_bytes, a.max_build_s, fp32="fp32" in settings, max_run_s=a.max_run_s)
        result = replay_capsule(a.capsule, device=a.device, settings=settings, bounds=bounds)
    except CapsuleError as e:
        print(f"nanwatch replay: {printable(' '.join(str(e).split()))}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - anything else a hostile capsule provokes: one line, exit 2 (1 is "not reproducible")
        print(f"nanwatch replay: cannot replay {printable(a.capsule)}: {type(e).__name__}: "
              f"{printable(' '.join(str(e).split())[:300])}", file=sys.stderr)
        return 2
    print(json.dumps(result) if a.json else
          _attribution_table(result) if result.get("kind") == "attribution" else _table(result))
    return result["exit"]

