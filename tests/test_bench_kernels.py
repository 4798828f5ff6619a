"""``nanwatch bench kernels``: what nanwatch launches on the device, as counts for a fixed tiny model (never
times). The counter itself is checked on ops whose counts are known; nanwatch's counts are checked against
what its promises cost: no host sync, and each site's tensor read about once in forward; the meta device
(which the real-shape figures run on) against the CPU, op for op, except where nanwatch branches on the
device type; and the CLI end to end."""

from __future__ import annotations

import json

import pytest
import torch

from nanwatch.bench import kernels
from nanwatch.bench.dispatch_count import OpCounter
from nanwatch.bench.kernels import PHASES, SHAPES, Shape, cadence_plan, count_shape
from nanwatch.hooks.config import MonitorConfig

pytest.importorskip("transformers")

#: the tests' model: TINY_QWEN3 (2 layers, hidden 64, 4/2 heads x 16, vocab 128), 64 tokens, fp32
TINY = Shape("tiny", 2, 64, 128, 4, 2, 16, 128, 64, False, counted=(2,))
#: every site read every step: the defaults once the coarse rotation is gone (set while the field exists)


@pytest.fixture(scope="module")
def cli_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("kernels") / "k.json"
    argv = ["kernels", "--shapes", "tiny", "--dtype", "fp32", "--json", str(out)]
    from nanwatch.bench import main

    assert main(argv) == 0
    return json.loads(out.read_text())


def test_the_counter_counts_kernels_bytes_and_syncs_as_documented():
    x = torch.ones(16, 4)
    with OpCounter(device="cpu") as c:
        c.phase = "forward"
        y = x.view(-1)  # a view: no kernel
        y.sum()  # one kernel, reads 64 floats
        x.detach()
        torch.empty(3)  # allocation: no kernel
        c.phase = "end"
        x.sum().item()  # a kernel and a sync
        torch.nonzero(x > 0)  # a data-dependent shape: a sync (and the compare: a kernel)
    fwd, end = c.totals["forward"], c.totals["end"]
    assert (fwd.kernels, fwd.bytes, fwd.syncs) == (1, 256, 0)
    assert (end.kernels, end.syncs) == (3, 2)
    with OpCounter(device="meta") as m:  # on meta a sync is answered with a stand-in, and still counted
        t = torch.ones(4, device="meta")
        assert torch.isfinite(t).all().item() is True and bool(t.isnan().any()) is False
        t.to("cpu")  # a blocking copy to the host
    assert m.totals["begin"].syncs == 3


def test_the_plan_covers_every_cadence_of_the_defaults():
    plan = cadence_plan()
    defaults = MonitorConfig(run_id="x")
    assert plan["cadences"]["exact_logit_every"] == defaults.measure.exact_logit_every
    assert "param_check_every" not in plan["cadences"]  # the sweep is off by default (#35)
    # the optimizer check's cadence on an accelerator (None: resolved by the device; the bench models one)
    assert plan["cadences"]["optimizer_check_every"] == 16 and defaults.weights.optimizer_check_every is None
    c = plan["window"]
    assert c % 16 == 0 and plan["cycle"] % defaults.measure.exact_logit_every == 0
    starts = [w[0] for w in plan["windows"]]
    assert starts == sorted(starts) and starts[0] > c  # after a warm-up window, steps only go forward
    assert sum(w[1] for w in plan["windows"]) == pytest.approx(1 / c)  # a mean per step
    # a window that fires exact_logit_every holds one such step; the plain window none
    g = defaults.measure.exact_logit_every
    assert not any(n % g == 0 for n in range(starts[0], starts[0] + c))
    assert any(sum(n % g == 0 for n in range(s, s + c)) == 1 for s in starts[1:])


def test_nanwatch_adds_no_host_sync_and_reads_each_site_about_once(cli_results):
    r = cli_results["shapes"]["tiny"]
    extra = r["extra"]
    assert all(extra[p]["syncs"] == 0 for p in PHASES), extra
    assert r["bare"]["forward"]["syncs"] == 1  # the model's own (HF's packed-sequence check): counted, not ours
    # one read of each forward site's tensor, from the shapes alone: per layer the block, the MLP and the two
    # norms ([S, hidden] each) and the attention's query and output ([S, heads x head_dim] each); the
    # embedding and the final norm ([S, hidden]); the logits ([S, vocab]); fp32
    s, h, n = TINY.seq, TINY.hidden, TINY.layers
    once = 4 * (s * h * (4 * n + 2) + 2 * n * s * TINY.heads * TINY.head_dim + s * TINY.vocab)
    # measured 1.04x (the rest: the log-sum-exp rows, the position ids, the sampled exact logit, the slots)
    assert 0.9 * once <= extra["forward"]["bytes"] <= 1.25 * once
    # nanwatch's ops, found by the frames that issued them, are the extra: the attribution misses nothing
    attributed = r["by_function"].values()
    total = sum(extra[p]["kernels"] for p in PHASES)
    assert sum(c["kernels"] for c in attributed) == pytest.approx(total, abs=2)
    assert sum(c["bytes"] for c in attributed) == pytest.approx(sum(extra[p]["bytes"] for p in PHASES), rel=0.01)
    # the model's SDPA, called from nanwatch's wrapper, stays the model's
    assert not any("sdpa_probe.sdpa_call.<locals>.call" in k for k in r["by_function"])


