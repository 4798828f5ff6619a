"""The weight fingerprint: one short value per tensor of a model's weights, the same for a bit-identical
tensor in any process on any device, so that the trainer and each rollout worker can say which weights
they hold and the collector can compare them (``nanwatch.weight_sync``; docs/weight_sync.md).

    fps = nanwatch.fingerprint(model)            # or a state_dict; {"lm_head.weight": "9f3c...", ...}

How a tensor's value is made, exactly (integer arithmetic on the raw bits):

* the tensor's bytes, flattened in row-major order, are read as little-endian 32-bit words (the last one
  zero-padded): the bits, whatever the dtype;
* word ``i`` is in block ``c = i // BLOCK`` at position ``j = i % BLOCK``; each block's sum of word times
  ``m[j]`` is taken modulo 2**32, and the lane is the sum over blocks of that times ``w[c]``, modulo 2**64.
  ``m`` (the low 32 bits) and ``w`` are splitmix64 hashes of ``j`` and ``c`` with the lowest bit set (odd),
  computed on the device from ``arange``; each of the two lanes has its own seeds. Integer arithmetic wraps
  (int32, int64), and integer sums in any order are equal, so no kernel, device or chunking changes it;
* a hash of the dtype and the shape is added to each lane (so a reshape or a bit-identical cast is
  another value).

The value is the two 64-bit lanes as 32 hex digits. What it promises:

* **Exact and portable**: no floating point anywhere; the same bits give the same value on CPU and CUDA,
  in any process (tested across processes, and against a pure-Python rendering of the formula). The
  words are little-endian, as on every CPU and GPU torch runs on in practice.
* **A change confined to one 32-bit word is always detected** (any single element of a 1-, 2- or 4-byte
  dtype, so of every fp32, bf16, fp16 or fp8 weight): the word's change times an odd multiplier is not 0
  modulo 2**32, and that block sum's change times an odd weight is not 0 modulo 2**64. For the same dtype
  and shape the hash is added, a bijection, so two different lane sums never give one value.
* **Not cryptographic**: it is a linear function of the bits; someone who wants a collision can build
  one. Any other change (many elements, an 8-byte element's two words) goes unseen by chance only: about
  2**-32 per lane for a tensor of one block, far less over many blocks, both lanes needing to agree.

Cost: the tensor is read in chunks of ``chunk_elements`` words (default 4M, 16 MB of int32 temporaries
whatever the tensor's size), with one int32 multiply and one sum per word and lane; measured
against one AdamW step in docs/benchmarks.md (``nanwatch bench``). The values are read to the host once
per call (one sync): publishing weights to a rollout engine syncs anyway.

Dtypes: the value is of the bits, so a bf16 copy of fp32 weights has other values than the fp32 ones. The
returned ``Fingerprints`` is a ``dict`` that also carries each tensor's dtype and shape, which
``post_weights`` sends; the trainer's ``publish_weights`` adds ``casts``: the fingerprints of its floating
tensors as cast to each rollout dtype the way a loader casts (``.to(dtype)``, round-to-nearest-even), so
the collector compares a bf16 copy with the trainer's bf16 cast (docs/weight_sync.md).

Sharded parameters (DTensor, FSDP2): a shard is not the tensor, so by default a DTensor is refused (a
``ValueError`` naming it); ``gather=True`` fingerprints ``full_tensor()``, a collective that every rank
must call, in the same order, and that materialises each full tensor in turn on every rank.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import NamedTuple

import torch

__all__ = ["BLOCK", "DEFAULT_CHUNK_ELEMENTS", "Fingerprints", "fingerprint", "fingerprint_casts", "fingerprint_rows",
           "fingerprint_sums", "fingerprint_with_casts", "multipliers"]

#: the 32-bit words of one block (one position multiplier each): part of the definition
BLOCK = 1 << 16
#: words read per step of the walk over a tensor (a multiple of BLOCK; any multiple gives the same value)
DEFAULT_CHUNK_ELEMENTS = 1 << 22
_M64 = (1 << 64) - 1
#: the seeds of the two lanes' position (m) and block (w) multipliers
_SEEDS = ((0x243F6A8885A308D3, 0x13198A2E03707344), (0xA4093822299F31D0, 0x082EFA98EC4E6C89))


def _signed(c: int, bits: int = 64) -> int:
    c &= (1 << bits) - 1
    return c - (1 << bits) if c >> (bits - 1) else c


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _splitmix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64, wrapping modulo 2**64."""
    x = x * _signed(0x9E3779B97F4A7C15)
    x = (x ^ _shr(x, 30)) * _signed(0xBF58476D1CE4E5B9)
    x = (x ^ _shr(x, 27)) * _signed(0x94D049BB133111EB)
    return x ^ _shr(x, 31)


