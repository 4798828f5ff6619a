"""The differential rerun on an accelerator's path (issue #35): the step's flag reaches the host without a
read in the step, and the step is classified a step later, at the next step start (or the next optimizer
pre-step), on the weights it saw. Forced on the CPU (``nanwatch.hooks.forensics.rerun.defers``), it must give
the same class, birth and capsule as the immediate path, for a precision overflow, a data NaN and a
not-reproducible NaN; its incident lands in the next step's report with its own step, and the log line and
``nanwatch status`` still tell it. A flag that lands only after the weights may have moved gives
``not_classified``, with the reason, never a wrong class."""

from __future__ import annotations

import contextlib
import io
import logging
import math
import warnings
from pathlib import Path

import pytest
import torch
from support import overflow_attention, tiny_qwen3, token_ids

import nanwatch
from nanwatch.cli import main
from nanwatch.hooks.forensics import rerun as rerun_module
from nanwatch.hooks.forensics import rerun_flags

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

K, STEPS = 1, 4


def _poison_once(model) -> None:
    """A NaN no arithmetic of the module makes, once (the training forward of step K): the rerun is finite."""
    fired: list[int] = []

    def hook(m, a, out):
        if fired:
            return out
        fired.append(1)
        return out * math.nan

    model.model.layers[0].mlp.down_proj.register_forward_hook(hook, prepend=True)


def _nan_input(batch: dict) -> dict:
    """A NaN in the batch itself (its embeddings): a data fault, whatever path runs."""
    embeds = batch.pop("embeds").clone()
    embeds[1, 3, 0] = math.nan
    return {**batch, "inputs_embeds": embeds}


FAULTS = {  # name: (dtype, attention, fault on the model before step K, fault on step K's batch, class)
    "precision": (torch.float16, "eager", overflow_attention, None, "precision"),
    "data": (torch.float32, "sdpa", None, _nan_input, "data_mask"),
    "not_reproducible": (torch.float32, "sdpa", _poison_once, None, "not_reproducible"),
}


def _train(fault: str, tmp_path: Path, monkeypatch, *, defer: bool, landed=None, steps: int = STEPS,
           directives: str = "off", no_update: frozenset | set = frozenset()):
    """A tiny Qwen3 trained with a guarded fused AdamW, ``fault`` at step K; ``defer``: the accelerator's
    path, forced; ``landed(flag, now)``: when a flag counts as landed (default: at once); ``directives``:
    ``directive_source``; ``no_update``: steps that only accumulate gradients. Returns the reports."""
    dtype, impl, on_model, on_batch, _ = FAULTS[fault]
    monkeypatch.setattr(rerun_module, "defers", lambda device: defer)
    now = [0]
    if landed is not None:
        monkeypatch.setattr(rerun_flags, "landed", lambda flag: landed(flag, now[0]))
    torch.manual_seed(0)
    model = tiny_qwen3(impl, dtype=dtype, vocab_size=64, use_cache=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    reports = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with nanwatch.attach(model, run_id=f"def-{fault}", optimizer=opt, directive_source=directives,
                             capsule_dir=str(tmp_path / "capsules"), log_dir=str(tmp_path / "logs")) as mon:
            assert mon._remedies.rerun.defer is defer  # noqa: SLF001 - the seam took
            for n in range(steps):
                now[0] = n
                if n == K and on_model is not None:
                    on_model(model)
                ids = token_ids(2, 32, seed=n, vocab=64)
                batch = {"input_ids": ids, "labels": ids}
                if n == K and on_batch is not None:
                    with torch.no_grad():
                        batch = on_batch({"labels": ids, "embeds": model.model.embed_tokens(ids)})
                with mon.step(n):
                    model(**batch).loss.backward()
                    if n not in no_update:
                        opt.step()
                        opt.zero_grad()
                reports.append(mon.last_report())
    return reports


def _incident(reports):
    """(index of the report carrying it, the incident); exactly one per run."""
    found = [(i, r.incident) for i, r in enumerate(reports) if r.incident is not None]
    assert len(found) == 1, found
    return found[0]


def _same(inc) -> dict:
    """What must not depend on when the step was decided (the seconds it took and the capsule's folder
    aside)."""
    keep = ("cls", "step", "site", "phase", "same", "fp32", "math", "fully_masked_rows", "birth", "birth_params",
            "birth_elements", "birth_kind", "path", "note")
    return {**inc.model_dump(include=set(keep)), "capsule": Path(inc.capsule).name if inc.capsule else None}


def _capsule(path: str) -> tuple[dict, dict]:
    """A capsule's metadata (the rerun's wall time aside) and its tensors."""
    import json

    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        meta = json.loads(f.metadata()["nanwatch.capsule"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
    meta["incident"].pop("seconds")
    return meta, {k: (t.dtype, t.shape, t.nan_to_num().sum().item(), t.isnan().sum().item()) for k, t in tensors.items()}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_the_deferred_decision_gives_the_immediate_class_and_capsule(fault, tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="nanwatch")
    now_reports = _train(fault, tmp_path / "now", monkeypatch, defer=False)
    at, now_inc = _incident(now_reports)
    assert at == K and now_inc.cls == FAULTS[fault][4], now_inc
    later_reports = _train(fault, tmp_path / "later", monkeypatch, defer=True)
    at, later_inc = _incident(later_reports)
    # decided at the next step start: the incident is in step K+1's report, with its own step
    assert at == K + 1 and later_inc.step == K, later_inc
    assert _same(later_inc) == _same(now_inc)
    assert later_inc.capsule and Path(later_inc.capsule).is_file()
    assert _capsule(later_inc.capsule) == _capsule(now_inc.capsule)  # the same call, tensors and settings
    # the step itself was named, and skipped, as on the immediate path
    assert [r.first_offender for r in later_reports] == [r.first_offender for r in now_reports]
    assert later_reports[K].step_skipped and later_reports[K].incident is None
    # the log line and `nanwatch status` tell it as step K's
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"nanwatch: step {K} (train)")]
    assert any(f"classified: {later_inc.cls}" in x or later_inc.cls in x for x in lines), lines
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["status", "--file", str(tmp_path / "later" / "logs")]) == 0
    assert f"incident at step {K} on rank 0: class {later_inc.cls}" in buf.getvalue(), buf.getvalue()


