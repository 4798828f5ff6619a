"""Replaying an incident capsule: re-run its birth module under several settings, anywhere (the command,
``nanwatch replay CAPSULE``, is ``nanwatch.cli.replay_verdict``).

The capsule (``nanwatch.hooks.forensics.capsule``) is a safetensors file; it is checked to be one (its 8-byte header
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

import contextlib
import copy
import importlib
import json
import os
import re
import signal
import struct
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

from nanwatch.hooks.forensics.capsule import FORMATS, MAX_HEADER_BYTES, META_KEY, digest
from nanwatch.hooks.measure.kept_forward import build_cache

__all__ = ["Bounds", "CapsuleError", "SETTINGS", "call_inputs", "offline", "open_capsule", "rebuild", "replay_capsule"]

SETTINGS = ("same", "fp32", "math", "flash", "efficient", "cudnn")
_MAX_HEADER = MAX_HEADER_BYTES  # below safetensors' own 100 MB: refused from the 8-byte length, unparsed
_ALLOWED = ("transformers.", "torch.nn.")
_DEPTH = 32  # nesting of the metadata's specs and configs: a real capsule needs a handful
_LAYERS = re.compile(r"(^|_)(layers?|n_layer|depth)$")  # config sizes that repeat a block


class Bounds(NamedTuple):
    """What a capsule may ask rebuilding for, checked before anything is allocated (``--max-params``,
    ``--max-bytes``, ``--max-build-s``); ``fp32``: the fp32 setting's float32 copy is counted too.
    ``max_run_s`` (``--max-run-s``): what running it may take, counted before it runs for an attribution
    capsule (its sequences' count × length, at :data:`ASSUMED_FLOPS`; one forward's activations against
    ``max_bytes`` too), and a timer on every run."""
    max_params: int = 1 << 28
    max_bytes: int = 2 << 30
    max_build_s: float = 120.0
    fp32: bool = True
    max_run_s: float = 300.0


#: the rate an attribution's FLOPs are counted at against ``--max-run-s``. CPU: below what a 2-core AMD EPYC VM
#: (torch 2.13 CPU) measured redoing the tiny Qwen3's attribution (3.3e9 to 5.5e9 FLOP/s at 8-32 sequences of
#: 1,024-2,048 tokens: the lowered forwards run in bf16, slow on a CPU); CUDA: an assumption, not measured. A
#: faster host, or a capsule worth the wait, raises ``--max-run-s``
ASSUMED_FLOPS = {"cpu": 2e9, "cuda": 1e13}


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
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, RecursionError):
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


def offline() -> None:
    """No Hub, no network for the whole replay: offline mode set before transformers is imported (and forced
    in huggingface_hub's constants when something imported it already)."""
    os.environ["HF_HUB_OFFLINE"] = os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
    hub = sys.modules.get("huggingface_hub.constants")
    if hub is not None:
        hub.HF_HUB_OFFLINE = True


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise CapsuleError(f"malformed capsule: {what}")


def _is_dtype(name: Any) -> bool:
    import torch

    return isinstance(name, str) and isinstance(getattr(torch, name, None), torch.dtype)


def _check_json(x: Any, where: str, depth: int = 0) -> None:
    _need(depth <= _DEPTH, f"{where} is nested deeper than {_DEPTH}")
    if isinstance(x, dict):
        for k, v in x.items():
            _check_json(v, f"{where}.{k}", depth + 1)
    elif isinstance(x, list):
        for v in x:
            _check_json(v, where, depth + 1)


def _check_spec(spec: Any, tensors: dict[str, Any], where: str, depth: int = 0) -> None:
    """A recorded argument: one of the shapes the trainer writes, its tensors present, nested at most _DEPTH."""
    _need(depth <= _DEPTH, f"{where} is nested deeper than {_DEPTH}")
    _need(isinstance(spec, dict), f"{where} is not an object")
    if "tensor" in spec:
        _need(bool(spec.get("dropped")) or spec["tensor"] in tensors, f"{where}: tensor {spec['tensor']!r} is missing")
    elif "value" in spec:
        _check_json(spec["value"], where, depth)
    elif "dtype" in spec:
        _need(_is_dtype(spec["dtype"]), f"{where}: dtype {spec['dtype']!r} is not a torch dtype")
    elif "seq" in spec:
        _need(isinstance(spec["seq"], list), f"{where}.seq is not a list")
        for i, s in enumerate(spec["seq"]):
            _check_spec(s, tensors, f"{where}[{i}]", depth + 1)
    elif "dict" in spec:
        _need(isinstance(spec["dict"], dict), f"{where}.dict is not an object")
        for k, s in spec["dict"].items():
            _check_spec(s, tensors, f"{where}.{k}", depth + 1)
    elif "cache" in spec:
        _check_json(spec["cache"], where, depth)


def _check_build(build: Any) -> None:
    _need(isinstance(build, dict), "'build' is missing or not an object")
    _need(isinstance(build.get("class"), str), "build.class is not a class path")
    if build.get("kind") == "hf":
        _need(isinstance(build.get("config_class"), str), "build.config_class is not a class path")
        _need(isinstance(build.get("config"), dict), "build.config is not an object")
        _need(isinstance(build.get("hints", {}), dict), "build.hints is not an object")
        _need(isinstance(build.get("attn_implementation") or "", str), "build.attn_implementation is not a string")
        _check_json(build["config"], "build.config")
        _check_config(build["config"])
    elif build.get("kind") == "nn":
        _need(isinstance(build.get("args", {}), dict), "build.args is not an object")
        _need(isinstance(build.get("missing", []), list), "build.missing is not a list")
        _check_json(build.get("args", {}), "build.args")


def _check_config(cfg: dict[str, Any], where: str = "config") -> None:
    """No remote code and nothing fetched by name: an ``auto_map`` or ``trust_remote_code`` anywhere is refused,
    a backbone named for loading (an HF checkpoint, or timm with pretrained weights) too; a capsule carries the
    module's own weights, so ``use_pretrained_backbone`` is forced off."""
    for k, v in cfg.items():
        _need(k != "auto_map", f"{where}.auto_map names remote code ({str(v)[:80]}): a capsule is data, never code")
        _need(not (k == "trust_remote_code" and v), f"{where}.trust_remote_code is set: never honoured here")
        if isinstance(v, dict):
            _check_config(v, f"{where}.{k}")
    if "use_pretrained_backbone" in cfg:
        cfg["use_pretrained_backbone"] = False
    if cfg.get("backbone") and not cfg.get("use_timm_backbone"):
        raise CapsuleError(f"{where}.backbone {str(cfg['backbone'])[:80]!r} names a checkpoint to load from the "
                           "Hub: a capsule is rebuilt offline from its own weights only")


def check_meta(meta: dict[str, Any], tensors: dict[str, Any]) -> None:
    """The metadata's shape, before any of it is used: CapsuleError (exit 2) naming the first thing wrong."""
    _check_build(meta.get("build"))
    for field in ("params", "buffers", "dropped", "args", "hooks"):
        _need(isinstance(meta.get(field, []), list), f"'{field}' is not a list")
    _need(all(isinstance(h, str) for h in meta.get("hooks", [])), "'hooks' holds something other than names")
    for key in (*meta.get("params", []), *meta.get("buffers", [])):
        _need(isinstance(key, str) and key.startswith(("param.", "buffer.")), f"{str(key)[:80]!r} is not a "
              "module tensor's name")
        _need(key in tensors, f"tensor {key} is missing")
    _need(isinstance(meta.get("kwargs", {}), dict), "'kwargs' is not an object")
    for i, spec in enumerate(meta.get("args", [])):
        _check_spec(spec, tensors, f"args[{i}]")
    for k, spec in meta.get("kwargs", {}).items():
        _check_spec(spec, tensors, f"kwargs.{k}")
    for field in ("incident", "autocast", "sdpa", "capture"):
        _need(isinstance(meta.get(field, {}), dict), f"'{field}' is not an object")
    dtype = meta.get("autocast", {}).get("dtype")
    _need(dtype is None or _is_dtype(dtype), f"autocast.dtype {str(dtype)[:40]!r} is not a torch dtype")
    for k, t in tensors.items():
        if k.startswith("rng."):
            _need(re.fullmatch(r"rng\.(cpu|cuda\.\d{1,3})", k) is not None, f"{k} is not an RNG state's name")
            _need(t.dtype.is_floating_point is False and t.dim() == 1 and t.element_size() == 1,
                  f"{k} is not an RNG state (a 1-D uint8 tensor): {str(t.dtype).removeprefix('torch.')}")


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


class _BuildTimeout(BaseException):
    """Raised by the build timer; a BaseException so that no ``except Exception`` in a constructor swallows it."""


@contextlib.contextmanager
def _deadline(seconds: float, what: str = "building the module", flag: str = "--max-build-s") -> Iterator[None]:
    """Abort ``what`` after ``seconds`` of wall time (a SIGALRM timer: the main thread only, else unbounded)."""
    if seconds <= 0 or not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def fire(signum, frame):
        raise _BuildTimeout

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    except _BuildTimeout:
        raise CapsuleError(f"{what} took over {seconds:g} s ({flag}): stopped; raise {flag} to let it") from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _size(module, fp32: bool) -> tuple[int, int]:
    """(parameters, bytes) of a module built on the meta device; the fp32 setting's float32 copy counted."""
    ts = [*module.parameters(), *module.buffers()]
    extra = sum(t.numel() * 4 for t in ts if t.is_floating_point()) if fp32 else 0
    return sum(t.numel() for t in module.parameters()), sum(t.numel() * t.element_size() for t in ts) + extra


def _layer_keys(cfg: dict[str, Any], path: tuple = ()) -> list[tuple]:
    keys = []
    for k, v in cfg.items():
        if isinstance(v, dict):
            keys += _layer_keys(v, (*path, k))
        elif isinstance(v, int) and not isinstance(v, bool) and v > 2 and _LAYERS.search(k):
            keys.append((*path, k))
    return keys


def _with(cfg: dict[str, Any], values: dict[tuple, int]) -> dict[str, Any]:
    out = copy.deepcopy(cfg)
    for path, v in values.items():
        d = out
        for k in path[:-1]:
            d = d[k]
        d[path[-1]] = v
    return out


def _estimate(make, cfg: dict[str, Any], fp32: bool) -> tuple[int, int]:
    """(parameters, bytes) of ``make(cfg)`` from builds with each repeated block at one and two layers (on the
    meta device), extrapolated linearly: a config asking for 10^6 layers is counted without building them."""
    keys = _layer_keys(cfg)
    base = _size(make(_with(cfg, dict.fromkeys(keys, 1))), fp32)
    n, b = base
    for key in keys:
        two = _size(make(_with(cfg, {**dict.fromkeys(keys, 1), key: 2})), fp32)
        d = cfg
        for k in key:
            d = d[k]
        n, b = n + (d - 1) * max(0, two[0] - base[0]), b + (d - 1) * max(0, two[1] - base[1])
    return n, b


def _within(n: int, nbytes: int, bounds: Bounds, cls: str) -> None:
    if n > bounds.max_params:
        raise CapsuleError(f"{cls} would have {n:,} parameters, over --max-params {bounds.max_params:,}: refused "
                           "before it is allocated")
    if nbytes > bounds.max_bytes:
        raise CapsuleError(f"{cls} would take {nbytes:,} bytes (the fp32 setting's copy included), over --max-bytes "
                           f"{bounds.max_bytes:,}: refused before it is allocated")


def _maker(build: dict[str, Any], cls: type):
    """A function building the module from a config dict (HF) or the recorded constructor arguments (nn)."""
    if build.get("kind") == "hf":
        cfg_cls = _import(build["config_class"], "config class")

        def make(cfg: dict[str, Any]):
            config = cfg_cls.from_dict(cfg)
            if build.get("attn_implementation"):
                config._attn_implementation = build["attn_implementation"]
            return cls(config, **build.get("hints", {}))

        return make, build["config"]
    if build.get("kind") == "nn":
        if build.get("missing"):
            raise CapsuleError(f"{build['class']}: constructor arguments {build['missing']} were not recoverable")
        return (lambda args: cls(**args)), build.get("args", {})
    raise CapsuleError(f"cannot rebuild {build['class']}: not recorded as an HF or torch.nn module")


def _checked_build(build: dict[str, Any], cls: type, meta: dict[str, Any], bounds: Bounds):
    """Count on the meta device (estimated from one and two layers, then exactly), check the names the capsule
    sets exist in the module, and only then build it for real; all under the build timer."""
    import torch

    make, cfg = _maker(build, cls)
    with _deadline(bounds.max_build_s):
        try:
            with torch.device("meta"):
                _within(*_estimate(make, cfg, bounds.fp32), bounds, build["class"])
                shadow = make(cfg)
        except CapsuleError:
            raise
        except Exception as e:  # noqa: BLE001 - arguments this class refuses: exit 2, one line
            raise CapsuleError(f"{build['class']} cannot be built from the capsule's arguments: "
                               f"{type(e).__name__}: {e}") from None
        _within(*_size(shadow, bounds.fp32), bounds, build["class"])
        names = {f"param.{n}" for n, _ in shadow.named_parameters()} | {f"buffer.{n}" for n, _ in
                                                                          shadow.named_buffers()}
        names |= {f"param.{n}" for n, _ in shadow.named_parameters(remove_duplicate=False)}
        tied = meta.get("tied", {})
        _need(isinstance(tied, dict), "'tied' is not an object")
        stray = [k for k in (*meta.get("params", []), *meta.get("buffers", []),
                             *(f"param.{n}" for pair in tied.items() for n in pair)) if k not in names]
        if stray:
            raise CapsuleError(f"tensor {stray[0]} is not one of {build['class']}'s parameters or buffers")
        return make(cfg)


def rebuild(meta: dict[str, Any], tensors: dict[str, Any], bounds: Bounds | None = None):
    """The birth module, built from the capsule's class path and config or constructor arguments, with the
    recorded parameters and buffers (their dtypes as recorded); within ``bounds``, checked before anything
    is allocated."""
    import torch

    check_meta(meta, tensors)
    bounds = bounds or Bounds()
    build = meta["build"]
    cls = _import(build["class"], "module class")
    if not issubclass(cls, torch.nn.Module):
        raise CapsuleError(f"{build['class']} is not a torch.nn.Module")
    dropped = [d for d in meta.get("dropped", []) if str(d).startswith(("param.", "buffer."))]
    if dropped:
        raise CapsuleError(f"the capsule's size limit ({meta.get('max_bytes')} bytes) dropped {len(dropped)} of the "
                           f"module's tensors ({dropped[0]}, ...): it cannot be replayed faithfully")
    module = _checked_build(build, cls, meta, bounds)
    for key in meta.get("params", []):
        _set(module, key.removeprefix("param."), tensors[key], param=True)
    for key in meta.get("buffers", []):
        _set(module, key.removeprefix("buffer."), tensors[key], param=False)
    for alias, name in meta.get("tied", {}).items():  # tied weights: one parameter again, as recorded
        *parents, leaf = alias.split(".")
        module.get_submodule(".".join(parents))._parameters[leaf] = module.get_parameter(name)
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


def replay_capsule(path: str, *, device: str = "cpu", settings: Sequence[str] = SETTINGS,
                   bounds: Bounds | None = None) -> dict[str, Any]:
    """The verdict of replaying a capsule: rows per setting, the class, the exit code. CapsuleError when it
    cannot be replayed (offline: nothing it names is fetched)."""
    offline()
    import torch

    meta, tensors = open_capsule(path)
    check_meta(meta, tensors)
    if meta.get("kind") == "attribution":
        return _redo_attribution(path, meta, tensors, device, bounds or Bounds())
    incident = meta.get("incident") if isinstance(meta.get("incident"), dict) else {}
    if incident.get("phase") == "backward":
        raise CapsuleError(_BACKWARD)
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise CapsuleError("--device cuda: no CUDA device on this host")
    try:
        module = rebuild(meta, tensors, bounds or Bounds(fp32="fp32" in settings)).to(device)
    except CapsuleError:
        raise
    except Exception as e:  # noqa: BLE001 - a constructor that fails here: say so, exit 2
        raise CapsuleError(f"rebuilding {meta['build'].get('class')} failed: {type(e).__name__}: {e}") from None
    call_inputs(meta, tensors, device)  # an input that cannot be rebuilt: exit 2 before anything runs
    if "same" not in settings:
        settings = ["same", *settings]
    with _deadline(bounds.max_run_s if bounds else Bounds().max_run_s, "running the settings", "--max-run-s"):
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
            "dropped": meta.get("dropped", []), "hooks": meta.get("hooks", []), "rows": rows, "cls": cls,
            "exit": code}


