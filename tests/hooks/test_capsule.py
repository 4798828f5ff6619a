"""The incident capsule (issue #20): a run's first non-finite step leaves one safetensors file holding its
birth module's faulting call, and ``nanwatch replay CAPSULE``, in a fresh process that never saw the
training code, says whether it reproduces and why.

| fault                                      | capsule of              | replay verdict (CPU)                   |
|--------------------------------------------|-------------------------|----------------------------------------|
| fp16 eager QK overflow (q/k norms scaled)  | ``layers.0.self_attn``  | same non-finite, fp32 finite: precision |
| one NaN weight of ``layers.0.mlp.down_proj`` | ``...down_proj`` (Linear) | non-finite everywhere: data_mask      |
| a one-shot hook NaN-ing ``down_proj``'s output (training only) | the first offender's call in the re-run | finite: not reproducible, exit 1; the host counter +1 |
| a pickle payload named ``.capsule``        | -                       | refused (exit 2), never unpickled      |
| a birth module beyond a small size limit   | under the limit, dropped tensors listed; replay refuses (exit 2) |
| the README loop as written (``use_cache`` default: a DynamicCache) | ``layers.0.self_attn`` | precision, in a fresh process |
| an empty or filled DynamicCache at the call | the attention module    | the rebuilt cache gives the same output |
| a cache class not on the allow-list         | named in the log and the replay | exit 2, naming it              |
| one byte flipped inside a tensor            | -                       | exit 2, "damaged", naming the tensor   |
| ``--try`` without fp32 (same, flash, cudnn, '') | precision capsule   | undecided, "add --try fp32", the recorded class beside it |
"""

from __future__ import annotations

import json
import math
import os
import struct
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from support import background_collector, overflow_attention, run_view, scrape, tiny_qwen3, token_ids

import nanwatch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

K, STEPS = 1, 3