def test_a_flag_that_lands_at_the_next_optimizer_pre_step_is_still_sound(tmp_path, monkeypatch):
    # not landed at step K+1's start, landed by its optimizer's pre-step: decided there, on step K's weights
    calls: list[int] = []

    def landed(flag, now):
        calls.append(now)
        return calls.count(now) > 1 or now > K + 1  # the second look within step K+1: its pre-step

    reports = _train("precision", tmp_path, monkeypatch, defer=True, landed=landed)
    at, inc = _incident(reports)
    assert at == K + 1 and (inc.cls, inc.step, inc.birth) == ("precision", K, "model.layers.0.self_attn"), inc


def test_a_flag_that_lands_after_the_weights_may_have_moved_is_not_classified(tmp_path, monkeypatch):
    # in flight through step K+1's start and its optimizer pre-step (the update may move the weights)
    reports = _train("precision", tmp_path, monkeypatch, defer=True, landed=lambda flag, now: now >= K + 2)
    at, inc = _incident(reports)
    assert at == K + 2 and inc.step == K and inc.cls == "not_classified", inc
    assert "reached the host only after an optimizer update of step 2 may have moved the weights" in inc.note
    assert inc.capsule is None and inc.same == "skipped"


def test_a_fallback_applied_before_the_decision_does_not_change_the_path_re_run(tmp_path, monkeypatch):
    """Under the local rules step K's report (no class yet: it comes later) asks for fp32, applied at a
    later step's boundary. Step K+1 accumulates gradients (no optimizer step: the weights stay step K's) and the
    flag lands only at step K+2's start, after the fallback: the rerun still re-runs step K on the path step
    K ran (fp16 eager), so the class stays precision, never "not reproducible"."""
    reports = _train("precision", tmp_path, monkeypatch, defer=True, directives="local", no_update={K + 1},
                     landed=lambda flag, now: now >= K + 2)
    assert reports[K].attention_mode == "none" and reports[K + 2].attention_mode == "fp32"  # by the decision
    at, inc = _incident(reports)
    assert at == K + 2 and (inc.cls, inc.step, inc.same, inc.fp32) == ("precision", K, "nonfinite", "finite"), inc
