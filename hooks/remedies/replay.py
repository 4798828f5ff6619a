"""``nanwatch replay CAPSULE``: re-run an incident capsule's birth module under several settings, anywhere.

The capsule (``nanwatch.hooks.remedies.capsule``) is a safetensors file; it is checked to be one (its 8-byte header
length and JSON header, read by hand) before ``safetensors.safe_open`` reads its tensors, which never
unpickles: a pickle, a ``torch.save`` zip or any other file is refused and never loaded. Classes are
imported only from ``transformers.`` and ``torch.nn.``: an arbitrary class path from someone else's file
would be an import, that is code, on open.

Each setting restores the recorded CPU (and CUDA) RNG state and runs the module's forward without grad
(forward only: a capsule whose incident was first seen in backward is refused, exit 2, with why; the
trainer writes none):

- ``same``: the recorded dtypes, autocast state and SDPA backend flags;
- ``fp32``: the module and its floating inputs upcast to float32, autocast off;
- ``math``, ``flash``, ``efficient``, ``cudnn``: the recorded dtypes under
  ``torch.nn.attention.sdpa_kernel(<that backend>)``; a backend this host cannot run is reported so.

The verdict: **precision** (non-finite under ``same``, finite under some other setting: a fallback helps),
**data_mask** (non-finite under every setting that ran), **not_reproducible** (finite under ``same`` on this
host: replay it on another host; twice not reproducible on the same host and reproducible elsewhere points
at that host). Exit code 0: the non-finite value reproduced; 1: not reproducible here; 2: cannot replay.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib
import json
import math
import os
import struct
import sys
from collections.abc import Sequence
from typing import Any

from nanwatch.hooks.measure.kept_forward import build_cache
from nanwatch.hooks.remedies.capsule import FORMATS, MAX_HEADER_BYTES, META_KEY, digest
from nanwatch.readable import printable

__all__ = ["CapsuleError", "call_inputs", "main", "open_capsule", "rebuild", "replay_capsule"]

SETTINGS = ("same", "fp32", "math", "flash", "efficient", "cudnn")
_MAX_HEADER = MAX_HEADER_BYTES  # below safetensors' own 100 MB: refused from the 8-byte length, unparsed
_ALLOWED = ("transformers.", "torch.nn.")


_BACKWARD = ("a backward birth is not replayed: this capsule's incident was first seen in backward, and nanwatch "
             "replay runs the recorded module's forward only; re-running the backward faithfully needs the gradient "
             "training fed into the module (its loss, loss scale and accumulation divisor), which a capsule does "
             "not hold. Reproduce it in the training code with torch.autograd.detect_anomaly on that step")


class CapsuleError(Exception):
    """The capsule cannot be opened or replayed here (exit code 2)."""


def open_capsule(path: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """(metadata, tensors on the CPU) of a nanwatch capsule; CapsuleError for anything else, unread."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CapsuleError(f"{path}: not a nanwatch capsule (too short for a safetensors header)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER and n <= size - 8:
                raise CapsuleError(f"{path}: header of {n} bytes, over the {_MAX_HEADER}-byte limit "
                                   f"({_MAX_HEADER >> 20} MiB) a capsule's header has; it is not read")
            if not 2 <= n <= min(_MAX_HEADER, size - 8):
                raise CapsuleError(f"{path}: not a nanwatch capsule (not a safetensors file: header length {n}); "
                                   "it is not loaded (a capsule is never unpickled)")
            raw = f.read(n)
    except OSError as e:
        raise CapsuleError(f"{path}: {e.strerror or e}") from None
    try:
        header = json.loads(raw.decode("utf-8"))
        meta = json.loads(header["__metadata__"][META_KEY])
    except (UnicodeDecodeError, ValueError, KeyError, TypeError):
        raise CapsuleError(f"{path}: not a nanwatch capsule (a safetensors header without nanwatch's metadata)") \
            from None
    if not isinstance(meta, dict) or meta.get("format") not in FORMATS:
        raise CapsuleError(f"{path}: capsule format {meta.get('format') if isinstance(meta, dict) else None!r} "
                           f"is not one of {FORMATS}")
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is not a dict
    except Exception as e:  # noqa: BLE001 - a malformed file is refused, whatever safetensors says
        raise CapsuleError(f"{path}: unreadable safetensors body: {e}") from None
    _check_digests(path, meta, tensors)
    return meta, tensors


