"""Words for the figures: the one wording of nanwatch's numbers for people, shared by the trainer's log lines
(``nanwatch.hooks.report.local_log``) and ``nanwatch status`` (both the collector's and a local file's view).

Every function takes plain values or the JSON form of a wire model (a dict), so that the CLI, which reads
the collector's JSON, and the trainer, which holds pydantic models, say the same thing in the same words.
Imports nothing beyond the standard library.

Two figures are easy to misread, so they are spelled out:

* the non-finite counts of ``SiteStat.nan``/``inf`` count *site visits* (calls of a site, in a step, whose
  tensor held a NaN or an Inf), not elements: a single NaN element that flows through 56 modules is 56
  visits. Only an incident's ``birth_elements`` counts elements;
* headroom is ``amax / finfo(dtype).max``: for bf16 and fp32 (max 3.4e38) an ordinary activation gives a
  figure like ``1.9e-40``, which reads as alarming and means "nowhere near overflow". It is printed as a
  percent of the dtype's largest value, down to 0.01%; below that, as ``<0.01% of max``: nothing
  actionable lives there (fp16's max is 65504, so 0.01% is an amax of 6.5).
"""

from __future__ import annotations

import hashlib
import math
import shlex
import unicodedata
from collections.abc import Mapping
from typing import Any

__all__ = ["attribution", "figure", "file_name", "headroom", "incident", "printable", "replay_command", "rlhf",
           "rollout", "rollout_event", "spikes", "visits"]


def figure(x: float | str | None) -> str:
    """A float in four significant figures; None as ``-``; the API's ``"NaN"``/``"Infinity"`` strings and
    Python's non-finite floats alike as ``NaN``/``inf``/``-inf``."""
    if x is None:
        return "-"
    x = float(x)
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:.4g}"


def headroom(h: float | str | None) -> str:
    """``amax / finfo.max`` as a share of the dtype's largest value (see the module docstring)."""
    if h is None:
        return "-"
    h = float(h)
    if math.isnan(h):
        return "no finite value"
    if math.isinf(h) or h >= 1.0:
        return "overflowed (an Inf was seen)" if math.isinf(h) else "at the overflow edge (100% of max)"
    if h >= 1e-4:
        return f"{h * 100:.2g}% of max"
    return "<0.01% of max"


def visits(n: float, *, unit: str = "site visits") -> str:
    """A non-finite count with its unit: ``56 non-finite site visits`` (calls, not elements)."""
    return f"{n:g} non-finite {unit}"


def printable(s: str) -> str:
    """``s`` safe to print on a terminal or to show in a dashboard: control and format characters (bidi
    overrides, zero-width), line and paragraph separators, private-use, surrogate and unassigned code points
    are written as ``\\uXXXX``, so that a path sent by a trainer cannot rewrite what the on-call reads."""
    if s.isprintable():  # no C* nor Zl/Zp character (the common case: 3 us, not 250, for 1,020 characters)
        return s
    return "".join(c if unicodedata.category(c)[0] != "C" and unicodedata.category(c) not in ("Zl", "Zp")
                   else f"\\u{ord(c):04x}" for c in s)


_SAFE = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._@+=-")


def file_name(text: str, *, room: int = 196) -> str:
    """``text`` as (part of) a file name, injective: every character outside ``[A-Za-z0-9._@+=-]`` (``%``
    itself included) percent-encoded, so that no separator, control character or ``:`` survives and two
    texts never share a name (the spool's run folders, the capsules' run ids). An encoding longer than
    ``room`` characters is cut and ends in ``~`` and a SHA-256 prefix of ``text`` (``~`` is never in an
    encoding, so a cut name never equals a whole one)."""
    name = "".join(c if c in _SAFE else "".join(f"%{b:02X}" for b in c.encode()) for c in text)
    if len(name) > room:
        name = name[:room - 40] + "~" + hashlib.sha256(text.encode()).hexdigest()[:32]
    return name


#: the replay to run first, by incident class (``nanwatch replay CAPSULE ...`` options; the runbook's first step)
REPLAY_TRY = {"precision": "--try same,fp32,math", "data_mask": "--try same,fp32",
              "not_reproducible": "--try same", "not_classified": "--try same,fp32,math",
              "optimizer": "--try same"}