@pytest.mark.slow
def test_the_meta_device_counts_what_the_cpu_counts_but_where_nanwatch_branches_on_the_device(cli_results,
                                                                                            monkeypatch):
    # The CPU differs by design in three places, made alike here: the differential rerun reads the step's
    # flag at the step's end on a CPU model and defers it elsewhere (forced to defer here, as on meta); the
    # optimizer check runs every step on the CPU and one step in 16 elsewhere (16 here too); and its
    # largest-|x| runs one aminmax per tensor on the CPU and one foreach norm elsewhere. Everything else
    # agrees, op for op.
    from nanwatch.hooks.forensics import rerun as rerun_module

    monkeypatch.setattr(rerun_module, "defers", lambda device: True)
    cpu = count_shape(TINY, 2, device="cpu", dtype=torch.float32,
                      options={"optimizer_check_every": 16})
    meta = cli_results["shapes"]["tiny"]  # the cli's run: meta, fp32, the same model and options
    for p in PHASES:
        cb, mb, ca, ma = cpu["bare"][p], meta["bare"][p], cpu["attached"][p], meta["attached"][p]
        assert (cb.kernels, cb.syncs) == (mb["kernels"], mb["syncs"]), p
        # the model's attention kernel: CPU flash on the CPU, flash's meta kernel on meta (its RNG state
        # tensors differ by a few bytes); nothing else
        assert cb.bytes == pytest.approx(mb["bytes"], abs=64), p
        if p != "optimizer":
            assert (ca.kernels - cb.kernels, ca.syncs) == pytest.approx((ma["kernels"] - mb["kernels"], ma["syncs"])), p
            assert ca.bytes - cb.bytes == pytest.approx(ma["bytes"] - mb["bytes"], abs=64), p
    branch = "optimizer_check._largest_abs"
    for name in set(cpu["by_function"]) | set(meta["by_function"]):
        if branch not in name:
            a, b = cpu["by_function"].get(name), meta["by_function"].get(name)
            assert a is not None and b is not None, name
            assert (a.kernels, a.bytes) == pytest.approx((b["kernels"], b["bytes"])), name
    assert any(branch in k for k in meta["by_function"]) and any(branch in k for k in cpu["by_function"])


def test_the_cli_prints_the_table_and_the_roofline(cli_results, capsys):
    assert set(cli_results["shapes"]) == {"tiny"} and cli_results["device"] == "meta"
    r = cli_results["shapes"]["tiny"]
    assert r["flops"] > 0 and r["roofline"]["extra_kernels"] == pytest.approx(
        sum(r["extra"][p]["kernels"] for p in PHASES))
    from nanwatch.bench.kernel_report import format_report

    text = format_report(cli_results)
    for p in (*PHASES, "step"):
        assert f"\n  {p} " in text
    assert "top 10 nanwatch functions by bytes read" in text and "H100 roofline" in text
    assert "45% of 989 TFLOP/s" in text and "85% of 3.35 TB/s" in text


def test_the_cli_refuses_what_it_cannot_count(capsys):
    assert kernels.main(["--shapes", "70b"]) == 2
    assert kernels.main(["--shapes", "8b", "--device", "cpu"]) == 2
    assert kernels.main(["--shapes", "tiny", "--config", "exact_logit_every=-1"]) == 2
    out = capsys.readouterr().out
    assert "unknown shapes ['70b']" in out and "only --shapes tiny" in out and "exact_logit_every" in out
    assert SHAPES["8b"].hidden == 4096 and SHAPES["1.7b"].layers == 28
    assert kernels.main(["--shapes", "tiny-moe"]) == 2  # meta: HF's experts loop reads its routes on the host
    assert kernels.main(["--shapes", "tiny", "--device", "cpu", "--rollout-routes"]) == 2
    out = capsys.readouterr().out
    assert "MoE shapes need --device cpu or cuda" in out and "--rollout-routes needs an MoE shape" in out


@pytest.mark.slow
def test_the_rollout_routes_step_is_counted_and_costs_the_same_kernels_for_any_number_of_routers():  # ~30 s
    """#39: a step with ``rlhf(rollout_routes=)`` against one without, on the tiny Qwen3-MoE: the comparison runs
    at the step's end, every router at once (its kernels do not grow with the routers), and adds no sync there."""
    shape = SHAPES["tiny-moe"]
    every = {"exact_logit_every": 0, "optimizer_check_every": 1, "directive_check_every": 1, "replica_check_every": 0}
    off = count_shape(shape, 2, device="cpu", dtype=torch.float32, options=every)  # one window of one step
    on = {n: count_shape(shape, n, device="cpu", dtype=torch.float32, options=every, rollout_routes=True)
          for n in (2, 4)}
    compare = {n: sum(c.kernels for k, c in r["by_function"].items() if "MoeTaps._compare" in k) for n, r in on.items()}
    assert compare[2] > 0 and compare[2] == compare[4]
    assert not any("MoeTaps._compare" in k for k in off["by_function"])
    end = {n: r["attached"]["end"].syncs for n, r in on.items()}
    assert end[2] == off["attached"]["end"].syncs and end[4] == end[2]
    # the routers' load: one index_add_ per router and forward, in the forward
    loads = {n: sum(c.kernels for k, c in r["by_function"].items() if "scatter_add" in k and "MoeTaps" in k)
             for n, r in on.items()}
    assert (loads[2], loads[4]) == (2, 4)


def test_host_work_beside_a_device_model_is_not_device_work():
    with OpCounter(device="meta") as m:
        torch.ones(3).sum().item()  # a CPU tensor's item(): no kernel, no device sync
        torch.ones(3, device="meta").sum()
    assert (m.totals["begin"].kernels, m.totals["begin"].syncs) == (2, 0)