def _redo_attribution(path: str, meta: dict[str, Any], tensors: dict[str, Any], device: str, bounds: Bounds
                      ) -> dict[str, Any]:
    """An attribution capsule (``nanwatch.hooks.rollout.attribution``): the model rebuilt from its config and
    state, the attribution redone on the recorded sequences; exit 0 when it names the recorded module, 1 when
    it names another here."""
    import torch

    from nanwatch.hooks.rollout.attribution import attribute_mismatch

    inputs, recorded = meta.get("inputs"), meta.get("attribution")
    _need(isinstance(inputs, dict) and all(isinstance(k, str) and v in tensors for k, v in inputs.items())
          and {"input_ids", "rollout_logprobs"} <= set(inputs), "'inputs' does not name the recorded sequences")
    _need(isinstance(recorded, dict), "'attribution' is not an object")
    _need(_is_dtype(meta.get("rollout_dtype")), f"rollout_dtype {str(meta.get('rollout_dtype'))[:40]!r} is not a "
          "torch dtype")
    temperature = meta.get("temperature", 1.0)
    _need(isinstance(temperature, (int, float)) and 0 < temperature < float("inf"), "temperature is not positive")
    if not meta.get("params"):
        raise CapsuleError(f"the model's state was not recorded ({'; '.join(map(str, meta.get('dropped', [])))[:200]}):"
                           " the attribution cannot be redone")
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise CapsuleError("--device cuda: no CUDA device on this host")
    try:
        model = rebuild(meta, tensors, bounds).to(device)
    except CapsuleError:
        raise
    except Exception as e:  # noqa: BLE001 - a constructor that fails here: say so, exit 2
        raise CapsuleError(f"rebuilding {meta['build'].get('class')} failed: {type(e).__name__}: {e}") from None
    _within_run(model, tensors[inputs["input_ids"]], tensors[inputs["rollout_logprobs"]],
                "trainer_logprobs" in inputs, device, bounds)
    ins = {k: tensors[v].to(device) for k, v in inputs.items()}
    with _deadline(bounds.max_run_s, "redoing the attribution", "--max-run-s"):
        redone = attribute_mismatch(
            model, ins["input_ids"], ins["rollout_logprobs"], attention_mask=ins.get("attention_mask"),
            completion_mask=ins.get("completion_mask"), trainer_logprobs=ins.get("trainer_logprobs"),
            rollout_dtype=getattr(torch, meta["rollout_dtype"]), temperature=float(temperature),
            cause=str(recorded.get("cause", "drift")), step=int(meta.get("step", 0)),
            max_sequences=int(ins["input_ids"].shape[0]))
    same = redone.module == recorded.get("module")
    return {"kind": "attribution", "capsule": path, "device": device, "module": redone.module,
            "recorded_module": recorded.get("module"), "same": same, "attribution": redone.model_dump(mode="json"),
            "recorded": {"host": meta.get("host"), "device": meta.get("device"), "step": meta.get("step")},
            "exit": 0 if same else 1}