def _check_digests(path: str, meta: dict[str, Any], tensors: dict[str, Any]) -> None:
    """Each tensor's bytes against the digest recorded when it was written: a damaged capsule is refused
    (naming the tensor) before any of it is used. A format-1 capsule has none (``meta["digests"]`` absent)."""
    if meta.get("format") == FORMATS[0]:
        return
    digests = meta.get("digests")
    if not isinstance(digests, dict):
        raise CapsuleError(f"{path}: damaged: the capsule's tensor digests are missing")
    for key in sorted(set(digests) | set(tensors)):
        if key not in tensors:
            raise CapsuleError(f"{path}: damaged: tensor {key} is missing")
        if key not in digests:
            raise CapsuleError(f"{path}: damaged: tensor {key} was not written with the capsule (no digest)")
        if digest(tensors[key]) != digests[key]:
            raise CapsuleError(f"{path}: damaged: tensor {key}'s bytes differ from those written "
                               f"({tuple(tensors[key].shape)} {str(tensors[key].dtype).removeprefix('torch.')}); "
                               "it is not replayed")


def _import(path: str, what: str) -> type:
    mod, _, qual = path.partition(":")
    if not mod.startswith(_ALLOWED):
        raise CapsuleError(
            f"the {what} is {path!r}, not a transformers or torch.nn class: replaying a user module needs its "
            "class importable here (an installed package) and its constructor arguments; nanwatch replay "
            "rebuilds HF (transformers) and plain torch.nn modules only, and does not import other code "
            "named by a capsule")
    try:
        obj: Any = importlib.import_module(mod)
        for part in qual.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise CapsuleError(f"cannot import the {what} {path!r} here: {e}") from None
    if not isinstance(obj, type):
        raise CapsuleError(f"the {what} {path!r} is not a class")
    return obj


def _set(module, name: str, tensor, *, param: bool) -> None:
    import torch

    *parents, leaf = name.split(".")
    sub = module
    for p in parents:
        sub = getattr(sub, p)
    if param:
        sub._parameters[leaf] = torch.nn.Parameter(tensor, requires_grad=tensor.is_floating_point())
    else:
        sub._buffers[leaf] = tensor


def rebuild(meta: dict[str, Any], tensors: dict[str, Any]):
    """The birth module, built from the capsule's class path and config or constructor arguments, with the
    recorded parameters and buffers (their dtypes as recorded)."""
    import torch

    build = meta["build"]
    cls = _import(build["class"], "module class")
    if not issubclass(cls, torch.nn.Module):
        raise CapsuleError(f"{build['class']} is not a torch.nn.Module")
    if build.get("kind") == "hf":
        cfg_cls = _import(build["config_class"], "config class")
        config = cfg_cls.from_dict(build["config"])
        if build.get("attn_implementation"):
            config._attn_implementation = build["attn_implementation"]
        module = cls(config, **build.get("hints", {}))
    elif build.get("kind") == "nn":
        if build.get("missing"):
            raise CapsuleError(f"{build['class']}: constructor arguments {build['missing']} were not recoverable")
        module = cls(**build.get("args", {}))
    else:
        raise CapsuleError(f"cannot rebuild {build['class']}: not recorded as an HF or torch.nn module")
    dropped = [d for d in meta.get("dropped", []) if d.startswith(("param.", "buffer."))]
    if dropped:
        raise CapsuleError(f"the capsule's size limit ({meta.get('max_bytes')} bytes) dropped {len(dropped)} of the "
                           f"module's tensors ({dropped[0]}, ...): it cannot be replayed faithfully")
    for key in meta.get("params", []):
        _set(module, key.removeprefix("param."), tensors[key], param=True)
    for key in meta.get("buffers", []):
        _set(module, key.removeprefix("buffer."), tensors[key], param=False)
    module.train(bool(meta.get("training", False)))
    return module


def _unpack(spec: dict[str, Any], tensors: dict[str, Any], device, fp32: bool = False) -> Any:
    """A recorded argument, rebuilt on ``device`` (a fresh HF cache at each call: the module appends to it);
    ``fp32``: its floating tensors, a cache's included, as float32."""
    import torch

    def tensor(key: str):
        t = tensors[key].to(device)
        return t.float() if fp32 and t.is_floating_point() else t

    if "tensor" in spec:
        if spec.get("dropped"):
            raise CapsuleError(f"input {spec['tensor']} was dropped by the capsule's size limit: cannot replay")
        return tensor(spec["tensor"])
    if "value" in spec:
        return spec["value"]
    if "dtype" in spec:
        return getattr(torch, spec["dtype"])
    if "seq" in spec:
        items = [_unpack(s, tensors, device, fp32) for s in spec["seq"]]
        return tuple(items) if spec.get("tuple") else items
    if "dict" in spec:
        return {k: _unpack(s, tensors, device, fp32) for k, s in spec["dict"].items()}
    if "cache" in spec:
        try:  # from the allow-list of cache classes and layer kinds only; nothing the capsule names is imported
            return build_cache(spec["cache"], lambda s: None if s is None else _unpack(s, tensors, device, fp32))
        except (ValueError, KeyError, TypeError) as e:
            raise CapsuleError(f"a recorded cache cannot be rebuilt: {e}") from None
    what = f"input {spec['name']} ({spec.get('dropped')}: {spec.get('why')})" if "name" in spec else \
        f"an input ({spec.get('dropped')})"
    raise CapsuleError(f"{what} could not be recorded: cannot replay")