def replay_command(inc: Mapping[str, Any], *, device: str | None = None) -> str | None:
    """The command that replays an incident's capsule (None without one), on the kind of device the run used
    (``device``: ``cuda`` adds ``--device cuda``; replay's default is the CPU); a not-reproducible incident's
    is to be run on the host that saw it and on another (silent data corruption shows on one host only)."""
    capsule = inc.get("capsule")
    if not capsule:
        return None
    on = f" --device {device}" if device and device != "cpu" else ""
    return f"nanwatch replay {shlex.quote(printable(capsule))}{on} {REPLAY_TRY.get(inc.get('cls'), '--try same,fp32')}"


def _divergence(inc: Mapping[str, Any]) -> list[str]:
    """A replica divergence's ranks and hosts, first differing parameters and whether it was repaired."""
    ranks, hosts, params = inc.get("ranks") or [], inc.get("hosts") or [], inc.get("params") or []
    parts = [f"rank{'s' if len(ranks) != 1 else ''} {', '.join(str(r) for r in ranks) or '?'}"
             + (f" on {', '.join(printable(h) for h in hosts)}" if hosts else "")
             + " disagree with their replicas (the replicas now train different models)"]
    if params:
        parts.append("first differing " + ", ".join(printable(p) for p in params[:4])
                     + (f" and {len(params) - 4} more" if len(params) > 4 else ""))
    repaired = inc.get("repaired")
    parts.append("repair off (replica_repair=False)" if repaired is None else "repaired from the majority"
                 if repaired else "not repaired (no majority, or the check failed again)")
    return parts


def incident(inc: Mapping[str, Any]) -> str:
    """An incident (``Incident.model_dump(mode="json")``, or the collector's incident event detail) in one
    phrase: its class, the birth module and kind, the elements there, parameters found non-finite; a replica
    divergence's ranks, hosts, first differing parameters and repair."""
    parts = [f"class {inc.get('cls', '?')}"]
    if inc.get("cls") == "replica_divergence":
        parts += _divergence(inc)
    birth = inc.get("birth")
    if birth:
        kind = inc.get("birth_kind")
        parts.append(f"born at {birth}" + (f" ({kind})" if kind else ""))
    n = inc.get("birth_elements") or 0
    if n:
        parts.append(f"{n} non-finite element{'s' if n != 1 else ''} there")
    params = inc.get("birth_params") or {}
    if params:
        parts.append("non-finite parameters " + ", ".join(sorted(params)))
    note = inc.get("note")
    if note:
        parts.append(note)
    command = replay_command(inc, device=inc.get("device"))
    if command is not None:
        where = " on this host and on another" if inc.get("cls") == "not_reproducible" else ""
        parts.append(f"capsule {printable(inc['capsule'])}: replay with `{command}`{where}")
    return "; ".join(parts)


_RLHF = (("logprob_min", "logprob min"), ("ratio_max", "ratio max"), ("kl_k1_mean", "KL k1 mean"),
         ("kl_k3_mean", "KL k3 mean"), ("kl_k3_max", "k3 max"), ("kl_k3_ratio_mean", "k3*ratio mean"),
         ("advantage_std", "advantage std"))


def rlhf(stat: Mapping[str, Any] | None) -> str:
    """RLHF health (``RlhfStat`` as JSON) in one line; ``-`` when none was recorded. Non-finite values are
    counted per tensor, never hidden."""
    if not stat:
        return "-"
    parts = [f"{label} {figure(stat[key])}" for key, label in _RLHF if stat.get(key) is not None]
    clip = stat.get("clip_fraction")
    if clip is not None:
        clip = float(clip)
        parts.insert(2, f"clip {clip * 100:.3g}%" if math.isfinite(clip) else f"clip {figure(clip)}")
    if stat.get("kl_optimised"):
        parts.append(f"loss KL {stat['kl_optimised']}")
    bad = {k: v for k, v in (stat.get("nonfinite") or {}).items() if v}
    parts.append("non-finite " + (", ".join(f"{k} {v:g}" for k, v in sorted(bad.items())) if bad else "none"))
    if stat.get("tokens") is not None:
        parts.append(f"over {stat['tokens']:g} tokens")
    return ", ".join(parts)