def _within_run(model, ids, rollout, trainer_logprobs: bool, device: str, bounds: Bounds) -> None:
    """The recorded sequences' count × length against ``--max-run-s`` (FLOPs at :data:`ASSUMED_FLOPS`) and one
    forward's activations against ``--max-bytes``: CapsuleError (exit 2, one line) before anything runs."""
    import torch

    from nanwatch.hooks.rollout.attribution import attribution_cost

    _need(ids.dim() == 2 and rollout.dim() == 2 and rollout.shape[0] == ids.shape[0]
          and rollout.shape[1] <= ids.shape[1], "the recorded sequences' shapes do not match")
    n, length = ids.shape
    cost = attribution_cost(model, sequences=n, length=length, completion=rollout.shape[1],
                            trainer_logprobs=trainer_logprobs)
    dev = torch.device(device).type
    rate = ASSUMED_FLOPS.get(dev, ASSUMED_FLOPS["cpu"])
    what = f"redoing the attribution on {n:,} sequences x {length:,} tokens ({cost.forwards} forwards)"
    if cost.flops > bounds.max_run_s * rate:
        raise CapsuleError(f"{what} would take about {cost.flops / rate:,.0f} s ({cost.flops:.3g} FLOPs at "
                           f"{rate:.0e} FLOP/s on {dev}), over --max-run-s {bounds.max_run_s:g}: refused before "
                           "it runs; raise --max-run-s to run it")
    if cost.activation_bytes > bounds.max_bytes:
        raise CapsuleError(f"{what} would hold {cost.activation_bytes:,} bytes of activations in one forward, over "
                           f"--max-bytes {bounds.max_bytes:,}: refused before it runs; raise --max-bytes to run it")


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