def call_inputs(meta: dict[str, Any], tensors: dict[str, Any], device: str = "cpu", *, fp32: bool = False
                ) -> tuple[tuple, dict]:
    """The recorded call's (args, kwargs) on ``device``, built afresh at each call (a module appends to an HF
    cache); ``fp32``: floating tensors as float32. CapsuleError for an input that was not recorded."""
    return (tuple(_unpack(s, tensors, device, fp32) for s in meta.get("args", [])),
            {k: _unpack(s, tensors, device, fp32) for k, s in meta.get("kwargs", {}).items()})


def _float32(x: Any) -> Any:
    import torch

    if isinstance(x, torch.Tensor):
        return x.float() if x.is_floating_point() else x
    if isinstance(x, tuple):
        return tuple(_float32(v) for v in x)
    if isinstance(x, list):
        return [_float32(v) for v in x]
    if isinstance(x, dict):
        return {k: _float32(v) for k, v in x.items()}
    return x


def _first_float(x: Any):
    import torch

    if isinstance(x, torch.Tensor):
        return x if x.is_floating_point() else None
    if isinstance(x, (tuple, list)):
        return next((t for t in map(_first_float, x) if t is not None), None)
    if isinstance(x, dict):
        return next((t for t in map(_first_float, x.values()) if t is not None), None)
    return _first_float(tuple(vars(x).values())) if hasattr(x, "__dict__") else None  # ModelOutput and kin


def _backends(names: list[str]):
    from torch.nn.attention import SDPBackend

    table = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "math": "MATH", "cudnn": "CUDNN_ATTENTION"}
    return [getattr(SDPBackend, table[n]) for n in names if hasattr(SDPBackend, table[n])]


def _run_setting(setting: str, module, args, kwargs, meta, tensors, device) -> dict[str, Any]:
    import torch
    from torch.nn.attention import sdpa_kernel

    row: dict[str, Any] = {"setting": setting}
    dev_type = torch.device(device).type
    rec = meta.get("autocast", {})
    autocast = contextlib.nullcontext()
    if setting == "fp32":
        module, args, kwargs = copy.deepcopy(module).float(), _float32(args), _float32(kwargs)
    elif rec.get("enabled") and rec.get("dtype"):  # the recorded autocast, on this device
        autocast = torch.autocast(dev_type, dtype=getattr(torch, rec["dtype"]))
    if setting in ("same", "fp32"):
        flags = meta.get("sdpa", {})
        on = [n for n, v in flags.items() if v]
        kernel = sdpa_kernel(_backends(on)) if on and len(on) < len(flags) else contextlib.nullcontext()
    else:
        backends = _backends([setting])
        if not backends:
            return {**row, "status": "unavailable", "note": f"this torch has no {setting} SDPA backend"}
        kernel = sdpa_kernel(backends)
    if "rng.cpu" in tensors:
        torch.set_rng_state(tensors["rng.cpu"])
    if dev_type == "cuda":
        for k, state in tensors.items():
            if k.startswith("rng.cuda."):
                idx = int(k.rsplit(".", 1)[1])
                if idx < torch.cuda.device_count():
                    torch.cuda.set_rng_state(state, idx)
    F = torch.nn.functional
    sdpa, calls = F.scaled_dot_product_attention, []

    def counted(*a, **k):  # how many SDPA calls the setting's kernel choice applied to
        calls.append(1)
        return sdpa(*a, **k)

    try:
        F.scaled_dot_product_attention = counted
        with torch.no_grad(), kernel, autocast:
            out = module(*args, **kwargs)
    except RuntimeError as e:
        text = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
        if "No available kernel" in str(e) or "not supported" in str(e).lower():
            return {**row, "status": "unavailable", "note": text}
        return {**row, "status": "error", "note": text}
    finally:
        F.scaled_dot_product_attention = sdpa
    row["sdpa_calls"] = len(calls)
    t = _first_float(out)
    if t is None:
        return {**row, "status": "error", "note": "the output has no floating tensor"}
    bad = ~torch.isfinite(t)
    count = int(bad.sum())
    finite = t.detach().float().abs().masked_fill(bad, 0)
    return {**row, "status": "nonfinite" if count else "finite", "nonfinite": count, "elements": t.numel(),
            "max_abs": float(finite.max()) if t.numel() else 0.0, "dtype": str(t.dtype).removeprefix("torch.")}


