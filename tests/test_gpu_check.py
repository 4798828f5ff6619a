"""``.ci/gpu-check`` end to end on a machine without CUDA: it must say so and stop at once (exit 3), before
installing or running anything, not hang or run the CPU through the benches. And the one table it prints,
built from synthetic bench JSON (``.ci/gpu_table.py``)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / ".ci" / "gpu-check"
_spec = importlib.util.spec_from_file_location("gpu_table", SCRIPT.parent / "gpu_table.py")
gpu_table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_table)


def _check(tmp_path, python: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHON=python, OUT=str(tmp_path / "out"))
    # a hang fails here: the bound is the point of the test, not a measured speed
    return subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, env=env, timeout=120)


def test_without_cuda_it_says_so_and_exits_3_before_installing_anything(tmp_path):
    out = _check(tmp_path, sys.executable)
    assert out.returncode == 3, out.stdout + out.stderr
    assert "gpu-check: no CUDA device (torch.cuda.is_available() is False): nothing run" in out.stderr
    assert "step 0" in out.stdout and "step 1" not in out.stdout  # no install, no tests, no bench
    assert not (tmp_path / "out").exists()  # nothing written


def test_a_python_that_cannot_ask_torch_also_exits_3(tmp_path):
    out = _check(tmp_path, "false")  # a "python" that fails: torch missing, say
    assert out.returncode == 3 and "could not ask torch for a CUDA device" in out.stderr
    assert not (tmp_path / "out").exists()


def _bench(variants: dict[str, tuple[float, float]], device: str = "NVIDIA H200") -> dict:
    """A bench JSON as ``nanwatch bench --json`` writes it: name -> (median ms, paired ratio)."""
    return {"machine": {"cuda_device": device},
            "variants": {k: {"median_ms": ms, "paired_ratio": r} for k, (ms, r) in variants.items()}}


def test_the_table_has_one_row_per_run_with_its_ratios_or_why_not(tmp_path):
    runs = [({"dtype": "bf16", "model": "tiny", "backend": "flash"}, 0,
             _bench({"bare": (12.5, 1.0), "nanwatch": (13.0, 1.04), "nanwatch_guard": (13.1, 1.048),
                     "debug_underflow_overflow": (40.0, 3.2), "detect_anomaly": (30.0, 2.4)})),
            ({"dtype": "bf16", "model": "tiny", "backend": "efficient"}, 0,
             _bench({"bare": (11.0, 1.0), "nanwatch": (11.5, 1.045)})),
            ({"dtype": "fp16", "model": "small", "backend": "cudnn"}, 4,
             {"machine": {"cuda_device": "NVIDIA H200"}, "variants": {},
              "unavailable": "sdpa backend 'cudnn' cannot run this step on cuda: No available kernel"}),
            ({"dtype": "fp16", "model": "small", "backend": "flash"}, 124, None),
            ({"dtype": "fp16", "model": "small", "backend": "efficient"}, -1, None),
            ({"dtype": "bf16", "model": "small", "backend": "flash"}, 1, None)]
    manifest = tmp_path / "runs.jsonl"
    lines = []
    for i, (label, rc, results) in enumerate(runs):
        path = tmp_path / f"{i}.json"
        if results is not None:
            path.write_text(json.dumps(results))
        lines.append(json.dumps({**label, "rc": rc, "json": str(path)}))
    manifest.write_text("\n".join(lines) + "\n")
    assert gpu_table.main([str(manifest), str(tmp_path / "out")]) == 0
    text = (tmp_path / "out" / "summary.txt").read_text().splitlines()
    rows = json.loads((tmp_path / "out" / "summary.json").read_text())["rows"]
    assert text[0].split()[:4] == ["device", "dtype", "model", "backend"] and len(text) == 2 + len(runs)
    assert [r["status"] for r in rows] == [
        "ok", "ok", "unavailable: sdpa backend 'cudnn' cannot run this step on cuda: No available kernel",
        "timed out", "skipped: the check's time budget was spent", "failed (exit 1)"]
    first = rows[0]
    assert (first["device"], first["bare_ms"], first["nanwatch"], first["debug_underflow_overflow"]) == (
        "NVIDIA H200", 12.5, 1.04, 3.2)
    assert text[2].split() == ["NVIDIA", "H200", "bf16", "tiny", "flash", "12.50", "1.040", "1.048", "3.200",
                               "2.400", "ok"]
    assert text[3].split()[5:] == ["11.00", "1.045", "-", "-", "-", "ok"]  # no anchors in that run: dashes
    assert rows[3]["bare_ms"] is None and rows[3]["device"] == "cuda"  # no JSON: the label's device


def test_an_empty_manifest_still_writes_a_table(tmp_path):
    assert gpu_table.main([str(tmp_path / "missing.jsonl"), str(tmp_path / "out")]) == 0
    assert "(no bench runs)" in (tmp_path / "out" / "summary.txt").read_text()


def test_it_counts_the_kernels_on_cuda_bounded_and_within_the_files_the_device_tool_returns():
    text = SCRIPT.read_text()
    (line,) = [ln for ln in text.splitlines() if "nanwatch.cli bench kernels --device cuda" in ln]
    assert line.startswith("timeout ") and '--json "$OUT/kernels.json"' in line
    assert '>"$OUT/kernels.txt"' in text
    # its time counts against the benches' budget: it runs before the loop that checks GPU_CHECK_BUDGET_S
    assert text.index("nanwatch.cli bench kernels --device cuda") < text.index('"$BUDGET_S"')
    written = set(re.findall(r'\$OUT/([A-Za-z0-9_.-]+)', text)) | {"summary.txt", "summary.json"}  # gpu_table's
    assert "kernels.txt" in written and len(written) <= 8, sorted(written)
