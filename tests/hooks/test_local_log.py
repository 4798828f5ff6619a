"""The local record (nanwatch.hooks.report.local_log): a line in the training log per non-finite episode, not per
NaN step; a JSONL file of every report, exact (NaN stays NaN), rotated at its size limit; a folder that
cannot be written costs a warning, never the run."""

from __future__ import annotations

import json
import logging
import math
import warnings
from pathlib import Path

import pytest
import torch
from support import step_reports, tiny_qwen3, token_ids

import nanwatch
from nanwatch.hooks.config import LocalLogConfig, MonitorConfig, resolve_config
from nanwatch.wire import StepReport


def _train(steps: int, *, nan_steps=(), **options) -> list[StepReport]:
    """A tiny Qwen3 for ``steps`` steps under a guarded fused AdamW; layer 1's MLP output turns NaN at
    ``nan_steps``. Returns every report delivered."""
    model = tiny_qwen3("sdpa", vocab_size=64, hidden_size=32, intermediate_size=64, use_cache=False)
    now = {"step": -1}
    model.model.layers[1].mlp.register_forward_hook(
        lambda m, a, out: out.index_fill(1, torch.tensor([0]), math.nan) if now["step"] in nan_steps else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    seen: list[StepReport] = []
    with nanwatch.attach(model, run_id="local", optimizer=opt, on_report=step_reports(seen), **options) as mon:
        for n in range(steps):
            now["step"] = n
            ids = token_ids(2, 16, seed=n, vocab=64)
            with mon.step(n):
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad()
    return seen


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "nanwatch" and r.getMessage().startswith(
        "nanwatch: step")]


def test_a_nan_run_is_one_line_when_it_starts_and_one_when_it_ends(caplog):
    caplog.set_level(logging.WARNING, logger="nanwatch")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reports = _train(8, nan_steps=(3, 4, 5))
    assert [r.first_offender is not None for r in reports] == [False] * 3 + [True] * 3 + [False] * 2
    lines = _lines(caplog)
    assert len(lines) == 2, lines  # not one per NaN step
    start, end = lines
    assert start.startswith("nanwatch: step 3 (train): non-finite at model.layers.1.mlp (forward, rank 0); ")
    assert "non-finite site visits" in start and "step skipped" in start
    inc = reports[3].incident  # classified by the replay (CPU, guarded): in the same line
    assert inc is not None and f"class {inc.cls}" in start and f"born at {inc.birth}" in start
    assert f"{inc.birth_elements} non-finite element" in start
    assert end == "nanwatch: step 6 (train): finite again after 3 non-finite steps (from step 3)"


def test_a_clean_run_logs_nothing_and_log_every_adds_a_summary(caplog):
    caplog.set_level(logging.INFO, logger="nanwatch")
    _train(5, log_every=2)
    assert not [r for r in caplog.records if r.name == "nanwatch" and r.levelno >= logging.WARNING]
    summaries = _lines(caplog)
    assert [s.split(":")[1] for s in summaries] == [" step 0 (train)", " step 2 (train)", " step 4 (train)"]
    assert "0 non-finite steps so far" in summaries[-1] and "headroom" in summaries[-1]


def _records(folder: Path) -> list[dict]:
    (path,) = folder.glob("*.jsonl")
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_jsonl_file_holds_every_report_exactly_and_ends_with_the_final_report(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reports = _train(4, nan_steps=(1,), log_dir=str(tmp_path))
    (path,) = tmp_path.glob("*.jsonl")
    assert path.name == f"local.rank0.{reports[0].incarnation}.jsonl"
    lines = path.read_text().splitlines()
    assert len(lines) == len(reports) + 1
    # exact round trip: the NaN headroom of a site that held only NaN stays NaN (the wire's constants)
    assert [StepReport.model_validate_json(x).model_dump_json() for x in lines[:-1]] == [
        r.model_dump_json() for r in reports]
    assert any(math.isnan(s.headroom) for s in StepReport.model_validate_json(lines[1]).sites)
    final = json.loads(lines[-1])  # a normal close: the final report ends the file (no closing record too)
    assert final["final"] is True and final["step"] == 3 and final["rank"] == 0 and final["sites"] == []


def test_the_file_rotates_at_its_size_limit(tmp_path):
    reports = _train(6, log_dir=str(tmp_path), log_max_bytes=20_000, log_backups=2)
    size = len(reports[0].model_dump_json()) + 1
    assert 20_000 // 2 > size > 20_000 // 6, size  # a few reports per file: the limit is what rotates it
    files = sorted(tmp_path.iterdir())
    assert [f.name.rsplit(".jsonl", 1)[1] for f in files] == ["", ".1", ".2"]  # two backups kept, no more
    assert all(f.stat().st_size <= 20_000 for f in files)
    # read oldest first, the records are the latest ones, in order, with none lost between the files kept
    recs = [json.loads(line) for f in (files[2], files[1], files[0]) for line in f.read_text().splitlines()]
    seqs = [r.get("seq") for r in recs]
    assert recs[-1]["final"] is True and seqs == list(range(seqs[0], 7))  # the final report (seq 6) ends it


def test_an_unwritable_folder_is_one_warning_and_the_run_goes_on(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.warns(RuntimeWarning, match="local log: cannot write") as caught:
        reports = _train(3, log_dir=str(blocker / "logs"))
    assert [r.step for r in reports] == [0, 1, 2]
    assert len([w for w in caught if "local log" in str(w.message)]) == 1


def test_log_settings_are_validated():
    with pytest.raises(ValueError, match="log_every"):
        LocalLogConfig(every=0)
    with pytest.raises(ValueError, match="log_backups"):
        MonitorConfig.from_options(run_id="x", log_backups=0)


def test_log_dir_defaults_to_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("NANWATCH_LOG_DIR", str(tmp_path))
    assert MonitorConfig(run_id="x").log.dir is None  # constructing a config reads nothing
    assert resolve_config(MonitorConfig(run_id="x")).log.dir == str(tmp_path)
    assert resolve_config(MonitorConfig(run_id="x", log=LocalLogConfig(dir="given"))).log.dir == "given"
    monkeypatch.delenv("NANWATCH_LOG_DIR")
    assert resolve_config(MonitorConfig(run_id="x")).log.dir is None
