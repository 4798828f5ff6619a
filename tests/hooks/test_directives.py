"""Directives on the trainer: applied at a step boundary, at the same step on every rank."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
from support import CollectorProcess, free_port, tiny_qwen3, token_ids

import nanwatch
from nanwatch.wire import Directive

pytest.importorskip("transformers")


def test_fp32_directive_rescues_fp16_eager_overflow_from_apply_at_step():
    model = tiny_qwen3("eager", dtype=torch.float16)
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        attn.q_norm.weight.fill_(100.0)
        attn.k_norm.weight.fill_(100.0)
    rows = []
    with nanwatch.attach(model, run_id="rescue") as mon:
        for n in range(6):
            if n == 1:
                mon.directive_state.offer(Directive(run_id="rescue", version=1, mode="fp32", apply_at_step=3))
            with mon.step(n):
                out = model(input_ids=token_ids(seed=1))
            r = mon.last_report()
            rows.append((r.step, r.attention_mode, r.directive_version, r.first_offender,
                         model.config._attn_implementation))
            assert bool(torch.isfinite(out.logits).all()) == (n >= 3)
        fp32_calls = {c.dtype for c in r.sdpa}
    assert rows == [
        (0, "none", 0, "model.layers.0.self_attn", "eager"),
        (1, "none", 0, "model.layers.0.self_attn", "eager"),
        (2, "none", 0, "model.layers.0.self_attn", "eager"),
        (3, "fp32", 1, None, "sdpa"),
        (4, "fp32", 1, None, "sdpa"),
        (5, "fp32", 1, None, "sdpa"),
    ]
    assert fp32_calls == {"float32"}
    assert model.config._attn_implementation == "eager"  # restored on detach


def test_auto_revert_after_clean_steps():
    model = tiny_qwen3("sdpa")
    modes = []
    with nanwatch.attach(model, run_id="revert") as mon:
        mon.directive_state.offer(Directive(run_id="revert", version=1, mode="fp32", apply_at_step=1,
                                       revert_after_clean_steps=3))
        for n in range(8):
            with mon.step(n):
                model(input_ids=token_ids(seed=1))
            mon.last_report()  # the clean streak is counted from finished reports
            modes.append(mon.directive_state.mode)
    assert modes[0] == "none" and modes[1] == "fp32"
    first_none = modes.index("none", 1)
    assert modes[1:first_none] == ["fp32"] * (first_none - 1) and 4 <= first_none <= 5
    assert set(modes[first_none:]) == {"none"}


def test_fused_directive_falls_back_to_fp32_when_no_fused_kernel_fits():
    model = tiny_qwen3("sdpa")
    with nanwatch.attach(model, run_id="fused") as mon:
        mon.directive_state.offer(Directive(run_id="fused", version=1, mode="fused", apply_at_step=0))
        with mon.step(0):
            model(input_ids=token_ids(seed=1))  # causal, no mask: the CPU flash kernel fits
        ok = mon.last_report()
        for layer in model.model.layers:  # attention dropout in training: CPU flash refuses it
            layer.self_attn.attention_dropout = 0.5
        model.train()
        with mon.step(1):
            out = model(input_ids=token_ids(seed=1))
        r = mon.last_report()
    assert {c.backend for c in ok.sdpa} == {"cpu_flash"} and ok.warnings == []
    assert mon.directive_state.fallbacks == 2
    assert sorted(w for w in r.warnings if "no fused kernel fits" in w) == [
        f"directive 'fused': no fused kernel fits at model.layers.{i}.self_attn; ran fp32 instead" for i in (0, 1)]
    assert {(c.backend, c.dtype) for c in r.sdpa} == {("math", "float32")}
    assert torch.isfinite(out.logits).all()


def test_skip_step_costs_nothing_unless_active_and_then_sees_nan():
    model = tiny_qwen3("sdpa")
    with nanwatch.attach(model, run_id="skip") as mon:
        with mon.step(0):
            model(input_ids=token_ids(seed=1))
            assert mon.should_skip_step() is False  # no directive: free, always False
        mon.directive_state.offer(Directive(run_id="skip", version=1, mode="skip_step", apply_at_step=1))
        with mon.step(1):
            model(input_ids=token_ids(seed=1))
            clean = mon.should_skip_step()
            mon.watch("loss", torch.tensor([math.nan]))
            dirty = mon.should_skip_step()
    assert (clean, dirty) == (False, True)


def _run_ranks(tmp_path: Path, env_extra: dict[str, str] | None = None, on_start=None) -> list[dict]:
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2",
               OMP_NUM_THREADS="1", **(env_extra or {}))
    worker = Path(__file__).with_name("dist_worker.py")
    procs = [subprocess.Popen([sys.executable, str(worker), str(tmp_path / f"r{r}.json")],
                              env=dict(env, RANK=str(r)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(2)]
    try:
        if on_start is not None:
            on_start()
        for p in procs:
            out, _ = p.communicate(timeout=240)
            assert p.returncode == 0, out.decode()[-3000:]
    finally:
        for p in procs:
            p.kill()
    return [json.loads((tmp_path / f"r{r}.json").read_text()) for r in range(2)]


@pytest.mark.slow
def test_every_rank_switches_at_the_same_step_gloo(tmp_path: Path):
    r0, r1 = _run_ranks(tmp_path)
    assert r0["modes"] == r1["modes"]  # identical (step, mode, version) on both ranks, every step
    by_step = {n: (m, v) for n, m, v in r0["modes"]}
    assert by_step[6] == ("none", 0) and by_step[7] == ("fp32", 1)  # offered at 3, agreed at 4, applied at 7
    assert by_step[9] == ("fp32", 1) and by_step[10] == ("fused", 2)  # offered late at 9: next agreement, 10
    assert r0["reported"] == r1["reported"] == "fused"


@pytest.mark.slow
def test_directive_set_over_http_reaches_both_ranks_at_the_same_step(tmp_path: Path):
    with CollectorProcess(db_path=tmp_path / "c.db") as c:
        def set_directive_once_running():
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:  # wait until both ranks report, then act like an operator
                try:
                    with urllib.request.urlopen(c.url + "/v1/runs/dist", timeout=5) as resp:
                        run = json.loads(resp.read())
                    if run["live_ranks"] == 2 and run["latest_step"] >= 3:
                        break
                except urllib.error.HTTPError as e:  # 404 until the first report arrives
                    assert e.code == 404
                time.sleep(0.05)
            req = urllib.request.Request(c.url + "/v1/directives/dist", method="PUT",
                                         data=json.dumps({"mode": "fp32", "reason": "test"}).encode(),
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=5) as resp:
                set_directive_once_running.directive = json.loads(resp.read())

        r0, r1 = _run_ranks(tmp_path, {"NANWATCH_COLLECTOR": c.url}, set_directive_once_running)
        with urllib.request.urlopen(c.url + "/v1/runs/dist", timeout=5) as resp:
            run = json.loads(resp.read())
    d = set_directive_once_running.directive
    assert d["version"] == 1 and d["mode"] == "fp32"
    assert r0["modes"] == r1["modes"]
    switched = [n for n, m, v in r0["modes"] if (m, v) == ("fp32", 1)]
    assert switched and switched[0] >= d["apply_at_step"]  # apply_at_step = latest step seen + margin
    assert all(m == "none" for n, m, v in r0["modes"] if n < switched[0])
    assert r0["reported"] == r1["reported"] == "fp32"
    # the ack: every rank reported the mode it applies (the ranks have ended: their last views, kept for the API;
    # their per-rank series left with them)
    assert run["status"] == "ended"
    assert {(v["rank"], v["attention_mode"], v["ended"]) for v in run["ranks"]} == {(0, "fp32", True), (1, "fp32", True)}
