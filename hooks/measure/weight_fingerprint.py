"""The weight fingerprint: one short value per tensor of a model's weights, the same for a bit-identical
tensor in any process on any device, so that the trainer and each rollout worker can say which weights
they hold and the collector can compare them (``nanwatch.weight_sync``; docs/weight_sync.md).

    fps = nanwatch.fingerprint(model)            # or a state_dict; {"lm_head.weight": "9f3c...", ...}

How a tensor's value is made, exactly (integer arithmetic on the raw bits, modulo 2**64):

* the tensor, flattened in row-major order, is viewed as the signed integer dtype of its element size
  (``int8``/``int16``/``int32``/``int64``: the bits, not the values) and widened to ``int64``;
* element ``i`` is weighted by an odd multiplier: block ``c = i // BLOCK`` and position ``j = i % BLOCK``
  give ``w[c] * m[j]``, where ``w`` and ``m`` are splitmix64 hashes of ``c`` and ``j`` with the lowest bit
  set, computed on the device from ``arange``; each of the two lanes has its own seeds;
* each lane is the sum of the weighted elements modulo 2**64 (int64 arithmetic wraps; integer addition in
  any order gives the same sum, so no kernel, device or chunking changes it), plus a hash of the dtype and
  the shape (so a reshape or a bit-identical cast is another value).

The value is two 64-bit lanes as 32 hex digits. What it promises:

* **Exact and portable**: no floating point anywhere; the same bits give the same value on CPU and CUDA,
  in any process (tested across processes, and against a pure-Python rendering of the formula).
* **A change to any single element is always detected**, and a change to any elements of one block
  whose weighted differences do not cancel modulo 2**64: the multipliers are odd, so a non-zero change
  times one of them is non-zero modulo 2**64. For the same dtype and shape the hash is added, a bijection,
  so two different sums never give one value.
* **Not cryptographic**: it is a linear function of the bits; someone who wants a collision can build
  one. Unrelated weights collide by chance with probability about 2**-64 per lane (2**-128 for both).

Cost: the tensor is read once, in chunks of ``chunk_elements`` (default 4M elements, a few tens of MB of
temporaries whatever the tensor's size), with a few int64 operations per element and lane; measured
against one AdamW step in docs/benchmarks.md (``nanwatch bench``). The values are read to the host once
per call (one sync): publishing weights to a rollout engine syncs anyway.

Sharded parameters (DTensor, FSDP2): a shard is not the tensor, so by default a DTensor is refused (a
``ValueError`` naming it); ``gather=True`` fingerprints ``full_tensor()``, a collective that every rank
must call, in the same order, and that materialises each full tensor in turn on every rank.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

import torch

__all__ = ["BLOCK", "DEFAULT_CHUNK_ELEMENTS", "fingerprint", "fingerprint_sums", "multipliers"]

#: the elements one position multiplier covers: part of the definition (every process uses it)
BLOCK = 1 << 16
#: elements read per step of the walk over a tensor (a multiple of BLOCK; any multiple gives the same value)
DEFAULT_CHUNK_ELEMENTS = 1 << 22
_M64 = (1 << 64) - 1
#: the seeds of the two lanes' position (m) and block (w) multipliers
_SEEDS = ((0x243F6A8885A308D3, 0x13198A2E03707344), (0xA4093822299F31D0, 0x082EFA98EC4E6C89))
_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _signed(c: int) -> int:
    c &= _M64
    return c - (1 << 64) if c >> 63 else c


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
    """The odd multipliers of indices ``start .. start+n-1`` for ``seed``, as int64 on ``device``."""
    idx = torch.arange(start, start + n, dtype=torch.int64, device=device)
    return _splitmix(idx + _signed(seed)) | 1


class _Multipliers:
    """The position multipliers (one BLOCK per lane), made once per device."""

    def __init__(self) -> None:
        self.by_device: dict[torch.device, torch.Tensor] = {}

    def get(self, device: torch.device) -> torch.Tensor:
        m = self.by_device.get(device)
        if m is None:
            m = torch.stack([multipliers(0, BLOCK, seed, device) for seed, _ in _SEEDS])  # [2, BLOCK]
            self.by_device[device] = m
        return m


_POSITION = _Multipliers()


def _raw_int64(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits, flattened row-major, one signed integer per element, widened to int64."""
    flat = t.detach().reshape(-1)
    size = flat.element_size()
    if size not in _INT_OF_SIZE:
        raise ValueError(f"nanwatch.fingerprint: no integer view for dtype {flat.dtype}")
    return flat if flat.dtype == torch.int64 else flat.view(_INT_OF_SIZE[size])


def fingerprint_sums(t: torch.Tensor, *, chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> torch.Tensor:
    """The two lane sums of ``t`` (int64 ``[2]``, on ``t``'s device; no host read)."""
    if chunk_elements < BLOCK or chunk_elements % BLOCK:
        raise ValueError(f"chunk_elements must be a positive multiple of {BLOCK}, got {chunk_elements}")
    flat, device = _raw_int64(t), t.device
    m = _POSITION.get(device)
    total = torch.zeros(2, dtype=torch.int64, device=device)
    n = flat.numel()
    for start in range(0, n, chunk_elements):
        part = flat[start:start + chunk_elements].to(torch.int64)
        full, rest = divmod(part.numel(), BLOCK)
        first = start // BLOCK
        for lane, (_, block_seed) in enumerate(_SEEDS):
            per_block = []
            if full:
                per_block.append((part[:full * BLOCK].view(full, BLOCK) * m[lane]).sum(dim=1))
            if rest:
                per_block.append((part[full * BLOCK:] * m[lane, :rest]).sum().reshape(1))
            sums = torch.cat(per_block) if len(per_block) > 1 else per_block[0]
            w = multipliers(first, sums.numel(), block_seed, device)
            total[lane] += (sums * w).sum()
    return total


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


def fingerprint(obj: torch.nn.Module | Mapping[str, object], *, gather: bool = False,
                chunk_elements: int = DEFAULT_CHUNK_ELEMENTS) -> dict[str, str]:
    """The weight fingerprint of every tensor of a module's ``state_dict()`` or of a state dict: name ->
    32 hex digits (module docstring). Non-tensor entries are skipped. The sums are computed on each
    tensor's device; the values are read to the host once, at the end (one sync per call). ``gather``:
    fingerprint sharded parameters (DTensor) whole, a collective every rank must join."""
    names, metas, by_device = [], [], {}
    for name, t in _tensors(obj):
        full = _local(name, t, gather)
        names.append(name)
        metas.append(_meta(full))
        by_device.setdefault(full.device, []).append((len(names) - 1, fingerprint_sums(full, chunk_elements=chunk_elements)))
    values: list[list[int]] = [[]] * len(names)
    for found in by_device.values():  # the host read: once per device the tensors are on
        for (i, _), lane_sums in zip(found, torch.stack([s for _, s in found]).tolist(), strict=True):
            values[i] = lane_sums
    return {name: "".join(f"{(s + m) & _M64:016x}" for s, m in zip(lane_sums, meta, strict=True))
            for name, lane_sums, meta in zip(names, values, metas, strict=True)}
