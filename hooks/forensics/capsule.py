"""The incident capsule (issue #20): the birth module of a run's first non-finite step, in one file that
``nanwatch replay CAPSULE`` re-runs anywhere.

The drill-down (``nanwatch.hooks.forensics.rerun._drill``) re-runs the culprit micro-batch with every module
watched; it knows the birth module and the exact positional and keyword arguments of its faulting call.
This module copies them, with the module's own parameters and buffers and the CPU RNG state at the call's
start, to the CPU on the training thread (they are needed before the step moves on: the next optimizer
step changes the weights) and writes them on a background thread, in **one safetensors file**
``<dir>/<run_id>-r<rank>-s<step>-<cls>.capsule``:

- tensors ``param.<name>``, ``buffer.<name>``, ``arg.<i>[.<j>...]``, ``kwarg.<name>[.<j>...]``, ``rng.cpu``,
  ``rng.cuda.<i>``; an HF ``DynamicCache`` (or an ``EncoderDecoderCache`` of two) among the arguments as it
  stood at the call's start (``nanwatch.hooks.measure.kept_forward.freeze``): ``kwarg.past_key_values.<layer>.
  keys``/``.values`` per filled layer, an empty layer recorded as absent, rebuilt by the replay; any other
  cache class is not recorded and is named;
- the safetensors metadata (str -> str), key ``nanwatch.capsule``, holding one JSON document: format version,
  the module's class path and FQN, for HF modules ``config`` (``config.to_dict()``, its class path and the
  attention implementation) and constructor hints (``layer_idx``), for ``torch.nn`` modules the constructor
  arguments recovered from its attributes, the structure of the call's arguments (non-tensor values that
  are JSON-able; others listed as dropped), autocast and default dtype, the SDPA backend flags (which an
  ``sdpa_kernel`` context sets), torch/transformers versions, device, host, the nanwatch Incident, the size
  limit and what was dropped beyond it (each entry names the argument, its type and why), and ``digests``:
  the BLAKE2b of each tensor's raw bytes, which the replay checks before using any of them.

Nothing is pickled: a capsule is tensors plus JSON, so opening one cannot run code.

Bounds: at most ``capsule_max`` capsules per run; each under ``capsule_max_bytes`` (parameters first, then
buffers, then inputs, in call order; what does not fit is not copied and is named in the metadata). Clean
steps never reach this module: the drill-down only runs on the run's first non-finite step. Any failure
is warned about once and the incident goes on without a capsule (``Incident.capsule`` None).

A ``not_reproducible`` incident has no drill-down (the re-run is finite, there is no birth to follow): its
capsule holds the first offender's module (the incident's ``site``) with the call it received in the
re-run of the step's first kept micro-batch, the inputs training fed it with the weights guarded, so that
``nanwatch replay`` on another host runs the same call (metadata ``capture.of`` is ``first_offender``).

Not done here: object-store URLs for ``NANWATCH_CAPSULE_DIR`` (a local directory only), and a capsule for
a backward birth (the differential rerun declines a ``phase == "backward"`` incident: it re-runs forwards
only, so there is no faulting call to capture; ``nanwatch replay`` refuses such a capsule, exit 2).
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import logging
import os
import platform
import re
import secrets
import socket
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from nanwatch.hooks.measure.kept_forward import CacheAtCall, freeze
from nanwatch.readable import file_name, printable, replay_command

__all__ = ["FORMAT", "FORMATS", "MAX_HEADER_BYTES", "META_KEY", "CapsuleWriter", "capsule_settings", "digest",
           "tied_names"]

log = logging.getLogger("nanwatch")

FORMAT = "nanwatch.capsule/2"
#: the formats ``nanwatch replay`` reads: /1 has no per-tensor digests (its bytes cannot be checked)
FORMATS = ("nanwatch.capsule/1", FORMAT)
META_KEY = "nanwatch.capsule"
#: the largest safetensors header (its JSON: tensor entries and the metadata) a capsule may have; ``nanwatch
#: replay`` refuses a longer one from its 8-byte length alone, before parsing any of it. Below safetensors'
#: own 100 MB: a header of 8 MiB parses in about 0.5 s and 220 MiB, whatever JSON it holds
MAX_HEADER_BYTES = 8 << 20
_JSON_SCALARS = (type(None), bool, int, float, str)


def capsule_settings(enabled: bool | None, max_count: int | None, directory: str | None,
                     max_bytes: int | None) -> tuple[bool, int, str, int]:
    """The effective settings: the Monitor's options, else ``NANWATCH_CAPSULE`` (``0`` turns it off),
    ``NANWATCH_CAPSULE_MAX`` (default 4), ``NANWATCH_CAPSULE_DIR`` (default ``./nanwatch-capsules``),
    ``NANWATCH_CAPSULE_MAX_BYTES`` (default 256 MiB)."""
    env = os.environ
    on = enabled if enabled is not None else env.get("NANWATCH_CAPSULE", "1").strip().lower() not in (
        "0", "false", "off", "no")
    try:
        count = max_count if max_count is not None else int(env.get("NANWATCH_CAPSULE_MAX", "4"))
        limit = max_bytes if max_bytes is not None else int(env.get("NANWATCH_CAPSULE_MAX_BYTES", str(256 << 20)))
    except ValueError:
        raise ValueError("NANWATCH_CAPSULE_MAX and NANWATCH_CAPSULE_MAX_BYTES must be integers") from None
    folder = directory if directory is not None else env.get("NANWATCH_CAPSULE_DIR") or "./nanwatch-capsules"
    if "://" in str(folder):
        raise ValueError(f"NANWATCH_CAPSULE_DIR / capsule_dir {folder!r}: object-store URLs are not supported "
                         "yet; use a local directory")
    if count < 0 or limit < 4096:
        raise ValueError(f"capsule_max must be >= 0 and capsule_max_bytes >= 4096, got {count} and {limit}")
    return bool(on) and count > 0, count, os.fspath(folder), limit


def tied_names(module: torch.nn.Module) -> dict[str, str]:
    """Each parameter name that is another's (tied weights: an HF ``lm_head.weight`` that is the embedding's),
    mapped to the name ``named_parameters()`` gives it, so a replay ties them again."""
    first: dict[int, str] = {}
    tied = {}
    for n, t in module.named_parameters(remove_duplicate=False):
        if id(t) in first:
            tied[n] = first[id(t)]
        else:
            first[id(t)] = n
    return tied


def digest(t: torch.Tensor) -> str:
    """The BLAKE2b (16 bytes, hex) of a CPU tensor's raw bytes, as safetensors stores them (contiguous)."""
    raw = t.contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.blake2b(memoryview(raw), digest_size=16).hexdigest()


