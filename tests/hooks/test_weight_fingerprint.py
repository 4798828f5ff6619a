"""The weight fingerprint (``nanwatch.fingerprint``, #28.5): exact (a pure-Python rendering of the formula
gives the same value), the same in another process, different for one flipped bit, a reshape or a cast,
independent of the chunking; sharded tensors refused unless gathered; ``Monitor.publish_weights`` only
warns when it cannot post."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from support import TinyNet

import nanwatch
from nanwatch.hooks.rollout.weight_fingerprint import BLOCK, fingerprint

M64 = (1 << 64) - 1
SEEDS = ((0x243F6A8885A308D3, 0x13198A2E03707344), (0xA4093822299F31D0, 0x082EFA98EC4E6C89))


def _splitmix(x: int) -> int:
    x = (x * 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def reference(t: torch.Tensor) -> str:
    """The documented formula in Python integers (no torch arithmetic): the bytes as little-endian 32-bit
    words, each block's sum of word x odd position multiplier mod 2**32, weighted by an odd block
    multiplier and summed mod 2**64, plus the dtype/shape hash."""
    raw = bytes(t.reshape(-1).view(torch.uint8).tolist())
    raw += b"\0" * (-len(raw) % 4)
    words = [int.from_bytes(raw[k:k + 4], "little") for k in range(0, len(raw), 4)]
    meta = hashlib.blake2b(f"{t.dtype}|{tuple(t.shape)}".encode(), digest_size=16).digest()
    out = ""
    for lane, (pos_seed, block_seed) in enumerate(SEEDS):
        blocks: dict[int, int] = {}
        for i, x in enumerate(words):
            m = (_splitmix(i % BLOCK + pos_seed) | 1) & 0xFFFFFFFF
            blocks[i // BLOCK] = (blocks.get(i // BLOCK, 0) + x * m) & 0xFFFFFFFF
        total = sum((_splitmix(c + block_seed) | 1) * s for c, s in blocks.items())
        total += int.from_bytes(meta[8 * lane:8 * lane + 8], "little")
        out += f"{total & M64:016x}"
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8,
                                   torch.bool, torch.int64])
def test_the_value_is_the_documented_formula_exactly(dtype):
    g = torch.Generator().manual_seed(1)
    n = 2 * BLOCK + 37  # three blocks of words or more, the last one partial, a padded last word
    t = (torch.randn(n, generator=g) * 1e3).to(dtype)
    if dtype == torch.int64:
        t = torch.randint(-(2**62), 2**62, (n,), generator=g)
    assert fingerprint({"t": t}, chunk_elements=BLOCK)["t"] == reference(t)


def test_chunked_equals_unchunked():
    t = torch.randn(5 * BLOCK + 3, generator=torch.Generator().manual_seed(2))
    values = {fingerprint({"t": t}, chunk_elements=c)["t"] for c in (BLOCK, 2 * BLOCK, 64 * BLOCK)}
    assert len(values) == 1


def test_the_same_tensor_gives_the_same_value_in_another_process():
    code = textwrap.dedent("""
        import json, torch, nanwatch
        from support import TinyNet
        torch.manual_seed(7)
        print(json.dumps(nanwatch.fingerprint(TinyNet())))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=str(__import__("pathlib").Path(__file__).parents[1]))
    assert out.returncode == 0, out.stderr
    torch.manual_seed(7)
    here = nanwatch.fingerprint(TinyNet())
    assert json.loads(out.stdout.strip().splitlines()[-1]) == here
    assert len(here) >= 3 and all(len(v) == 32 and int(v, 16) >= 0 for v in here.values())


@pytest.mark.parametrize("where", [0, 1, BLOCK - 1, BLOCK, 2 * BLOCK + 5])
@pytest.mark.parametrize("bit", [0, 13, 31])
def test_one_flipped_bit_changes_the_value(where, bit):
    t = torch.randn(2 * BLOCK + 9, generator=torch.Generator().manual_seed(3))
    flipped = t.clone()
    flipped.view(torch.int32)[where] ^= (1 << bit) if bit < 31 else -(2**31)
    assert not torch.equal(t.view(torch.int32), flipped.view(torch.int32))
    assert fingerprint({"t": t})["t"] != fingerprint({"t": flipped})["t"]


def test_a_reshape_or_a_cast_changes_the_value():
    t = torch.randn(6, 4, generator=torch.Generator().manual_seed(4))
    base = fingerprint({"t": t})["t"]
    assert fingerprint({"t": t.reshape(4, 6)})["t"] != base  # the same bits in the same order
    assert fingerprint({"t": t.view(torch.int32)})["t"] != base  # the same bits, another dtype
    assert fingerprint({"t": t.to(torch.bfloat16)})["t"] != base
    assert fingerprint({"t": t.t().contiguous().t()})["t"] == base  # the same values, another layout


