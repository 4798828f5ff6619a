"""The benchmark harnesses work end to end on very small inputs. Structure only: speed is never asserted."""

from __future__ import annotations

import json
import re
import statistics

import pytest
import torch
import torch.nn.functional as F

from nanwatch.bench import step as bench

pytest.importorskip("transformers")

TINY = ["--layers", "1", "--batch", "1", "--seq", "16", "--hidden", "32", "--heads", "2", "--kv-heads", "1",
        "--head-dim", "16", "--intermediate", "64", "--vocab", "128", "--steps", "2", "--repeats", "1",
        "--warmup", "1"]


def test_main_runs_every_variant_and_writes_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert bench.main([*TINY, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    results = json.loads(out.read_text())
    assert list(results["variants"]) == list(bench.VARIANTS)
    for name, row in results["variants"].items():
        assert row["n"] == 2 and len(row["times_ms"]) == 2, name
        assert all(t > 0 for t in row["times_ms"]), name
        assert row["median_ms"] > 0 and row["min_ms"] <= row["median_ms"] <= row["max_ms"], name
        assert row["ratio"] == pytest.approx(row["median_ms"] / results["variants"]["bare"]["median_ms"])
        assert name in printed
    assert results["variants"]["bare"]["ratio"] == 1.0 and results["variants"]["bare"]["added_ms"] == 0.0
    assert results["variants"]["bare"]["paired_ratio"] == 1.0  # each bare round against itself
    assert all(row["paired_ratio"] > 0 for row in results["variants"].values())
    rows = results["variants"]
    dbg_added, key = rows["debug_underflow_overflow"]["paired_added_ms"], results["nanwatch_added_vs_debug_added"]
    if dbg_added > 0:  # the headline ratio is nanwatch's added time over DebugUnderflowOverflow's, paired per round
        assert key == pytest.approx(rows["nanwatch"]["paired_added_ms"] / dbg_added)
        assert f"DebugUnderflowOverflow added time (paired) = {key:.3f}" in printed
    else:  # on a noisy machine DUO can come out no slower than bare: then there is no ratio to print
        assert key is None and "DebugUnderflowOverflow added time" not in printed
    floor = results["floor"]  # one aminmax of each tensor nanwatch reads, timed where it reads them
    assert floor["steps"] == 2 and floor["reads"] > 0 and floor["ms"] > 0
    assert results["nanwatch_added_vs_floor"] == pytest.approx(rows["nanwatch"]["paired_added_ms"] / floor["ms"])
    assert f"floor: one aminmax of each of the {floor['reads']} tensors" in printed
    # no --dtype: auto, the CPU's native choice, said up front
    dtype, why = bench.choose_dtype("cpu")
    assert results["config"]["layers"] == 1 and results["config"]["dtype"] == dtype
    assert results["config"]["dtype_choice"] == why and printed.startswith(f"nanwatch bench: dtype {dtype} ({why})")
    assert "tiny Qwen3 (sdpa) 1 layers, hidden 32" in printed
    # the harness leaves nothing attached behind
    from nanwatch.hooks.instrument import patching

    assert not patching.is_installed() and F.scaled_dot_product_attention is patching.ORIGINAL_SDPA


def test_variant_subset_always_keeps_bare(tmp_path):
    out = tmp_path / "b.json"
    assert bench.main([*TINY, "--variants", "nanwatch", "--json", str(out)]) == 0
    assert list(json.loads(out.read_text())["variants"]) == ["bare", "nanwatch"]


def test_sdpa_backend_math_runs_every_step_on_the_math_kernel(tmp_path, capsys):
    out = tmp_path / "b.json"
    assert bench.main([*TINY, "--variants", "nanwatch", "--sdpa-backend", "math", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert results["config"]["sdpa_backend"] == "math" and list(results["variants"]) == ["bare", "nanwatch"]
    assert "attention on math sdpa" in capsys.readouterr().out
    with bench.sdpa_context("math"):  # what each timed step runs under
        assert torch.backends.cuda.math_sdp_enabled() and not torch.backends.cuda.flash_sdp_enabled()
        assert not torch.backends.cuda.mem_efficient_sdp_enabled() and not torch.backends.cuda.cudnn_sdp_enabled()
    assert torch.backends.cuda.flash_sdp_enabled()  # and only those


@pytest.mark.parametrize("backend", ["efficient", "cudnn"])
def test_a_backend_without_a_kernel_for_the_step_is_reported_not_a_crash(backend, tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("on CUDA these backends have kernels: the CPU is the machine without one")
    out = tmp_path / "b.json"
    assert bench.main([*TINY, "--sdpa-backend", backend, "--json", str(out)]) == 4
    results = json.loads(out.read_text())
    assert results["variants"] == {} and f"sdpa backend {backend!r} cannot run this step on cpu" in results["unavailable"]
    assert results["unavailable"] in capsys.readouterr().out


def test_an_unknown_sdpa_backend_is_refused():
    with pytest.raises(SystemExit):
        bench.main([*TINY, "--sdpa-backend", "nope"])
    with pytest.raises(ValueError, match="sdpa_backend"):
        bench.BenchConfig(sdpa_backend="nope")


_BAD = [["--layers", "0"], ["--heads", "3", "--kv-heads", "2"], ["--variants", "nope"]]
if not torch.cuda.is_available():
    _BAD.append(["--device", "cuda"])


@pytest.mark.parametrize("argv", _BAD)
def test_bad_options_exit_2(argv, capsys):
    assert bench.main([*TINY, *argv]) == 2
    assert "nanwatch bench:" in capsys.readouterr().out


def test_debug_underflow_overflow_hooks_are_removed():
    from transformers.debug_utils import DebugUnderflowOverflow

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    dbg = DebugUnderflowOverflow(model)
    assert all(len(m._forward_hooks) == 1 for m in model.modules())
    assert bench._remove_debug_hooks(model, dbg) == 4
    assert all(len(m._forward_hooks) == 0 for m in model.modules())


@pytest.mark.slow
def test_collector_mode_loads_a_real_collector(capsys):
    from nanwatch.bench import main

    assert main(["collector", "--ranks", "4", "--sites", "8", "--duration", "1.5", "--warmup", "0.5",
                 "--scrape-every", "0.5"]) == 0
    printed = capsys.readouterr().out
    assert "load: 4 ranks x 8 sites" in printed
    # every report sent in the measured window was answered 200, and scrapes were timed
    statuses = printed.split("statuses ", 1)[1].splitlines()[0]
    assert statuses.startswith("{200: ") and statuses.count(":") == 1, statuses
    assert "/metrics: " in printed and "collector RSS" in printed


@pytest.mark.slow
def test_collector_job_mode_matrix_sends_both_ways_side_by_side(capsys):
    """--matrix: each size per rank and per job against a fresh collector, then one table; job mode primes
    every rank (a heartbeat each) and sends job reports, details and heartbeats, all answered 200."""
    from nanwatch.bench import main

    assert main(["collector", "--matrix", "--matrix-ranks", "16", "--matrix-scrapes", "0.5", "--sites", "8",
                 "--duration", "1.5", "--warmup", "0.5", "--heartbeat-every", "1", "--heartbeat-batch", "4"]) == 0
    printed = capsys.readouterr().out
    assert "job-level: a job report + 2 details at 1.0/s, heartbeats every 1 s in batches of 4" in printed
    assert "  job: p50 " in printed and "  heartbeat: p50 " in printed  # latency by what was sent
    rows = [line.split(" | ") for line in printed.splitlines() if line.startswith("| 1 x 16 |")]
    assert [r[1] for r in rows] == ["rank", "job"]
    assert all(r[-2] == "0" for r in rows), rows  # nothing but 200s
    job_reports = float(rows[1][3].split()[0])
    assert job_reports > 0 and "(19)" in rows[1][3]  # target: 3 reports a step + 16 heartbeats a second


def test_job_step_reduces_like_the_collector_reads_it():
    from nanwatch.bench.jobs import job_step
    from nanwatch.bench.load import synthetic_report

    ranks = [synthetic_report(rank=k, world_size=3, nan_at="model.layers.2.self_attn" if k == 2 else
                              "model.layers.1.self_attn" if k == 1 else None, nan=1 if k else 0, logit=10.0 + k)
             for k in range(3)]
    job, details = job_step(ranks)
    assert (job.scope, job.rank, job.ranks_reporting) == ("job", 0, 3)
    # the earliest site in execution order, whichever rank held it
    assert (job.first_offender, job.first_offender_rank) == ("model.layers.1.self_attn", 1)
    assert job.nonfinite_total == 2 and [d.rank for d in details] == [1, 2]
    assert max(lg.bound for lg in job.logits) == 12.0 + 3  # rank 2's, layer 3
    assert sum(c.calls for c in job.sdpa) == 3 * 4


def test_the_floor_reads_what_nanwatch_reads():
    """The floor variant reads as many tensors a step as nanwatch does (one aminmax each), and leaves no
    hook behind."""
    from nanwatch.bench.floor import Floor
    from nanwatch.bench.tiny_models import tiny_qwen3
    from nanwatch.hooks import attach

    model = tiny_qwen3("sdpa", num_hidden_layers=2, use_cache=False).train()
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    with attach(model, run_id="floor") as mon, mon.step(0):
        model(input_ids=ids, labels=ids).loss.backward()
    r = mon.last_report()  # parameters are read too, but reported only when non-finite: counted in coverage
    nanwatch_reads = sum(s.calls for s in r.sites) + r.coverage.params_checked
    floor = Floor(model)
    with floor.round(), floor.step(0):
        model(input_ids=ids, labels=ids).loss.backward()
    assert floor.reads == nanwatch_reads
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


@pytest.mark.slow
def test_collector_attack_mode_reports_both_phases_and_the_ratio(capsys):
    from collector_attack_bench import main

    assert main(["--ranks", "4", "--sites", "8", "--duration", "1.5", "--warmup", "0.5",
                 "--attack", "scrape", "--attackers", "2", "--rounds", "2", "--settle", "0.5"]) == 0
    printed = capsys.readouterr().out
    assert "attack: scrape x2" in printed and "2 rounds of 1.5 s unloaded, then 1.5 s under attack" in printed
    assert "phase 1, unloaded:" in printed and "phase 2, under attack (scrape x2):" in printed
    # each phase has its throughput and latency lines, and the attacker's own line is in phase 2
    assert printed.count("sustained: ") == 2 and printed.count("ingest latency: ") == 2
    assert "scrape x2: " in printed.split("phase 2", 1)[1]
    assert "p99 under attack / p99 unloaded = " in printed


@pytest.mark.slow
def test_collector_attack_all_runs_every_kind_of_issue_19_at_once(capsys):
    """Each new attack kind (#19) runs against a real collector that wants a token, beside the ranks, and
    reports what it did; the ranks' p99 ratio and their refused requests are printed."""
    from collector_attack_bench import main
    from collector_attacks import ATTACKS, HELD

    assert main(["--ranks", "2", "--sites", "4", "--duration", "2", "--warmup", "0.5",
                 "--attack", "all", "--attackers", "1", "--rounds", "1", "--settle", "0", "--connections", "4"]) == 0
    printed = capsys.readouterr().out
    attacked = printed.split("phase 2", 1)[1]
    for kind in ("trailers", "preauth-bodies", "error-bodies", "accept-versions", "abandoned-polls", "runs-listing"):
        assert kind in ATTACKS and f"{kind} x1: " in attacked, kind
    for kind in HELD:  # every held kind got its connection open (a refused one reopens it: more than one)
        opened = re.search(rf"{kind} x1: (\d+) connections opened", attacked)
        assert opened is not None and int(opened.group(1)) >= 1, kind
    assert "primed for runs-listing: 36 requests of 256 runs" in printed
    assert "abandoned-polls x1: 0 requests" not in attacked  # polls are sent and dropped in a tight loop
    assert "p99 under attack / p99 unloaded = " in printed and "ranks' requests not answered 200: " in printed


def test_attack_plans_cover_every_kind_and_fit_the_file_limit():
    from collector_attack_bench import _parser
    from collector_attacks import ATTACKS, DEFAULT_ATTACKERS, HELD, plan_attack

    args = _parser().parse_args(["--attack", "each", "--connections", "100"])
    plan = plan_attack(args, nofile=1000)
    assert set(plan) == set(ATTACKS) == set(DEFAULT_ATTACKERS)
    assert sum(plan.values()) + 100 + 64 <= 1000 and all(plan[k] == DEFAULT_ATTACKERS[k] for k in plan if k not in HELD)
    assert plan_attack(_parser().parse_args(["--attack", "trailers"]), nofile=20_000) == {"trailers": 4}


@pytest.mark.slow
def test_guard_mode_times_the_reduction_on_and_off_side_by_side(capsys, tmp_path):
    from nanwatch.bench import main

    out = tmp_path / "guard.json"
    assert main(["guard", "--rounds", "2", "--warmup", "0", "--seq", "8", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "step, reduction off" in printed and "step, reduction on" in printed and "the reduction alone" in printed
    r = json.loads(out.read_text())
    assert (r["ranks"], r["device"], r["rounds"]) == (2, "cpu", 2) and r["step_off_s"] > 0 and r["reduce_s"] > 0


def test_optimizer_mode_times_the_guard_and_the_check_side_by_side(capsys, tmp_path):
    from nanwatch.bench import main

    out = tmp_path / "optimizer.json"
    assert main(["optimizer", "--rounds", "2", "--warmup", "0", "--block", "1", "--seq", "8", "--layers", "1",
                 "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    for line in ("guard off, no check", "guard (host read)", "post-step check", "guard + check (default)",
                 "the check alone"):
        assert line in printed
    r = json.loads(out.read_text())
    assert (r["device"], r["rounds"], r["block"]) == ("cpu", 2, 1)
    assert all(r[f"step_{arm}_s"] > 0 and r[f"ratio_{arm}"] > 0 for arm in ("bare", "guard", "check", "both"))
    assert r["check_alone_s"] > 0


@pytest.mark.parametrize("argv", [["--rounds", "0"], ["--block", "0"]])
def test_optimizer_mode_refuses_what_it_cannot_measure(capsys, argv):
    from nanwatch.bench import main

    assert main(["optimizer", *argv]) == 2
    assert "nanwatch bench optimizer:" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--ranks", "1"], ["--rounds", "0"]])
def test_guard_mode_refuses_what_it_cannot_measure(capsys, argv):
    from nanwatch.bench import main

    assert main(["guard", *argv]) == 2
    assert "nanwatch bench guard:" in capsys.readouterr().out


def test_rollout_mode_times_rlhf_with_and_without_the_rollout_side_by_side(capsys, tmp_path):
    from nanwatch.bench import main

    out = tmp_path / "rollout.json"
    assert main(["rollout", "--rounds", "2", "--warmup", "0", "--block", "1", "--seq", "16", "--completion", "8",
                 "--layers", "1", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    for line in ("no rlhf()", "rlhf(rollout_logprobs=)", "rlhf() call alone", "rlhf(rollout_logprobs=) call alone"):
        assert line in printed
    r = json.loads(out.read_text())
    assert all(r[f"step_{arm}_s"] > 0 and r[f"ratio_{arm}"] > 0 for arm in ("bare", "rlhf", "rollout"))
    assert r["call_rlhf_s"] > 0 and r["call_rollout_s"] > 0


@pytest.mark.parametrize("argv", [["--rounds", "0"], ["--completion", "16", "--seq", "16"]])
def test_rollout_mode_refuses_what_it_cannot_measure(capsys, argv):
    from nanwatch.bench import main

    assert main(["rollout", *argv]) == 2
    assert "nanwatch bench rollout:" in capsys.readouterr().out
def test_fingerprint_mode_times_the_weight_fingerprint_against_adamw(capsys, tmp_path):
    from nanwatch.bench import main

    out = tmp_path / "fingerprint.json"
    assert main(["fingerprint", "--params", "2e5", "--hidden", "64", "--rounds", "2", "--warmup", "0",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["params"] > 1e5 and result["tensors"] >= 10
    assert {"fingerprint_s", "adamw_s", "adamw_fused_s", "ratio_to_adamw", "ratio_to_adamw_fused"} <= set(result)
    assert "fingerprint / adamw" in capsys.readouterr().out
    assert main(["fingerprint", "--rounds", "0"]) == 2


_PROFILE_TINY = TINY[:TINY.index("--repeats")] + TINY[TINY.index("--repeats") + 2:]


def test_profile_measures_every_component_against_defaults(tmp_path, capsys):
    """``nanwatch bench profile``: every component arm runs interleaved with bare and defaults, each paired per
    round; the reporter thread's CPU and the hand-over are measured; nothing stays attached."""
    from nanwatch.bench import main as bench_main
    from nanwatch.bench import profile

    out = tmp_path / "profile.json"
    tiny = _PROFILE_TINY
    assert bench_main(["profile", *tiny, "--rounds", "2", "--dtype", "fp32", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    r = json.loads(out.read_text())
    assert list(r["arms"]) == list(profile.ARMS)
    for name, arm in r["arms"].items():
        assert len(arm["round_ms"]) == 2 and all(t > 0 for t in arm["round_ms"]), name
        if name != "bare":  # each nanwatch arm: its reporter thread's CPU and the training thread's hand-over
            for key in ("step_end_ms", "capture_ms", "reporter_ms"):
                assert len(arm[key]) == 2 and all(t > 0 for t in arm[key]), (name, key)
            assert all(c < e for c, e in zip(arm["capture_ms"], arm["step_end_ms"], strict=True)), name
    comps = r["components"]
    assert list(comps) == ["total", *profile.COMPONENTS, "exact_logit"]
    d, b = r["arms"]["defaults"]["round_ms"], r["arms"]["bare"]["round_ms"]
    assert comps["total"]["added_ms"] == pytest.approx(statistics.median(x - y for x, y in zip(d, b, strict=True)))
    off = r["arms"]["grads_off"]["round_ms"]  # a component's cost: defaults minus the arm without it
    assert comps["grads_off"]["added_ms"] == pytest.approx(statistics.median(x - y for x, y in zip(d, off, strict=True)))
    assert comps["grads_off"]["pct_of_bare"] == pytest.approx(100 * comps["grads_off"]["added_ms"] / r["bare_ms"])
    assert comps["exact_logit"]["amortised_ms"] == pytest.approx(comps["exact_logit"]["added_ms"] / 100)
    assert r["config"]["dtype"] == "fp32" and "fp32: bare step" in printed
    for name in profile.COMPONENTS:
        assert re.search(rf"^{name}\s+[+-]\d", printed, re.M), name
    from nanwatch.hooks.instrument import patching

    assert not patching.is_installed() and F.scaled_dot_product_attention is patching.ORIGINAL_SDPA
    from nanwatch.hooks.report.reporter import Reporter

    assert Reporter.capture.__qualname__ == "Reporter.capture"  # the timing wrapper is gone


def test_profile_arm_subset_and_bad_options(tmp_path, capsys):
    from nanwatch.bench import profile

    out = tmp_path / "p.json"
    tiny = _PROFILE_TINY
    assert profile.main([*tiny, "--rounds", "1", "--arms", "spikes_off", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert list(r["arms"]) == ["bare", "defaults", "spikes_off"] and list(r["components"]) == ["total", "spikes_off"]
    assert r["entry_points"] is None  # no clocks unless asked
    assert profile.main([*tiny, "--rounds", "2", "--arms", "bare", "--timers", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    entries = r["entry_points"]  # every entry point clocked in the defaults arm, each a share of the step
    from nanwatch.bench import host_timers

    assert len(entries) == len(host_timers.ENTRY_POINTS)
    assert entries["sdpa_probe._after_sdpa"]["ms"] > 0 and entries["Monitor.end_step"]["ms"] > 0
    assert entries["OptimizerCheck._check"]["ms"] > 0 and entries["Monitor.rlhf"]["ms"] > 0
    assert sum(e["ms"] for e in entries.values()) < r["defaults_ms"]
    assert "clocked per entry point" in capsys.readouterr().out
    from nanwatch.hooks import facade
    from nanwatch.hooks.instrument import sdpa_probe

    assert facade.Monitor.end_step.__qualname__ == "Monitor.end_step"  # every clock removed
    assert sdpa_probe._after_sdpa.__name__ == "_after_sdpa"
    assert profile.main([*tiny, "--arms", "nope"]) == 2
    assert profile.main([*tiny, "--layers", "0"]) == 2
    assert "nanwatch bench profile:" in capsys.readouterr().out


@pytest.mark.parametrize(("flags", "capability", "device", "dtype"), [
    ("fpu sse2 avx2 fma", "AVX2", "cpu", "fp32"),  # AVX2 only (the AMD EPYC where bf16 took 9.5 s a step)
    ("fpu avx2 avx512f avx512_bf16", "AVX512", "cpu", "bf16"),
    ("fpu avx2 amx_bf16 amx_tile", "AVX512", "cpu", "bf16"),
    ("fpu avx2 avx512f avx512_bf16", "AVX2", "cpu", "fp32"),  # ATEN_CPU_CAPABILITY=avx2: the units go unused
    ("fpu avx2 avx512_bf16x", "AVX512", "cpu", "fp32"),  # a whole flag, not a substring
    ("", "DEFAULT", "cpu", "fp32"),  # no /proc/cpuinfo (not Linux): the safe choice
    ("fpu avx2", "AVX2", "cuda", "bf16"),
])
def test_auto_dtype_is_bf16_only_where_the_device_runs_it_natively(flags, capability, device, dtype):
    chosen, why = bench.choose_dtype(device, cpu_flags=flags, capability=capability)
    assert chosen == dtype and why.startswith(f"auto: {dtype}")
    if dtype == "fp32":
        assert "bf16 would be emulated" in why and ("no bf16 units" in why) == (
            not {"avx512_bf16", "amx_bf16"} & set(flags.split()))


def test_an_explicit_dtype_is_kept_and_auto_is_resolved_at_construction():
    assert bench.BenchConfig(dtype="fp16").dtype == "fp16" and bench.BenchConfig(dtype="fp16").dtype_choice is None
    auto = bench.BenchConfig()
    assert auto.dtype in ("bf16", "fp32") and auto.dtype_choice.startswith("auto: ")
    with pytest.raises(ValueError, match="or 'auto'"):
        bench.BenchConfig(dtype="int8")
