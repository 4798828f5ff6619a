"""``nanwatch status`` from both sources, one real run feeding both: a collector (``nanwatch serve`` on
loopback) and the trainer's local JSONL record (``--file``). Both show the stage of SDPA calls, skipped
steps, RLHF health, the lifecycle, non-finite counts with their unit, and headroom as a readable share."""

from __future__ import annotations

import json
import math
import re
import time
import warnings

import pytest
import torch
from support import CollectorProcess, step_reports, tiny_qwen3, token_ids

import nanwatch
from nanwatch.cli import main
from nanwatch.wire import StepReport

RUN = "visible"


def _train(log_dir, collector=None, token=None, steps: int = 5, nan_step: int = 2) -> list[StepReport]:
    """``steps`` steps of a tiny Qwen3 with RLHF figures (``Monitor.rlhf``), an evaluation forward in each
    step, and a NaN born in layer 1's MLP at ``nan_step`` (the guarded fused AdamW skips that step)."""
    model = tiny_qwen3("sdpa", vocab_size=64, hidden_size=32, intermediate_size=64, use_cache=False)
    now = {"step": -1}
    model.model.layers[1].mlp.register_forward_hook(
        lambda m, a, out: out.index_fill(1, torch.tensor([0]), math.nan) if now["step"] == nan_step and m.training
        else None)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    seen: list[StepReport] = []
    with nanwatch.attach(model, run_id=RUN, collector=collector, token=token, optimizer=opt, log_dir=str(log_dir),
                         on_report=step_reports(seen)) as mon:
        for n in range(steps):
            now["step"] = n
            ids = token_ids(2, 16, seed=n, vocab=64)
            with mon.step(n):
                out = model(input_ids=ids, labels=ids)
                lp = out.logits.float().log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
                mon.rlhf(logprobs=lp, old_logprobs=lp.detach(), ref_logprobs=lp.detach() - 0.05,
                         advantages=torch.tensor([1.0, -1.0]), mask=torch.ones_like(lp))
                out.loss.backward()
                opt.step()
                opt.zero_grad()
                model.eval()
                with torch.no_grad():
                    model(input_ids=ids)
                model.train()
    return seen


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    """(reports, the ``--file`` output, the collector's output) of one run."""
    tmp = tmp_path_factory.mktemp("status")
    with CollectorProcess(db_path=tmp / "c.db") as c:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            reports = _train(tmp / "logs", collector=c.url)
        out = {}
        for name, argv in (("file", ["status", "--file", str(tmp / "logs")]),
                           ("collector", ["status", RUN, "--url", c.url])):
            import contextlib
            import io

            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                assert main(argv) == 0
            out[name] = buf.getvalue()
    return reports, out["file"], out["collector"]


def _line(text: str, start: str) -> str:
    return next(x.strip() for x in text.splitlines() if x.strip().startswith(start))


@pytest.mark.parametrize("source", ["file", "collector"])
def test_status_shows_stage_skips_rlhf_units_and_readable_headroom(both, source):
    reports, from_file, from_collector = both
    out = from_file if source == "file" else from_collector
    assert [r.step_skipped for r in reports] == [False, False, True, False, False]
    # SDPA calls by stage: the training steps' and the evaluation forwards', apart
    train = sum(c.calls for r in reports for c in r.sdpa if c.stage == "train")
    evals = sum(c.calls for r in reports for c in r.sdpa if c.stage == "eval")
    assert train and evals
    assert re.search(rf"sdpa cpu_flash\s+float32\s+train\s+{train} calls", out), out
    assert re.search(rf"sdpa cpu_flash\s+float32\s+eval\s+{evals} calls", out), out
    # counts with their unit: site visits, and the elements at the birth from the incident
    visits = sum(s.nan + s.inf for r in reports for s in r.sites)
    assert f"non-finite site visits: {visits} " in out
    inc = reports[2].incident
    assert inc is not None and inc.birth_elements > 0
    assert f"incident at step 2 on rank 0: class {inc.cls}; born at {inc.birth}" in out
    assert f"{inc.birth_elements} non-finite element" in out
    assert "first non-finite: model.layers.1.mlp (forward, train) on rank 0 at step 2" in out
    assert "skipped steps: 1 " in out
    # RLHF health of the latest step, from Monitor.rlhf
    rl = reports[-1].rlhf
    assert rl is not None
    rlhf = _line(out, "rlhf:")
    assert f"ratio max {rl.ratio_max:.4g}" in rlhf and f"KL k3 mean {rl.kl_k3_mean:.4g}" in rlhf
    assert "clip 0%" in rlhf and "non-finite none" in rlhf
    # headroom as a share of the dtype's max, never a bare 1e-40
    head = _line(out, "headroom")
    assert "of max" in head and not re.search(r"\de-\d", head), head
    assert _line(out, f"run {RUN}:").startswith(f"run {RUN}: ended")  # the final report: from both sources