def test_a_module_and_its_state_dict_agree_and_non_tensors_are_skipped():
    net = TinyNet()
    sd = {**net.state_dict(), "_extra": {"not": "a tensor"}}
    assert nanwatch.fingerprint(net) == nanwatch.fingerprint(sd) == nanwatch.hooks.fingerprint(net.state_dict())
    assert set(nanwatch.fingerprint(net)) == set(net.state_dict())


_SHARDED = textwrap.dedent("""
    import os, torch, torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from nanwatch import fingerprint
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["PORT"])
    dist.init_process_group("gloo", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    full = torch.arange(12.0).reshape(3, 4)
    d = distribute_tensor(full, mesh, [Shard(0)])
    try:
        fingerprint({"w": d})
        print("NOT REFUSED")
    except ValueError as e:
        assert "sharded" in str(e), e
    assert fingerprint({"w": d}, gather=True) == fingerprint({"w": full})
    dist.destroy_process_group()
    print("OK")
""")


def test_a_sharded_tensor_is_refused_unless_gathered():
    from support import free_port

    out = subprocess.run([sys.executable, "-c", _SHARDED], capture_output=True, text=True, timeout=180,
                         env={**__import__("os").environ, "PORT": str(free_port())})
    assert out.returncode == 0 and out.stdout.strip().splitlines()[-1] == "OK", out.stdout + out.stderr


def test_publish_weights_warns_and_carries_on_when_the_collector_is_unreachable():
    from support import free_port

    net = TinyNet()
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with nanwatch.attach(net, run_id="publish-unreachable", collector=url, close_timeout=0.5) as mon:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fps = mon.publish_weights(3)
    assert fps == nanwatch.fingerprint(net)
    assert any("weight version 3 not posted" in str(w.message) for w in caught), [str(w.message) for w in caught]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int8])
def test_cuda_and_cpu_give_the_same_value(dtype):
    """Not run here (no GPU lent to this work): the same bits on CUDA and CPU, a value each."""
    t = (torch.randn(3 * BLOCK + 11, generator=torch.Generator().manual_seed(5)) * 100).to(dtype)
    sd = {"t": t, "small": t[:7].clone(), "matrix": t[: 64 * 33].reshape(64, 33).clone()}
    assert fingerprint({k: v.cuda() for k, v in sd.items()}) == fingerprint(sd)


def test_the_answer_carries_dtypes_and_shapes_and_the_casts_are_the_cast_tensors_values():
    """#36: ``nanwatch.fingerprint`` is still a plain mapping to its readers, and also says each tensor's dtype
    and shape; ``fingerprint_casts`` gives what a copy cast with ``.to(dtype)`` (or loaded into a model of that
    dtype) fingerprints to, for the floating tensors of another dtype only."""
    from nanwatch.hooks.rollout.weight_fingerprint import fingerprint_casts

    g = torch.Generator().manual_seed(6)
    sd = {"w": torch.randn(8, 5, generator=g), "h": torch.randn(7, generator=g).half(), "n": torch.arange(6)}
    fps = fingerprint(sd)
    assert dict(fps) == fps and json.loads(json.dumps(fps)) == dict(fps)
    assert fps.dtypes == {"w": "float32", "h": "float16", "n": "int64"}
    assert fps.shapes == {"w": [8, 5], "h": [7], "n": [6]}
    casts = fingerprint_casts(sd, [torch.bfloat16, torch.float16])
    assert set(casts) == {"bfloat16", "float16"}
    assert casts["bfloat16"] == fingerprint({"w": sd["w"].to(torch.bfloat16), "h": sd["h"].to(torch.bfloat16)})
    assert casts["float16"] == fingerprint({"w": sd["w"].to(torch.float16)})  # "h" is float16 already
    copy = torch.empty(8, 5, dtype=torch.bfloat16)
    copy.copy_(sd["w"])  # what load_state_dict does into a bf16 model
    assert fingerprint({"w": copy})["w"] == casts["bfloat16"]["w"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_a_cast_on_cuda_fingerprints_as_on_the_cpu(dtype):
    """Not run here (no GPU lent to this work): a trainer on CUDA publishes the casts a CPU (or other GPU)
    loader makes, bit for bit, or a right sync would read as a mismatch."""
    from nanwatch.hooks.rollout.weight_fingerprint import fingerprint_casts

    t = torch.randn(3 * BLOCK + 11, generator=torch.Generator().manual_seed(5)) * 300  # fp8's range exceeded too
    assert fingerprint_casts({"t": t.cuda()}, [dtype]) == fingerprint_casts({"t": t}, [dtype])
