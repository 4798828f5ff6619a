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


def _train(fault, tmp_path: Path, *, dtype=torch.float16, impl: str = "eager", **attach):
    """A tiny Qwen3 trained under nanwatch (replay on: CPU and a guard); ``fault(model)`` before step K.
    Returns the reports."""
    torch.manual_seed(0)
    model = tiny_qwen3(impl, dtype=dtype, vocab_size=64, use_cache=False)
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
    # on "another host" (a fresh process that never saw the hook): the same call is finite
    code, result, err = _replay(inc.capsule, "--try", "same,fp32")
    assert code == 1, (code, err)
    assert result["cls"] == "not_reproducible" and _rows(result)["same"]["status"] == "finite", result
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
    from nanwatch.hooks.remedies.capsule import CapsuleWriter
    from nanwatch.wire import Incident

    w = CapsuleWriter(run_id="user", rank=0, directory=str(tmp_path), max_count=4, max_bytes=1 << 20)
    path = w.capture(incident=Incident(cls="data_mask", step=0, birth="blocks.0.scale"), name="blocks.0.scale",
                     module=_UserScale(4), args=(torch.ones(2, 4),), kwargs={}, rng=torch.get_rng_state())
    w.join()
    assert path and os.path.isabs(path) and Path(path).is_file()
    code, _, err = _replay(path)
    assert code == 2 and "_UserScale" in err and "importable" in err, err


def test_one_capsule_per_class_and_at_most_capsule_max(tmp_path):
    from nanwatch.hooks.remedies.capsule import CapsuleWriter
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
    from nanwatch.hooks.remedies.capsule import CapsuleWriter
    from nanwatch.wire import Incident

    w = CapsuleWriter(run_id="bwd", rank=0, directory=str(tmp_path / "crafted"), max_count=4, max_bytes=1 << 20)
    path = w.capture(incident=Incident(cls="not_classified", step=1, phase="backward", site="lin"), name="lin",
                     module=torch.nn.Linear(4, 4), args=(torch.ones(2, 4),), kwargs={}, rng=None)
    w.join()
    assert path and Path(path).is_file()
    code, _, err = _replay(path)
    assert code == 2 and "backward birth is not replayed" in err and "forward only" in err, (code, err)