def multipliers(start: int, n: int, seed: int, device: torch.device | str) -> torch.Tensor:
    """The odd 64-bit multipliers of indices ``start .. start+n-1`` for ``seed``, as int64 on ``device``."""
    idx = torch.arange(start, start + n, dtype=torch.int64, device=device)
    return _splitmix(idx + _signed(seed)) | 1


class _Multipliers:
    """The position multipliers (one BLOCK per lane: the low 32 bits of ``multipliers``, as int32), made
    once per device."""

    def __init__(self) -> None:
        self.by_device: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device) -> torch.Tensor:
        m = self.by_device.get(device)
        if m is None:
            low = torch.stack([multipliers(0, BLOCK, seed, device) for seed, _ in _SEEDS]) & 0xFFFFFFFF
            m = self.by_device[device] = torch.where(low >= 1 << 31, low - (1 << 32), low).to(torch.int32)
        return m


_POSITION = _Multipliers()


def _words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, flattened row-major, as little-endian int32 words (the last one zero-padded)."""
    raw = t.detach().reshape(-1).view(torch.uint8)
    whole = raw.numel() // 4 * 4
    if whole < raw.numel():
        raw = torch.cat([raw, raw.new_zeros(4 - (raw.numel() - whole))])
    try:
        return raw.view(torch.int32)
    except RuntimeError:  # a view starting at an offset that is not a multiple of 4 bytes
        return raw.clone().view(torch.int32)


def fingerprint_sums(t: torch.Tensor, *, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> torch.Tensor:
    """The two lane sums of ``t`` (int64 ``[2]``, on ``t``'s device; no host read). ``chunk_elements``
    counts 32-bit words."""
    if chunk_elements < BLOCK or chunk_elements % BLOCK:
        raise ValueError(f"chunk_elements must be a positive multiple of {BLOCK}, got {chunk_elements}")
    words, device = _words(t), t.device
    m = _POSITION.get(device)
    total = torch.zeros(2, dtype=torch.int64, device=device)
    for start in range(0, words.numel(), chunk_elements):
        part = words[start:start + chunk_elements]
        full, rest = divmod(part.numel(), BLOCK)
        for lane, (_, block_seed) in enumerate(_SEEDS):
            per_block = []  # each block's sum of word * multiplier, modulo 2**32 (int32 wraps)
            if full:
                per_block.append((part[:full * BLOCK].view(full, BLOCK) * m[lane]).sum(dim=1, dtype=torch.int32))
            if rest:
                per_block.append((part[full * BLOCK:] * m[lane, :rest]).sum(dtype=torch.int32).reshape(1))
            sums = (torch.cat(per_block) if len(per_block) > 1 else per_block[0]).to(torch.int64) & 0xFFFFFFFF
            w = multipliers(start // BLOCK, sums.numel(), block_seed, device)
            total[lane] += (sums * w).sum()
    return total


def fingerprint_rows(tensors: Iterable[torch.Tensor], device: torch.device, *,
                     chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> torch.Tensor:
    """The lane sums of each tensor, as one int64 ``[P, 2]`` tensor on ``device`` (device ops only, no host
    read): what the replica check compares across ranks (``nanwatch.hooks.remedies.replica_check``). A row
    plus the dtype-and-shape hash is the tensor's ``fingerprint`` value; replicas compare tensors of one
    layout, so the rows alone decide. Every tensor must be on ``device`` (no copy is made here)."""
    rows = [fingerprint_sums(t, chunk_elements=chunk_elements) for t in tensors]
    return torch.stack(rows) if rows else torch.zeros((0, 2), dtype=torch.int64, device=device)


def _meta(t: torch.Tensor) -> tuple[int, int]:
    """The dtype and shape, hashed into one 64-bit value per lane."""
    digest = hashlib.blake2b(f"{t.dtype}|{tuple(t.shape)}".encode(), digest_size=16).digest()
    return int.from_bytes(digest[:8], "little"), int.from_bytes(digest[8:], "little")


def _tensors(obj: torch.nn.Module | Mapping[str, object]) -> Iterable[tuple[str, torch.Tensor]]:
    state = obj.state_dict() if isinstance(obj, torch.nn.Module) else obj
    for name, value in state.items():
        if isinstance(value, torch.Tensor):
            yield str(name), value


def _local(name: str, t: torch.Tensor, gather: bool) -> torch.Tensor:
    """``t`` itself, or a DTensor's full tensor when ``gather`` (a collective), else a ValueError."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without torch.distributed
        return t
    if isinstance(t, DTensor):
        if not gather:
            raise ValueError(f"nanwatch.fingerprint: {name!r} is sharded (DTensor): a shard is not the weights; "
                             "pass gather=True on every rank to fingerprint full_tensor()")
        return t.full_tensor()
    return t


class Fingerprints(dict[str, str]):
    """``nanwatch.fingerprint``'s answer: name -> 32 hex digits, a plain ``dict`` to every reader, that also
    carries each tensor's ``dtypes`` (torch's name: ``bfloat16``) and ``shapes``, so that the collector can
    compare a tensor with the trainer's cast to the same dtype, and name a dtype or shape no cast explains."""

    def __init__(self, values: dict[str, str], dtypes: dict[str, str], shapes: dict[str, list[int]]) -> None:
        super().__init__(values)
        self.dtypes, self.shapes = dtypes, shapes


class _Entry(NamedTuple):
    group: str
    """``""``: the tensor itself; else the dtype it was cast to."""
    name: str
    meta: tuple[int, int]
    sums: torch.Tensor


def _entry(group: str, name: str, t: torch.Tensor, chunk_elements: int) -> _Entry:
    return _Entry(group, name, _meta(t), fingerprint_sums(t, chunk_elements=chunk_elements))


def _read(entries: list[_Entry]) -> dict[str, dict[str, str]]:
    """The values by group and name; the host read happens once per device the sums are on."""
    by_device: dict[torch.device, list[int]] = {}
    for i, e in enumerate(entries):
        by_device.setdefault(e.sums.device, []).append(i)
    lanes: list[list[int]] = [[]] * len(entries)
    for found in by_device.values():
        for i, lane_sums in zip(found, torch.stack([entries[i].sums for i in found]).tolist(), strict=True):  # sync-ok: the values are returned as strings; once per call and device, at publish time, never in a step
            lanes[i] = lane_sums
    out: dict[str, dict[str, str]] = {}
    for e, lane_sums in zip(entries, lanes, strict=True):
        out.setdefault(e.group, {})[e.name] = "".join(f"{(s + m) & _M64:016x}" for s, m in
                                                     zip(lane_sums, e.meta, strict=True))
    return out


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def fingerprint_with_casts(obj: torch.nn.Module | Mapping[str, object], dtypes: Iterable[torch.dtype], *,
                           gather: bool = False,
                           chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> tuple[Fingerprints, dict[str, dict[str, str]]]:
    """``fingerprint(obj)`` and, per dtype, the fingerprints of the floating tensors of another dtype as cast
    to it the way a loader casts (``t.to(dtype)``, round-to-nearest-even; ``load_state_dict`` into a model of
    that dtype copies the same bits): what a rollout copy in that dtype holds after a right sync. One pass over
    the tensors (a sharded one is gathered once), one cast tensor alive at a time, one host read per device."""
    wanted = list(dict.fromkeys(dtypes))
    entries, dtype_of, shapes = [], {}, {}
    for name, t in _tensors(obj):
        full = _local(name, t, gather).detach()
        dtype_of[name], shapes[name] = _dtype(full), list(full.shape)
        entries.append(_entry("", name, full, chunk_elements))
        for d in wanted:
            if full.is_floating_point() and full.dtype != d:
                entries.append(_entry(str(d).removeprefix("torch."), name, full.to(d), chunk_elements))
    values = _read(entries)
    return (Fingerprints(values.get("", {}), dtype_of, shapes),
            {str(d).removeprefix("torch."): values.get(str(d).removeprefix("torch."), {}) for d in wanted})


def fingerprint(obj: torch.nn.Module | Mapping[str, object], *, gather: bool = False,
                chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> Fingerprints:
    """The weight fingerprint of every tensor of a module's ``state_dict()`` or of a state dict: name ->
    32 hex digits (module docstring), with each tensor's dtype and shape (``Fingerprints``). Non-tensor
    entries are skipped. The sums are computed on each tensor's device; the values are read to the host
    once, at the end (one sync per call). ``gather``: fingerprint sharded parameters (DTensor) whole, a
    collective every rank must join."""
    return fingerprint_with_casts(obj, (), gather=gather, chunk_elements=chunk_elements)[0]


def fingerprint_casts(obj: torch.nn.Module | Mapping[str, object], dtypes: Iterable[torch.dtype], *,
                      gather: bool = False, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> dict[str, dict[str, str]]:
    """Per dtype, the casts' fingerprints alone (``fingerprint_with_casts``)."""
    return fingerprint_with_casts(obj, dtypes, gather=gather, chunk_elements=chunk_elements)[1]