def _train(fault, tmp_path: Path, *, dtype=torch.float16, impl: str = "eager", use_cache: bool | None = False,
           **attach):
    """A tiny Qwen3 trained under nanwatch (replay on: CPU and a guard); ``fault(model)`` before step K.
    ``use_cache=None`` leaves the config's default (True: each training forward carries a DynamicCache).
    Returns the reports."""
    torch.manual_seed(0)
    model = tiny_qwen3(impl, dtype=dtype, vocab_size=64, **({} if use_cache is None else {"use_cache": use_cache}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    reports = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.attach(model, run_id="caps", optimizer=opt, directive_source="off",
                             capsule_dir=str(tmp_path / "capsules"), **attach) as mon:
            for n in range(STEPS):
                if n == K:
                    fault(model)
                ids = token_ids(2, 32, seed=n, vocab=64)
                with mon.step(n):
                    model(input_ids=ids, labels=ids).loss.backward()
                    opt.step()
                    opt.zero_grad()
                reports.append(mon.last_report())
    return reports  # the Monitor's close waited for the capsule's writer thread


def _replay(path: str, *extra: str) -> tuple[int, dict | None, str]:
    """``nanwatch replay --json`` in a fresh interpreter: only nanwatch (and, through the capsule,
    transformers) is imported there, never this test's code."""
    code = "import sys; from nanwatch.cli import main; sys.exit(main(sys.argv[1:]))"
    env = {**os.environ, "PYTHONPATH": ""}
    p = subprocess.run([sys.executable, "-c", code, "replay", path, "--json", *extra], capture_output=True,
                       text=True, env=env, cwd=os.path.dirname(path), timeout=300)
    out = json.loads(p.stdout) if p.returncode in (0, 1) and p.stdout.strip() else None
    return p.returncode, out, p.stderr


def _rows(result: dict) -> dict[str, dict]:
    return {r["setting"]: r for r in result["rows"]}


def _nan_weight(model) -> None:
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight[0, 0] = math.nan


def test_an_fp16_qk_overflow_replays_as_precision_in_a_fresh_process(tmp_path):
    reports = _train(overflow_attention, tmp_path)
    inc = reports[K].incident
    assert inc is not None and inc.cls == "precision" and inc.birth == "model.layers.0.self_attn", inc
    assert inc.capsule and inc.capsule.endswith(f"caps-r0-s{K}-precision.capsule"), inc.capsule
    assert Path(inc.capsule).is_file()
    code, result, err = _replay(inc.capsule, "--try", "same,fp32,math")
    assert code == 0, err
    rows = _rows(result)
    assert rows["same"]["status"] == "nonfinite" and rows["same"]["nonfinite"] > 0, rows
    assert rows["fp32"]["status"] == "finite", rows
    assert result["cls"] == "precision" and result["class_path"].startswith("transformers."), result
    # eager attention calls no SDPA kernel: under "math" it is the same fp16 path, non-finite again
    assert rows["math"]["status"] == "nonfinite" and rows["math"]["sdpa_calls"] == 0
    # the human table, through the console entry point's code path
    p = subprocess.run([sys.executable, "-m", "nanwatch.cli", "replay", inc.capsule, "--try", "same,fp32"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and "class    precision" in p.stdout, p.stdout + p.stderr


def test_a_nan_weight_replays_nonfinite_under_every_setting(tmp_path):
    reports = _train(_nan_weight, tmp_path, dtype=torch.float32, impl="sdpa", param_check_every=0)
    inc = reports[K].incident
    assert inc is not None and inc.cls == "data_mask" and inc.birth == "model.layers.0.mlp.down_proj", inc
    assert inc.capsule and Path(inc.capsule).is_file()
    code, result, err = _replay(inc.capsule)
    assert code == 0, err
    rows = _rows(result)
    ran = [r for r in rows.values() if r["status"] in ("finite", "nonfinite")]
    assert {"same", "fp32", "math"} <= {r["setting"] for r in ran}, rows
    assert all(r["status"] == "nonfinite" for r in ran), rows
    assert result["cls"] == "data_mask" and result["class_path"] == "torch.nn.modules.linear:Linear", result


def test_a_nan_from_a_hook_the_replay_does_not_run_is_not_reproducible(tmp_path):
    fired: list[int] = []

    def poison(model) -> None:  # a NaN no arithmetic of the module makes, once: as a flaky chip would
        def hook(m, a, out):
            if fired:
                return out
            fired.append(1)  # the training forward of step K only: the replay's re-run is finite
            return out * math.nan

        model.model.layers[0].mlp.down_proj.register_forward_hook(hook, prepend=True)

    with background_collector(tmp_path) as srv:
        reports = _train(poison, tmp_path, dtype=torch.float32, impl="sdpa", collector=srv.url)
        scraped = scrape(srv.url)
    inc = reports[K].incident
    assert inc is not None and inc.cls == "not_reproducible" and inc.same == "finite", inc
    # no drill-down ran (nothing non-finite to follow), yet the first offender's call was captured
    assert inc.capsule and inc.capsule.endswith(f"caps-r0-s{K}-not_reproducible.capsule"), inc
    assert Path(inc.capsule).is_file()
    from safetensors import safe_open

    with safe_open(inc.capsule, framework="pt") as f:
        meta = json.loads(f.metadata()["nanwatch.capsule"])
        x = f.get_tensor("arg.0")
    site_fqn = meta["fqn"]
    assert inc.site is not None and inc.site.startswith(site_fqn) and site_fqn.startswith("model.layers.0"), meta
    assert meta["capture"]["of"] == "first_offender" and meta["capture"]["micro_batches"] == 1, meta["capture"]
    assert torch.isfinite(x).all() and x.shape[:2] == (2, 32), x.shape  # the hidden states of the batch
    # the user's hook cannot travel (it is code), but the capsule says it existed (nanwatch's own are not named)
    assert [h for h in meta["hooks"] if "down_proj: hook" in h and "poison" in h] and not [
        h for h in meta["hooks"] if "nanwatch" in h], meta["hooks"]
    # on "another host" (a fresh process that never saw the hook): the same call is finite
    code, result, err = _replay(inc.capsule, "--try", "same,fp32")
    assert code == 1, (code, err)
    assert result["cls"] == "not_reproducible" and _rows(result)["same"]["status"] == "finite", result
    assert result["hooks"] == meta["hooks"]
    table = subprocess.run([sys.executable, "-m", "nanwatch.cli", "replay", inc.capsule, "--try", "same"],
                           capture_output=True, text=True, timeout=300).stdout
    assert "suspect a hook before the hardware" in table and "silent data corruption" not in table, table
    assert result["recorded"]["incident_cls"] == "not_reproducible"
    # and the collector counts it against this host
    counted = sum(v for (name, _), v in scraped.items() if name == "nanwatch_not_reproducible_incidents_total")
    assert counted == 1, {k: v for k, v in scraped.items() if "not_reproducible" in k[0]}


class _Marker:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))  # unpickling it creates the file


def test_a_capsule_with_a_pickle_payload_is_refused_unread(tmp_path):
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.capsule"
    torch.save({"x": _Marker(str(marker))}, evil)  # a torch.save zip with a pickle inside
    plain = tmp_path / "plain.capsule"
    import pickle

    plain.write_bytes(pickle.dumps(_Marker(str(marker))))
    # and a real safetensors file with a pickle-looking metadata value but no nanwatch capsule format
    header = json.dumps({"__metadata__": {"nanwatch.capsule": json.dumps({"format": "pickle"})}}).encode()
    forged = tmp_path / "forged.capsule"
    forged.write_bytes(struct.pack("<Q", len(header)) + header)
    for path in (evil, plain, forged):
        code, _, err = _replay(str(path))
        assert code == 2 and "nanwatch replay:" in err, (path, code, err)
        assert not marker.exists()
    # the payload is live: unpickling it would have created the marker
    pickle.loads(plain.read_bytes())
    assert marker.exists()


def test_a_capsule_stays_under_its_size_limit_and_lists_what_it_dropped(tmp_path):
    # the birth module: a 64x128 float32 down_proj (32 KiB) beyond a 16 KiB limit
    limit = 16 << 10
    reports = _train(_nan_weight, tmp_path, dtype=torch.float32, impl="sdpa", param_check_every=0,
                     capsule_max_bytes=limit)
    inc = reports[K].incident
    assert inc is not None and inc.capsule, inc
    size = Path(inc.capsule).stat().st_size
    assert size <= limit, size
    from safetensors import safe_open

    with safe_open(inc.capsule, framework="pt") as f:
        meta = json.loads(f.metadata()["nanwatch.capsule"])
        kept = set(f.keys())
    assert meta["max_bytes"] == limit
    assert any(d.startswith("param.weight") for d in meta["dropped"]), meta["dropped"]
    assert "param.weight" not in kept
    code, _, err = _replay(inc.capsule)
    assert code == 2 and "dropped" in err, err


def test_clean_steps_and_a_switched_off_capsule_write_nothing(tmp_path):
    reports = _train(lambda m: None, tmp_path, dtype=torch.float32, impl="sdpa")
    assert all(r.incident is None for r in reports)
    assert not (tmp_path / "capsules").exists()
    reports = _train(_nan_weight, tmp_path, dtype=torch.float32, impl="sdpa", param_check_every=0, capsule=False)
    assert reports[K].incident is not None and reports[K].incident.capsule is None
    assert not (tmp_path / "capsules").exists()


def test_an_unwritable_capsule_folder_warns_once_and_training_goes_on(tmp_path, caplog):
    blocker = tmp_path / "capsules"
    blocker.write_text("a file where the folder should be")
    with caplog.at_level("WARNING", logger="nanwatch"):
        reports = _train(_nan_weight, tmp_path, dtype=torch.float32, impl="sdpa", param_check_every=0)
    assert len(reports) == STEPS and reports[K].incident is not None
    assert reports[K].incident.capsule is None  # the report never names a file that was not written
    assert sum("capsule not captured" in r.getMessage() for r in caplog.records) == 1, caplog.text


def test_a_bad_capsule_variable_turns_capsules_off_not_training(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("NANWATCH_CAPSULE_MAX", "lots")
    with caplog.at_level("WARNING", logger="nanwatch"):
        reports = _train(_nan_weight, tmp_path, dtype=torch.float32, impl="sdpa", param_check_every=0)
    assert reports[K].incident is not None and reports[K].incident.capsule is None
    assert "incident capsules off" in caplog.text
    monkeypatch.setenv("NANWATCH_CAPSULE_MAX", "0")  # zero: none, quietly
    reports = _train(_nan_weight, tmp_path, dtype=torch.float32, impl="sdpa", param_check_every=0)
    assert reports[K].incident.capsule is None and not (tmp_path / "capsules").exists()


def test_the_collectors_incident_event_carries_the_capsule_path(tmp_path):
    with background_collector(tmp_path) as srv:
        reports = _train(_nan_weight, tmp_path, dtype=torch.float32, impl="sdpa", param_check_every=0,
                         collector=srv.url)
        path = reports[K].incident.capsule
        assert path and Path(path).is_file()
        events = [e for e in run_view(srv.url, "caps")["events"] if e["kind"] == "incident"]
    assert events and events[0]["detail"]["capsule"] == path, events


class _UserScale(torch.nn.Module):
    """A user's own module: its class is importable only where the user's code is."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.full((n,), math.nan))

    def forward(self, x):
        return x * self.w


def test_a_user_module_capsule_says_what_replay_needs(tmp_path):
    from nanwatch.hooks.forensics.capsule import CapsuleWriter
    from nanwatch.wire import Incident

    w = CapsuleWriter(run_id="user", rank=0, directory=str(tmp_path), max_count=4, max_bytes=1 << 20)
    path = w.capture(incident=Incident(cls="data_mask", step=0, birth="blocks.0.scale"), name="blocks.0.scale",
                     module=_UserScale(4), args=(torch.ones(2, 4),), kwargs={}, rng=torch.get_rng_state())
    w.join()
    assert path and os.path.isabs(path) and Path(path).is_file()
    code, _, err = _replay(path)
    assert code == 2 and "_UserScale" in err and "importable" in err, err


def test_one_capsule_per_class_and_at_most_capsule_max(tmp_path):
    from nanwatch.hooks.forensics.capsule import CapsuleWriter
    from nanwatch.wire import Incident

    w = CapsuleWriter(run_id="cap", rank=3, directory=str(tmp_path), max_count=2, max_bytes=1 << 20)
    lin = torch.nn.Linear(4, 4)

    def capture(cls: str, step: int):
        return w.capture(incident=Incident(cls=cls, step=step), name="lin", module=lin, args=(torch.ones(1, 4),),
                         kwargs={}, rng=None)

    first, again, other, third = capture("data_mask", 1), capture("data_mask", 2), capture("precision", 3), \
        capture("not_reproducible", 4)
    w.join()
    assert first.endswith("cap-r3-s1-data_mask.capsule") and other.endswith("cap-r3-s3-precision.capsule")
    assert again is None and third is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cap-r3-s1-data_mask.capsule", "cap-r3-s3-precision.capsule"]


class _NanBackward(torch.autograd.Function):
    """Identity forward, a NaN gradient: a module whose backward overflows while its forward is finite."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * math.nan


def test_a_backward_birth_gets_no_capsule_and_replay_refuses_one_saying_why(tmp_path):
    def poison(model) -> None:  # down_proj's forward stays finite; the gradient through it turns NaN
        model.model.layers[0].mlp.down_proj.register_forward_hook(
            lambda m, a, out: _NanBackward.apply(out) if torch.is_grad_enabled() else out)

    reports = _train(poison, tmp_path, dtype=torch.float32, impl="sdpa")
    inc = reports[K].incident
    assert inc is not None and inc.phase == "backward" and inc.cls == "not_classified", inc
    assert inc.capsule is None and "backward birth is not captured nor replayed" in inc.note, inc
    assert not (tmp_path / "capsules").exists()
    # a capsule that says its incident was first seen in backward (crafted: the trainer writes none) is
    # refused, not replayed forward as if the forward were the faulting call
    from nanwatch.hooks.forensics.capsule import CapsuleWriter
    from nanwatch.wire import Incident

    w = CapsuleWriter(run_id="bwd", rank=0, directory=str(tmp_path / "crafted"), max_count=4, max_bytes=1 << 20)
    path = w.capture(incident=Incident(cls="not_classified", step=1, phase="backward", site="lin"), name="lin",
                     module=torch.nn.Linear(4, 4), args=(torch.ones(2, 4),), kwargs={}, rng=None)
    w.join()
    assert path and Path(path).is_file()
    code, _, err = _replay(path)
    assert code == 2 and "backward birth is not replayed" in err and "forward only" in err, (code, err)


# --- issue #26: every capsule replays and says what it holds; --try never invents a class ---------------------


@pytest.fixture(scope="module")
def readme_capsule(tmp_path_factory) -> tuple[str, object]:
    """The README's plain loop as written: a tiny fp16 Qwen3 from its config with ``use_cache`` at its default
    (True, so every training forward carries a ``DynamicCache``), a fused AdamW, an fp16 attention overflow at
    step K. (capsule path, incident)."""
    tmp = tmp_path_factory.mktemp("readme")
    inc = _train(overflow_attention, tmp, use_cache=None)[K].incident
    assert inc is not None and inc.cls == "precision" and inc.capsule and Path(inc.capsule).is_file(), inc
    return inc.capsule, inc


def test_the_readme_loops_capsule_replays_in_a_fresh_process_and_names_its_class(readme_capsule):
    path, inc = readme_capsule
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        meta = json.loads(f.metadata()["nanwatch.capsule"])
    assert meta["dropped"] == [], meta["dropped"]  # the cache was recorded, not dropped
    caches = [v["cache"] for v in meta["kwargs"].values() if "cache" in v]
    assert len(caches) == 1 and caches[0]["cache"] == "transformers.cache_utils:DynamicCache", meta["kwargs"]
    # at layer 0's attention call of a training forward the cache held nothing yet: every layer recorded empty
    assert all(row["keys"] is None for row in caches[0]["layers"]), caches[0]
    p = subprocess.run([sys.executable, "-m", "nanwatch.cli", "replay", path], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": ""}, cwd=os.path.dirname(path), timeout=300)
    assert p.returncode == 0 and "class    precision" in p.stdout, p.stdout + p.stderr
    code, result, err = _replay(path, "--try", "same,fp32")
    assert code == 0, err
    # the same call: as many non-finite elements as the trainer's drill-down saw at the birth
    assert _rows(result)["same"]["nonfinite"] == inc.birth_elements, result


def _capture_attention(model, layer: int, **call) -> tuple[tuple, dict, torch.Tensor]:
    """The call ``model(**call)`` makes to layer ``layer``'s attention: its arguments frozen at the call's
    start (as the drill-down's pre-hooks freeze them) and its output."""
    from nanwatch.hooks.measure.kept_forward import freeze

    got: dict = {}
    attn = model.model.layers[layer].self_attn
    pre = attn.register_forward_pre_hook(lambda m, a, k: got.update(call=freeze(a, k)[:2]), with_kwargs=True)
    post = attn.register_forward_hook(lambda m, a, out: got.update(out=out[0].clone()))
    try:
        with torch.no_grad():
            model(**call)
    finally:
        pre.remove()
        post.remove()
    return (*got["call"], got["out"])


@pytest.mark.parametrize("filled", [False, True], ids=["empty_training_cache", "filled_cache"])
def test_a_cache_is_recorded_as_it_stood_at_the_call_and_replays_to_the_same_output(tmp_path, filled):
    from transformers import DynamicCache

    from nanwatch.hooks.forensics.capsule import CapsuleWriter
    from nanwatch.hooks.forensics.replay import call_inputs, open_capsule, rebuild
    from nanwatch.wire import Incident

    model = tiny_qwen3("eager", dtype=torch.float32, vocab_size=64)  # use_cache at its default
    prefix, ids = token_ids(2, 8, seed=1, vocab=64), token_ids(2, 5, seed=2, vocab=64)
    if filled:  # a prefix's keys and values in the cache, then 5 new tokens
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=prefix, cache=cache, use_cache=True)
        call = {"input_ids": ids, "cache": cache, "use_cache": True}
    else:  # a training forward: the model makes its own empty DynamicCache
        model.train()
        call = {"input_ids": ids}
    args, kwargs, out = _capture_attention(model, 1, **call)
    w = CapsuleWriter(run_id="kv", rank=0, directory=str(tmp_path), max_count=4, max_bytes=1 << 22)
    path = w.capture(incident=Incident(cls="precision", step=0), name="model.layers.1.self_attn",
                     module=model.model.layers[1].self_attn, args=args, kwargs=kwargs, rng=torch.get_rng_state())
    w.join()
    meta, tensors = open_capsule(path)
    assert meta["dropped"] == [], meta["dropped"]
    (spec,) = [v["cache"] for v in meta["kwargs"].values() if "cache" in v]
    lengths = [None if r["keys"] is None else tensors[r["keys"]["tensor"]].shape[-2] for r in spec["layers"]]
    # the state at layer 1's call's start: layer 0 already holds this call's 5 tokens (after the prefix's 8),
    # layer 1 not yet (its own call appends them later)
    assert lengths == ([13, 8] if filled else [5, None]), lengths
    module = rebuild(meta, tensors)
    for _ in range(2):  # a fresh cache each time: a replay appends to it
        a, k = call_inputs(meta, tensors)
        with torch.no_grad():
            again = module(*a, **k)[0]
        # the same call (a contiguous copy of a tensor may take another matmul path: 1 ulp, not a cache's worth)
        torch.testing.assert_close(again, out, rtol=1e-5, atol=1e-6)


def test_a_kept_forward_reruns_with_its_cache_as_it_stood_at_the_call(tmp_path):
    from transformers import DynamicCache

    from nanwatch.hooks.measure.kept_forward import keep

    model = tiny_qwen3("sdpa", dtype=torch.float32, vocab_size=64)
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=token_ids(2, 8, seed=1, vocab=64), cache=cache, use_cache=True)
        call = {"input_ids": token_ids(2, 5, seed=2, vocab=64), "cache": cache, "use_cache": True}
        kept = keep((), call)
        first = model(**call).logits  # the training forward: it appends to the cache
        again = model(*kept.args, **kept.kwargs).logits  # the rerun
        twice = model(*kept.args, **kept.kwargs).logits
    assert cache.get_seq_length() == 13
    torch.testing.assert_close(again, first, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(twice, first, rtol=1e-5, atol=1e-6)


def test_an_input_not_recorded_is_named_in_the_log_and_by_the_replay(tmp_path, caplog):
    from transformers import StaticCache

    from nanwatch.hooks.forensics.capsule import CapsuleWriter
    from nanwatch.wire import Incident

    config = tiny_qwen3("sdpa", vocab_size=64).config
    w = CapsuleWriter(run_id="static", rank=0, directory=str(tmp_path), max_count=4, max_bytes=1 << 20)
    with caplog.at_level("WARNING", logger="nanwatch"):
        path = w.capture(incident=Incident(cls="data_mask", step=0), name="lin", module=torch.nn.Linear(4, 4),
                         args=(torch.ones(2, 4),), kwargs={"past_key_values": StaticCache(config=config,
                                                                                         max_cache_len=8)}, rng=None)
        w.join()
    written = [r.getMessage() for r in caplog.records if "capsule written" in r.getMessage()]
    assert len(written) == 1 and "kwarg.past_key_values" in written[0] and "StaticCache" in written[0], written
    code, _, err = _replay(path)
    assert code == 2 and "kwarg.past_key_values" in err and "StaticCache" in err, err


def _tensor_span(path: Path, key: str) -> tuple[int, int]:
    """The byte range of tensor ``key``'s data in a safetensors file."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    start, end = json.loads(raw[8:8 + n])[key]["data_offsets"]
    return 8 + n + start, 8 + n + end


def test_a_flipped_byte_inside_a_tensor_is_found_damaged(tmp_path):
    from nanwatch.hooks.forensics.capsule import CapsuleWriter
    from nanwatch.wire import Incident

    w = CapsuleWriter(run_id="flip", rank=0, directory=str(tmp_path), max_count=4, max_bytes=1 << 20)
    lin = torch.nn.Linear(8, 8)
    path = Path(w.capture(incident=Incident(cls="data_mask", step=0), name="lin", module=lin,
                          args=(torch.ones(2, 8),), kwargs={}, rng=None))
    w.join()
    assert _replay(str(path))[0] == 1  # intact: finite, not reproducible here
    start, end = _tensor_span(path, "param.weight")
    raw = bytearray(path.read_bytes())
    raw[(start + end) // 2] ^= 0x01  # one bit of one weight's mantissa: still a finite, plausible value
    path.write_bytes(bytes(raw))
    code, _, err = _replay(str(path))
    assert code == 2 and "damaged" in err and "param.weight" in err, (code, err)


@pytest.mark.parametrize("tried", ["same", "flash", "cudnn", ""])
def test_try_without_fp32_never_invents_a_class(readme_capsule, tried, capsys):
    from nanwatch.cli.replay_verdict import main

    path, _ = readme_capsule
    assert main([path, "--try", tried]) == 0  # the non-finite value reproduced
    out = capsys.readouterr().out
    lines = out.splitlines()
    verdict = next(i for i, line in enumerate(lines) if line.startswith("class "))
    assert "class    data_mask" not in out and "no precision switch helps" not in out, out
    assert lines[verdict].startswith("class    undecided"), out
    assert "add --try fp32" in lines[verdict + 1] and "recorded class precision" in lines[verdict + 1], out
    assert main([path, "--try", f"{tried},fp32".lstrip(","), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cls"] == "precision"