def _class_path(obj: Any) -> str:
    cls = obj if isinstance(obj, type) else type(obj)
    return f"{cls.__module__}:{cls.__qualname__}"


def _init_signature(cls: type) -> inspect.Signature:
    """``cls.__init__``'s signature, looking through wrappers that hide it: transformers 5.25's hub kernels
    (``kernels.use_kernelized_func``) wrap an attention class's ``__init__`` as ``new_init(self, *args,
    **kwargs)`` without ``functools.wraps``, so its parameters (``layer_idx``) are found only on the function
    the wrapper closes over."""
    fn = cls.__init__
    sig = inspect.signature(fn)
    for _ in range(4):  # wrappers of wrappers, bounded
        named = [p for p in list(sig.parameters.values())[1:] if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        cells = getattr(fn, "__closure__", None) or ()
        inner = next((c.cell_contents for c in cells if inspect.isfunction(_cell(c))), None)
        if named or inner is None:
            return sig
        fn, sig = inner, inspect.signature(inner)
    return sig


def _cell(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None


def _ctor_args(module: torch.nn.Module) -> tuple[dict[str, Any], list[str]]:
    """A ``torch.nn`` module's constructor arguments, recovered from its attributes of the same name
    (``Linear.in_features``; ``bias`` from whether the parameter exists). Returns (args, missing): a
    required argument that has no attribute is missing and the module cannot be rebuilt."""
    args: dict[str, Any] = {}
    missing: list[str] = []
    try:
        sig = _init_signature(type(module))
    except (TypeError, ValueError):
        return {}, ["<signature>"]
    for name, p in list(sig.parameters.items())[1:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or name in ("device", "dtype"):
            continue
        if hasattr(module, name):
            v = getattr(module, name)
            if isinstance(v, torch.Tensor) or v is None and name == "bias":
                v = v is not None
            elif isinstance(v, (tuple, list)):
                v = list(v) if all(isinstance(x, _JSON_SCALARS) for x in v) else None
            if isinstance(v, _JSON_SCALARS + (list,)):
                args[name] = v
                continue
        if p.default is p.empty:
            missing.append(name)
    return args, missing


def _build_info(module: torch.nn.Module) -> dict[str, Any]:
    """How ``nanwatch replay`` rebuilds the module: ``kind`` hf, nn or user."""
    info: dict[str, Any] = {"class": _class_path(module)}
    config = getattr(module, "config", None)
    mod = type(module).__module__
    if mod.startswith("transformers.") and config is not None and hasattr(config, "to_dict"):
        hints = {}
        sig = _init_signature(type(module))
        for name in sig.parameters:
            v = getattr(module, name, None)
            if name not in ("self", "config") and isinstance(v, _JSON_SCALARS) and v is not None:
                hints[name] = v
        info.update(kind="hf", config=config.to_dict(), config_class=_class_path(config),
                    attn_implementation=getattr(config, "_attn_implementation", None), hints=hints)
    elif mod.startswith("torch.nn."):
        args, missing = _ctor_args(module)
        info.update(kind="nn", args=args)
        if missing:
            info["missing"] = missing
    else:
        info.update(kind="user")
    return info


@dataclass
class _Packer:
    """The call's arguments as a JSON structure, tensors copied to the CPU within a byte budget."""

    budget: int
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)
    used: int = 0

    def tensor(self, key: str, t: torch.Tensor) -> dict[str, Any]:
        # the header entry of a tensor (its name, dtype, shape and offsets: about 80 bytes and the name) and
        # its digest in the metadata (the name again and 32 hex digits, escaped once more)
        need = t.numel() * t.element_size() + 3 * len(key) + 160
        if self.used + need > self.budget:
            self.dropped.append(f"{key} ({tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}, "
                                f"{t.numel() * t.element_size()} bytes)")
            return {"tensor": key, "dropped": True}
        self.used += need
        # a copy of its own (safetensors refuses tensors that share storage), contiguous, on the CPU
        self.tensors[key] = t.detach().to("cpu", copy=True).contiguous()
        return {"tensor": key}

    def pack(self, key: str, x: Any) -> dict[str, Any]:
        if isinstance(x, torch.Tensor):
            return self.tensor(key, x)
        if not isinstance(x, CacheAtCall):
            x = freeze((x,), {})[0][0]  # an HF cache handed over as it stands: its state now
        if isinstance(x, CacheAtCall):
            return self.cache(key, x)
        if isinstance(x, _JSON_SCALARS):
            return {"value": x}
        if isinstance(x, torch.dtype):
            return {"dtype": str(x).removeprefix("torch.")}
        if isinstance(x, (tuple, list)):
            return {"seq": [self.pack(f"{key}.{i}", v) for i, v in enumerate(x)], "tuple": isinstance(x, tuple)}
        if isinstance(x, dict) and all(isinstance(k, str) for k in x):
            return {"dict": {k: self.pack(f"{key}.{k}", v) for k, v in x.items()}}
        return self.drop(key, _class_path(x), "not a tensor nor JSON")

    def drop(self, key: str, cls: str, why: str) -> dict[str, Any]:
        """An argument not recorded: named (which argument, which type, why) here and in the metadata."""
        self.dropped.append(f"{key} ({cls}: {why})")
        return {"dropped": cls, "name": key, "why": why}

    def cache(self, key: str, c: CacheAtCall) -> dict[str, Any]:
        """An HF cache as it stood at the call's start: its layers' keys and values (an empty layer as
        absent), rebuilt by ``nanwatch replay`` from an allow-list of cache classes; any other cache is dropped
        and named."""
        if c.state is None:
            return self.drop(key, c.cls, c.why)
        return {"cache": self._cache_state(key, c.state)}

    def _cache_state(self, key: str, state: dict[str, Any]) -> dict[str, Any]:
        if "layers" not in state:  # an EncoderDecoderCache: its two DynamicCaches
            return {**state, "self": self._cache_state(f"{key}.self", state["self"]),
                    "cross": self._cache_state(f"{key}.cross", state["cross"])}
        layers = []
        for i, row in enumerate(state["layers"]):
            row = dict(row)
            for part in ("keys", "values"):
                if row[part] is not None:
                    row[part] = self.tensor(f"{key}.{i}.{part}", row[part])
            layers.append(row)
        return {**state, "layers": layers}


#: the user hooks a capsule names at most (it never carries them: they are code)
MAX_HOOKS = 16


def _hook_name(fn: Any) -> str | None:
    """A hook's printable name, or None when it is nanwatch's own (they measure; they never change a value)."""
    inner = getattr(fn, "func", fn)  # functools.partial
    owner = getattr(inner, "__self__", None)  # a bound method: its class's module
    module = type(owner).__module__ if owner is not None else getattr(inner, "__module__", "") or ""
    if module == "nanwatch" or module.startswith("nanwatch."):
        return None
    return f"{module}.{getattr(inner, '__qualname__', type(inner).__name__)}"[:200]


def user_hooks(module: torch.nn.Module) -> list[str]:
    """The forward hooks and pre-hooks on ``module`` and inside it that are not nanwatch's, as
    ``"<submodule>: <pre-hook|hook> <name>"``: a capsule cannot carry them, and one that changes what the module
    returns (a fault injector, a scaler) makes the replay finite where training was not."""
    found = []
    for sub, m in module.named_modules():
        for kind, hooks in (("pre-hook", m._forward_pre_hooks), ("hook", m._forward_hooks)):
            for fn in hooks.values():
                name = _hook_name(fn)
                if name is not None and len(found) < MAX_HOOKS:
                    found.append(f"{sub or '.'}: {kind} {name}")
    return found


def _sdpa_flags() -> dict[str, bool]:
    b = torch.backends.cuda
    flags = {"flash": b.flash_sdp_enabled(), "efficient": b.mem_efficient_sdp_enabled(),
             "math": b.math_sdp_enabled()}
    if hasattr(b, "cudnn_sdp_enabled"):
        flags["cudnn"] = b.cudnn_sdp_enabled()
    return flags


def _versions() -> dict[str, str]:
    out = {"torch": torch.__version__, "python": platform.python_version()}
    try:
        from importlib.metadata import version

        out["transformers"] = version("transformers")
        out["nanwatch"] = version("nanwatch")
    except Exception:  # noqa: BLE001 - versions are informative
        pass
    return out


def _write_new(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file this call creates itself (``O_EXCL | O_NOFOLLOW``, a
    random name, mode 0600), then an atomic rename: in a shared capsule folder a planted link at a predictable
    temporary name would have had the trainer write through it into any file its user can write; and readers
    never see half a capsule."""
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0),
                 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


class CapsuleWriter:
    """Writes up to ``max_count`` capsules per run, one per incident class, each on a background thread."""

    def __init__(self, *, run_id: str, rank: int, directory: str, max_count: int, max_bytes: int) -> None:
        # absolute: the report names the file for someone on another machine, not relative to a cwd
        self.run_id, self.rank, self.directory = run_id, rank, os.path.abspath(directory)
        self.max_count, self.max_bytes = max_count, max_bytes
        self.written = 0
        self._classes: set[str] = set()
        self._threads: list[threading.Thread] = []
        self._warned = False

    def wants(self, cls: str) -> bool:
        return self.written < self.max_count and cls not in self._classes

    def capture(self, *, incident: Any, name: str, module: torch.nn.Module, args: tuple, kwargs: dict,
                rng: torch.Tensor | None, cuda_rng: dict[int, torch.Tensor] | None = None,
                of: dict[str, Any] | None = None) -> str | None:
        """Copy the faulting call to the CPU now, write the file later; the path it will have (None: not
        captured). ``of`` says which call it is (metadata ``capture``: ``{"of": "birth"}``, the drill-down's
        birth module; ``{"of": "first_offender", ...}``, a not-reproducible incident's first offender in the
        re-run). Never raises."""
        if not self.wants(incident.cls):
            return None
        try:
            path, tensors, meta = self._prepare(incident, name, module, args, kwargs, rng, cuda_rng or {},
                                                of or {"of": "birth"})
        except Exception as exc:  # noqa: BLE001 - monitoring must not break the step
            self._warn(f"capsule not captured: {type(exc).__name__}: {exc}")
            return None
        return self._submit(incident.cls, path, tensors, meta)

    def capture_model(self, *, kind: str, step: int, model: torch.nn.Module, inputs: dict[str, torch.Tensor],
                      extra: dict[str, Any]) -> str | None:
        """A capsule of a whole model (its config and state, tied parameters named once) with named input
        tensors, for a replay that redoes a computation on it (``kind``: ``attribution``, the rollout
        attribution, ``nanwatch.hooks.rollout.attribution``). The inputs first; the state only when all of
        it fits the size limit (a partial state redoes nothing: it is then named as not recorded and the
        replay refuses, exit 2). ``extra``: JSON merged into the metadata. Never raises."""
        if not self.wants(kind):
            return None
        try:
            path = self._path(step, kind)
            device = next((str(t.device) for t in model.parameters()), "cpu")
            meta: dict[str, Any] = {
                "format": FORMAT, "kind": kind, "fqn": "", "build": _build_info(model), "training": False,
                "device": device, "host": socket.gethostname(), "rank": self.rank, "run_id": self.run_id,
                "versions": _versions(), "max_bytes": self.max_bytes, "step": int(step), **extra}
            p = _Packer(budget=max(0, self.max_bytes - 2 * len(json.dumps(meta, default=str)) - (16 << 10)))
            meta["inputs"] = {k: p.tensor(f"input.{k}", t)["tensor"] for k, t in inputs.items()}
            state = [(f"param.{n}", t) for n, t in model.named_parameters()]
            state += [(f"buffer.{n}", t) for n, t in model.named_buffers()]
            need = sum(t.numel() * t.element_size() + 3 * len(k) + 160 for k, t in state)
            if p.used + need <= p.budget:
                for k, t in state:
                    p.tensor(k, t)
            else:
                p.dropped.append(f"the model's state ({need} bytes: over capsule_max_bytes {self.max_bytes})")
            meta["params"] = [k for k, _ in state if k.startswith("param.") and k in p.tensors]
            meta["buffers"] = [k for k, _ in state if k.startswith("buffer.") and k in p.tensors]
            meta["tied"] = tied_names(model)
            meta["dropped"] = p.dropped
        except Exception as exc:  # noqa: BLE001 - monitoring must not break the step
            self._warn(f"capsule not captured: {type(exc).__name__}: {exc}")
            return None
        return self._submit(kind, path, p.tensors, meta)

    def _submit(self, cls: str, path: str, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> str:
        self.written += 1
        self._classes.add(cls)
        t = threading.Thread(target=self._write, args=(path, tensors, meta), name="nanwatch-capsule", daemon=True)
        self._threads.append(t)
        t.start()
        return path

    def _path(self, step: int, cls: str) -> str:
        # injective in the run id (percent-encoded: runs ``grpo:0412`` and ``grpo_0412`` get files of their own)
        fname = f"{file_name(self.run_id, room=160)}-r{int(self.rank)}-s{int(step)}-{file_name(cls, room=40)}.capsule"
        path = os.path.join(self.directory, fname)
        if len(path) > 1024 or re.search(r"[\x00-\x1f\x7f]", path):  # Incident.capsule's wire bounds
            raise ValueError(f"the capsule path is over 1024 characters or has control characters: {path[:80]!r}...")
        # on this thread, once: an unwritable folder means no capsule, not a report naming a file never written
        os.makedirs(self.directory, exist_ok=True)
        if not os.access(self.directory, os.W_OK):
            raise PermissionError(f"{self.directory} is not writable")
        return path

    def _prepare(self, incident, name, module, args, kwargs, rng, cuda_rng, of):
        path = self._path(incident.step, incident.cls)
        device = next((str(t.device) for t in (*module.parameters(), *module.buffers())), None)
        first = next((x for x in (*args, *kwargs.values()) if isinstance(x, torch.Tensor)), None)
        device = device or (str(first.device) if first is not None else "cpu")
        dev_type = torch.device(device).type
        meta: dict[str, Any] = {
            "format": FORMAT, "fqn": name, "build": _build_info(module), "training": module.training,
            "device": device, "host": socket.gethostname(), "rank": self.rank, "run_id": self.run_id,
            "versions": _versions(), "default_dtype": str(torch.get_default_dtype()).removeprefix("torch."),
            "autocast": {"enabled": torch.is_autocast_enabled(dev_type) if dev_type in ("cpu", "cuda") else False,
                         "dtype": str(torch.get_autocast_dtype(dev_type)).removeprefix("torch.")
                         if dev_type in ("cpu", "cuda") else None, "device_type": dev_type},
            "sdpa": _sdpa_flags(), "max_bytes": self.max_bytes, "capture": of, "hooks": user_hooks(module),
            "incident": incident.model_dump(mode="json"),
        }
        # the header's JSON (escaped once more as a metadata string) and its framing stay inside the limit
        reserve = 2 * len(json.dumps(meta, default=str)) + (16 << 10)
        p = _Packer(budget=max(0, self.max_bytes - reserve))
        meta["params"] = [p.tensor(f"param.{n}", t)["tensor"] for n, t in module.named_parameters(recurse=True)]
        meta["buffers"] = [p.tensor(f"buffer.{n}", t)["tensor"] for n, t in module.named_buffers(recurse=True)]
        meta["args"] = [p.pack(f"arg.{i}", a) for i, a in enumerate(args)]
        meta["kwargs"] = {k: p.pack(f"kwarg.{k}", v) for k, v in kwargs.items()}
        if rng is not None:
            p.tensor("rng.cpu", rng)
        for i, s in cuda_rng.items():
            p.tensor(f"rng.cuda.{i}", s)
        meta["params"] = [k for k in meta["params"] if k in p.tensors]
        meta["buffers"] = [k for k in meta["buffers"] if k in p.tensors]
        meta["dropped"] = p.dropped
        return path, p.tensors, meta

    def _write(self, path: str, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        try:
            from safetensors.torch import save

            meta["digests"] = {k: digest(t) for k, t in tensors.items()}  # checked before a replay uses them
            data = save(tensors, metadata={META_KEY: json.dumps(meta, default=str)})
            size, header = len(data), int.from_bytes(data[:8], "little")
            if size > self.max_bytes or header > MAX_HEADER_BYTES:  # never leave a file beyond a limit
                raise RuntimeError(f"{size} bytes would exceed capsule_max_bytes {self.max_bytes}"
                                   if size > self.max_bytes else f"its header ({header} bytes) would exceed "
                                   f"the {MAX_HEADER_BYTES}-byte limit nanwatch replay reads")
            _write_new(path, data)
            dropped = meta["dropped"]
            log.warning("nanwatch: incident capsule written: %s (%d bytes%s); replay it: %s", printable(path),
                        size, f"; {len(dropped)} not recorded: {'; '.join(dropped[:4])}{'; ...' if len(dropped) > 4 else ''}"
                        if dropped else "", replay_command({"capsule": path, "cls": meta.get("incident", {}).get("cls")},
                                       device=torch.device(meta["device"]).type))
        except Exception as exc:  # noqa: BLE001 - the writer thread must not die loudly
            self._warn(f"capsule {path} not written: {type(exc).__name__}: {exc}")

    def _warn(self, msg: str) -> None:
        if not self._warned:
            self._warned = True
            log.warning("nanwatch: %s (training goes on)", msg)

    def join(self, timeout: float = 30.0) -> None:
        """Wait (bounded) for the capsules being written: at close, and in tests."""
        for t in self._threads:
            t.join(timeout)