def replay_capsule(path: str, *, device: str = "cpu", settings: Sequence[str] = SETTINGS) -> dict[str, Any]:
    """The verdict of replaying a capsule: rows per setting, the class, the exit code. CapsuleError when it
    cannot be replayed."""
    import torch

    meta, tensors = open_capsule(path)
    incident = meta.get("incident") if isinstance(meta.get("incident"), dict) else {}
    if incident.get("phase") == "backward":
        raise CapsuleError(_BACKWARD)
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise CapsuleError("--device cuda: no CUDA device on this host")
    try:
        module = rebuild(meta, tensors).to(device)
    except CapsuleError:
        raise
    except Exception as e:  # noqa: BLE001 - a constructor that fails here: say so, exit 2
        raise CapsuleError(f"rebuilding {meta['build'].get('class')} failed: {type(e).__name__}: {e}") from None
    call_inputs(meta, tensors, device)  # an input that cannot be rebuilt: exit 2 before anything runs
    if "same" not in settings:
        settings = ["same", *settings]
    rows = [_run_setting(s, module, *call_inputs(meta, tensors, device, fp32=s == "fp32"), meta, tensors, device)
            for s in settings]
    same = rows[[r["setting"] for r in rows].index("same")]
    if same["status"] not in ("finite", "nonfinite"):
        raise CapsuleError(f"the module could not run under its recorded settings: {same.get('note')}")
    cls, code, undecided = _verdict(rows)
    return {"undecided": undecided, "capsule": path, "fqn": meta.get("fqn"), "class_path": meta["build"]["class"], "device": device,
            "capture": meta.get("capture", {"of": "birth"}),
            "recorded": {"host": meta.get("host"), "device": meta.get("device"),
                         "incident_cls": meta.get("incident", {}).get("cls"),
                         "birth_elements": meta.get("incident", {}).get("birth_elements")},
            "dropped": meta.get("dropped", []), "rows": rows, "cls": cls, "exit": code}


def _verdict(rows: list[dict[str, Any]]) -> tuple[str, int, str | None]:
    """(class, exit code, what could not be decided) from the settings that ran, and only those: non-finite
    under ``same`` and finite under another setting is precision; non-finite under ``fp32`` too (the setting
    that decides it: the strongest precision switch) is data_mask; without ``fp32`` having run, whether a
    precision switch helps is not decided (class ``undecided``)."""
    by = {r["setting"]: r["status"] for r in rows}
    if by["same"] == "finite":
        return "not_reproducible", 1, None
    if any(v == "finite" for v in by.values()):
        return "precision", 0, None
    if by.get("fp32") == "nonfinite":
        return "data_mask", 0, None
    why = "fp32 did not run" if "fp32" not in by else f"fp32 could not run here ({by['fp32']})"
    return "undecided", 0, why


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
    lines.append(f"class    {result['cls']}: {_MEANING[result['cls']]}")
    if result["cls"] == "undecided":
        lines.append(f"         {result['undecided']}: add --try fp32 to decide it; the trainer recorded class "
                     f"{rec['incident_cls']}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="nanwatch replay", description="Re-run an incident capsule's birth module's "
                                "forward under several settings; exit 0 if the non-finite value reproduced, 1 if "
                                "not, 2 if it cannot be replayed here (a backward birth is not replayed).")
    p.add_argument("capsule", help="a .capsule file written by the trainer (NANWATCH_CAPSULE_DIR)")
    p.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    p.add_argument("--try", dest="settings", default=",".join(SETTINGS),
                   help=f"comma-separated settings (default {','.join(SETTINGS)})")
    p.add_argument("--json", action="store_true", help="print the verdict as JSON")
    a = p.parse_args(argv)
    settings = [s.strip() for s in a.settings.split(",") if s.strip()]
    unknown = [s for s in settings if s not in SETTINGS]
    if unknown:
        p.error(f"unknown settings {unknown}: choose from {','.join(SETTINGS)}")
    try:
        result = replay_capsule(a.capsule, device=a.device, settings=settings)
    except CapsuleError as e:
        print(f"nanwatch replay: {printable(str(e))}", file=sys.stderr)
        return 2
    print(json.dumps(result) if a.json else _table(result))
    return result["exit"]


if __name__ == "__main__":
    sys.exit(main())