def test_both_sources_agree(both):
    _, from_file, from_collector = both
    for start in ("non-finite site visits", "skipped steps", "sdpa", "first non-finite", "incident", "rlhf:",
                  "headroom"):
        assert [x for x in from_file.splitlines() if x.strip().startswith(start)] == [
            x for x in from_collector.splitlines() if x.strip().startswith(start)], start


def _write(path, *records) -> None:
    path.write_text("".join((r if isinstance(r, str) else r.model_dump_json()) + "\n" for r in records))


def test_a_report_that_raised_reads_as_crashed(tmp_path, capsys):
    t = time.time()
    _write(tmp_path / "boom.rank0.a.jsonl",
           StepReport(run_id="boom", incarnation="a", seq=0, step=6, time=t - 1),
           StepReport(run_id="boom", incarnation="a", seq=1, step=7, time=t, raised="FloatingPointError"))
    assert main(["status", "--file", str(tmp_path / "boom.rank0.a.jsonl")]) == 0
    out = capsys.readouterr().out
    assert "run boom: crashed (rank 0 raised FloatingPointError at step 7)" in out
    assert "rank 0: crashed, step 7" in out


def test_the_collector_says_crashed_too(tmp_path, capsys):
    from nanwatch.hooks.report.transport import ReportSender

    t = time.time()
    with CollectorProcess(db_path=tmp_path / "c.db") as c:
        sender = ReportSender(c.url)
        for r in (StepReport(run_id="boom", incarnation="a", seq=0, step=6, time=t - 1),
                  StepReport(run_id="boom", incarnation="a", seq=1, step=7, time=t, raised="FloatingPointError")):
            assert sender.submit(r)
        assert sender.close(timeout_s=10) and sender.delivered == 2
        assert main(["status", "boom", "--url", c.url]) == 0
    out = capsys.readouterr().out
    assert "run boom: crashed (rank 0 raised FloatingPointError at step 7)" in out, out


def test_a_silent_rank_and_an_ended_one(tmp_path, capsys):
    t = time.time()
    _write(tmp_path / "quiet.rank0.a.jsonl", StepReport(run_id="quiet", incarnation="a", seq=0, step=3, time=t - 600))
    _write(tmp_path / "done.rank0.b.jsonl", StepReport(run_id="done", incarnation="b", seq=0, step=9, time=t - 600),
           json.dumps({"nanwatch_log": "closed", "run_id": "done", "rank": 0, "incarnation": "b", "time": t - 599,
                       "last_step": 9}))
    assert main(["status", "--file", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "run done: ended" in out
    assert re.search(r"run quiet: silent: rank 0 quiet for 6\d\d s", out), out
    assert main(["status", "quiet", "--file", str(tmp_path), "--late-after", "3600"]) == 0
    assert "run quiet: live" in capsys.readouterr().out
    assert main(["status", "nope", "--file", str(tmp_path)]) == 1
    assert main(["status", "--file", str(tmp_path / "missing")]) == 2


def test_a_weight_sync_line_from_both_sources(tmp_path, capsys):
    """#36: the collector's view gives the latest published version and each rollout worker's outcome,
    posted and verified versions and lag; the trainer's local record gives its side (the latest published)."""
    import copy

    from nanwatch.weight_sync import post_weights

    model = tiny_qwen3("sdpa", vocab_size=64, hidden_size=32, intermediate_size=64, use_cache=False)
    engine = copy.deepcopy(model).to(torch.bfloat16)  # a bf16 rollout copy, synced once
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with CollectorProcess(db_path=tmp_path / "c.db") as c:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with nanwatch.attach(model, run_id="synced", collector=c.url, optimizer=opt,
                                 log_dir=str(tmp_path / "logs")) as mon:
                for n in range(2):
                    ids = token_ids(2, 16, seed=n, vocab=64)
                    with mon.step(n):
                        model(input_ids=ids, labels=ids).loss.backward()
                        opt.step()
                        opt.zero_grad()
                    mon.last_report()
                    if n == 0:
                        engine.load_state_dict(model.state_dict())
                    mon.publish_weights(n)
                    post_weights(c.url, "synced", n, nanwatch.fingerprint(engine), worker="vllm-0")
        assert main(["status", "synced", "--url", c.url]) == 0
        from_collector = capsys.readouterr().out
    assert main(["status", "--file", str(tmp_path / "logs")]) == 0
    from_file = capsys.readouterr().out
    assert _line(from_collector, "weight sync:") == ("weight sync: latest published v1; 1 rollout workers: 0 verified, "
                                                     "1 mismatched, 0 dtype or shape differs, 0 lagging")
    assert _line(from_collector, "worker vllm-0:") == "worker vllm-0: mismatch, posted v1, verified v0"
    assert _line(from_file, "weight sync:").startswith("weight sync: latest published v1 (the trainer's record")