def _percent(x: float | str | None) -> str:
    if x is None:
        return "-"
    x = float(x)
    return f"{x * 100:.3g}%" if math.isfinite(x) else figure(x)


def rollout(stat: Mapping[str, Any] | None, nonfinite: float | None = None) -> str:
    """The rollout against the trainer (``RolloutStat`` as JSON; Δlogp = trainer − rollout) in one line, with
    the rollout logprobs' own non-finite count when known (counted, never hidden); ``-`` when none."""
    if not stat:
        return "-" if nonfinite is None else f"non-finite rollout logprobs {nonfinite:g}"
    parts = [f"|Δlogp| mean {figure(stat.get('abs_mean'))}", f"p99 {figure(stat.get('abs_p99'))}",
             f"max {figure(stat.get('abs_max'))}", f"k3 {figure(stat.get('k3_mean'))}",
             f"truncated {_percent(stat.get('truncated_fraction'))} (cap {figure(stat.get('cap'))})",
             f"correlation {figure(stat.get('prob_correlation'))}", f"slope {figure(stat.get('logprob_slope'))}"]
    if nonfinite is not None:
        parts.append(f"non-finite rollout logprobs {nonfinite:g}")
    if stat.get("outlier_sequences"):
        parts.append(f"{stat['outlier_sequences']:g} outlier sequences")
    parts.append(f"over {stat.get('tokens', 0):g} tokens")
    return ", ".join(parts)


def rollout_event(ev: Mapping[str, Any]) -> str:
    """A classified rollout mismatch (``RolloutEvent`` as JSON, or its event's detail) in one phrase: its cause,
    figures, evidence and the remedy."""
    figures = ev.get("figures") or {}
    parts = [f"{ev.get('cause', '?')}"]
    if figures:
        parts.append(" ".join(f"{k} {figure(v)}" for k, v in sorted(figures.items())))
    for key in ("evidence", "remedy"):
        if ev.get(key):
            parts.append(f"{key}: {ev[key]}" if key == "remedy" else str(ev[key]))
    return "; ".join(parts)


def attribution(at: Mapping[str, Any]) -> str:
    """A rollout mismatch attributed to a module (``RolloutAttribution`` as JSON) in one phrase: the module
    named, the mismatch each lowered module reproduces, the capsule."""
    module = at.get("module")
    parts = [f"{at.get('cause', '?')} at step {at.get('step', '?')}: "
             + (f"module {module}" if module else "no single module explains it")
             + f" (lowered to {at.get('rollout_dtype', '?')})"]
    parts.append(f"observed |Δlogp| mean {figure(at.get('observed_abs_mean'))}, every module lowered "
                 f"{figure(at.get('lowered_abs_mean'))}, over {at.get('sequences', 0):g} sequences")
    shares = sorted(at.get("modules") or [], key=lambda m: -float(m.get("share") or 0))[:3]
    if shares:
        parts.append("alone: " + ", ".join(f"{m.get('module')} {_percent(m.get('share'))}" for m in shares))
    if at.get("capsule"):
        parts.append(f"capsule {printable(at['capsule'])}")
    if at.get("note"):
        parts.append(str(at["note"]))
    return "; ".join(parts)


def spikes(items: list[Mapping[str, Any]], *, most: int = 3) -> str:
    """A step's spikes (``Spike`` as JSON, largest factor first) in one phrase: the first ``most`` named with
    their factor, value and baseline (a site named ``loss`` is the loss), then how many more."""
    parts = []
    for s in items[:most]:
        site, phase = printable(str(s.get("site", "?"))), s.get("phase", "?")
        what = "loss spike" if site == "loss" else "spike"
        parts.append(f"{what} at {site} ({phase}): {float(s.get('factor', math.nan)):.3g}x its baseline "
                     f"(value {figure(s.get('value'))}, baseline {figure(s.get('baseline'))})")
    if len(items) > most:
        parts.append(f"{len(items) - most} more spiking site{'s' if len(items) - most != 1 else ''}")
    return "; ".join(parts)
