"""Reports in, metrics and run state out, through a real sender and a real uvicorn."""

import json
import math
import subprocess
import threading

import httpx
import pytest
from support import ADMIN, TOKEN, require_tool, scrape, step_report

from nanwatch.hooks.report.transport import DirectivePoller, ReportSender
from nanwatch.monitor.data.metric_table import METRICS
from nanwatch.wire import ReportBatch

AUTH = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}


def _get(s, name, **labels):
    return s.get((name, frozenset(labels.items())))


def test_sender_streams_reports_and_metrics_show_them(collector):
    sender = ReportSender(collector.url, token=TOKEN, batch_max=8)
    for step in range(5):
        for rank in range(3):
            bad = rank == 1 and step == 3
            r = step_report(run_id="stream", rank=rank, seq=step, nan_at="model.layers.2.self_attn" if bad else None,
                            nan=7 if bad else 0, inf=2 if bad else 0)
            assert sender.submit(r)
    assert sender.close(timeout_s=10)
    assert sender.delivered == 15 and sender.dropped == 0
    s = scrape(collector.url)
    nf = "nanwatch_nonfinite_calls_total"
    assert _get(s, nf, run_id="stream", rank="1", **{"pass": "forward"}, kind="nan") == 7
    assert _get(s, nf, run_id="stream", rank="1", **{"pass": "forward"}, kind="inf") == 2
    assert _get(s, nf, run_id="stream", rank="0", **{"pass": "forward"}, kind="nan") == 0
    assert _get(s, "nanwatch_site_nonfinite_calls_total", run_id="stream", site="model.layers.2.self_attn",
                **{"pass": "forward"}) == 9
    assert _get(s, "nanwatch_sdpa_calls_total", run_id="stream", backend="flash", dtype="bfloat16",
                stage="train") == 60
    assert _get(s, "nanwatch_attention_logit_max", run_id="stream", layer="model.layers.3.self_attn") == 15.5
    for kind in ("attention", "grad", "logits", "logprob"):
        assert _get(s, "nanwatch_tensor_headroom_ratio", run_id="stream", site_kind=kind) > 0
    assert _get(s, "nanwatch_tensor_headroom_ratio", run_id="stream", site_kind="logits") == 41.0 / 3.4e38
    for rank in ("0", "1", "2"):
        assert _get(s, "nanwatch_last_report_timestamp_seconds", run_id="stream", rank=rank) > 1.6e9
        assert _get(s, "nanwatch_attention_mode", run_id="stream", rank=rank, mode="none") == 1
        assert _get(s, "nanwatch_reports_dropped_total", run_id="stream", rank=rank) == 0
    # bf16 attention went non-finite at step 3: the default policy asked for fp32 from the next step (one rank)
    assert _get(s, "nanwatch_directive_info", run_id="stream", mode="fp32", version="1") == 1
    d = httpx.get(f"{collector.url}/v1/directives/stream", headers=AUTH).json()
    assert (d["mode"], d["apply_at_step"], d["set_by"]) == ("fp32", 4, "rule:half_attention_nonfinite")
    run = httpx.get(f"{collector.url}/v1/runs/stream", headers=AUTH).json()
    assert run["first_offender"] == {"site": "model.layers.2.self_attn", "phase": "forward", "stage": "train",
                                     "rank": 1, "step": 3, "time": run["first_offender"]["time"]}
    assert [st["rank"] for st in run["ranks"]] == [0, 1, 2]
    # names, types and labels come from the one table; never job/instance
    seen = {name for name, _ in s}
    # the collector's own process (prometheus_client's collectors): memory and fds against the pod's limits
    own = {name for name, _ in s if not name.startswith("nanwatch_")}
    assert {"process_resident_memory_bytes", "process_open_fds", "process_max_fds", "python_info"} <= own, own
    assert all(name.startswith(("process_", "python_")) for name in own), own
    for name, labels in s:
        if name in own:
            continue
        base = name.removesuffix("_total")
        spec = METRICS.get(name) or METRICS.get(base + "_total")
        assert spec is not None, name
        assert {k for k, _ in labels} == set(spec.labels), name
    assert {"nanwatch_nonfinite_calls_total", "nanwatch_directive_info"} <= seen


def test_non_finite_values_round_trip_through_run_detail(collector):
    r = step_report(run_id="nan-detail", rank=0, seq=0)
    r.sites[0].amax, r.sites[0].headroom = math.inf, math.nan
    r.logits[0].bound = math.inf
    resp = httpx.post(f"{collector.url}/v1/reports", content=ReportBatch(reports=[r]).model_dump_json(), headers=AUTH)
    assert resp.status_code == 200, resp.text
    text = httpx.get(f"{collector.url}/v1/runs/nan-detail", headers=AUTH).text

    def strict(constant):  # what JSON.parse does with a bare NaN/Infinity
        raise ValueError(f"not strict JSON: bare {constant}")

    rank = json.loads(text, parse_constant=strict)["ranks"][0]
    # strict JSON: non-finite values are named strings, never bare constants
    assert rank["headroom"]["attention"] == "NaN" and rank["logit_max"] == "Infinity"
    s = scrape(collector.url)
    assert math.isnan(_get(s, "nanwatch_tensor_headroom_ratio", run_id="nan-detail", site_kind="attention"))
    assert _get(s, "nanwatch_attention_logit_max", run_id="nan-detail", layer="model.layers.0.self_attn") == math.inf


def test_resent_batch_is_acknowledged_and_not_applied(collector):
    body = ReportBatch(reports=[step_report(run_id="resend", rank=r, seq=0, nan_at="model.layers.0.self_attn",
                                            nan=3) for r in range(2)]).model_dump_json()
    first = httpx.post(f"{collector.url}/v1/reports", content=body, headers=AUTH).json()
    again = httpx.post(f"{collector.url}/v1/reports", content=body, headers=AUTH).json()
    assert first == {"accepted": 2, "duplicates": 0} and again == {"accepted": 0, "duplicates": 2}
    s = scrape(collector.url)
    assert _get(s, "nanwatch_site_nonfinite_calls_total", run_id="resend", site="model.layers.0.self_attn",
                **{"pass": "forward"}) == 6


WEIRD = 'model."quoted"\\back\\slash.{x="y"}'


def test_label_values_are_escaped(collector):
    r = step_report(run_id="weird", seq=0)
    r.sites[0].site, r.sites[0].nan = WEIRD, 1
    assert httpx.post(f"{collector.url}/v1/reports", content=ReportBatch(reports=[r]).model_dump_json(),
                      headers=AUTH).status_code == 200
    s = scrape(collector.url)
    assert _get(s, "nanwatch_site_nonfinite_calls_total", run_id="weird", site=WEIRD, **{"pass": "forward"}) == 1


def test_promtool_check_metrics_passes_on_a_real_scrape(collector):
    promtool = require_tool("promtool")
    test_label_values_are_escaped(collector)  # make sure odd label values are in the scrape
    text = httpx.get(f"{collector.url}/metrics", headers={"Authorization": f"Bearer {TOKEN}"}).text
    assert "nanwatch_attention_logit_max" in text
    out = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True)
    assert out.returncode == 0 and not out.stdout.strip() and not out.stderr.strip(), out.stdout + out.stderr


def test_long_poll_wakes_on_put_and_the_change_is_audited_by_token_name(collector):
    seen = threading.Event()
    got = []
    poller = DirectivePoller(collector.url, "polled", token=TOKEN, wait_s=30,
                             on_directive=lambda d: (got.append(d), seen.set()))
    try:
        resp = httpx.put(f"{collector.url}/v1/directives/polled", json={"mode": "fused", "reason": "test"},
                         headers={"Authorization": f"Bearer {ADMIN}"})
        assert resp.status_code == 200, resp.text
        assert seen.wait(20)
        assert poller.latest.mode == "fused" and poller.latest.version == resp.json()["version"]
        assert got[0].set_by == "alice"
        cleared = httpx.delete(f"{collector.url}/v1/directives/polled", headers={"Authorization": f"Bearer {ADMIN}"})
        assert cleared.json()["mode"] == "none" and cleared.json()["version"] == got[0].version + 1
    finally:
        poller.close()
    events = httpx.get(f"{collector.url}/v1/runs/polled", headers=AUTH).json()["events"]
    assert [(e["kind"], e["actor"]) for e in events] == [("directive_set", "alice"), ("directive_cleared", "alice")]


@pytest.mark.parametrize("index,expect_version", [(0, 1), (5, 1)])
def test_long_poll_returns_at_once_when_behind_and_current_after_wait(collector, index, expect_version):
    httpx.put(f"{collector.url}/v1/directives/lp-{index}", json={"mode": "fp32"},
              headers={"Authorization": f"Bearer {ADMIN}"})
    d = httpx.get(f"{collector.url}/v1/directives/lp-{index}", params={"index": index, "wait": 0.2},
                  headers=AUTH, timeout=10).json()
    assert d["version"] == expect_version and d["mode"] == "fp32"


def test_a_trainer_revert_is_recorded_and_the_rule_can_fire_again(collector):
    def post(seq, *, mode, version, nan=0):
        r = step_report(run_id="revert", seq=seq, mode=mode, nan=nan, dtype="float16",
                        nan_at="model.layers.1.self_attn" if nan else None)
        body = ReportBatch(reports=[r.model_copy(update={"directive_version": version})]).model_dump_json()
        resp = httpx.post(collector.url + "/v1/reports", content=body, headers=AUTH, timeout=10)
        assert resp.status_code == 200, resp.text

    def directive():
        return httpx.get(collector.url + "/v1/directives/revert", headers=AUTH, timeout=10).json()

    resp = httpx.put(collector.url + "/v1/directives/revert", json={"mode": "fp32", "revert_after_clean_steps": 2},
                     headers={"Authorization": f"Bearer {ADMIN}"})
    assert resp.status_code == 200 and resp.json()["version"] == 1
    post(1, mode="fp32", version=1)  # applied at its apply step (1: the run had reported nothing)
    post(2, mode="fp32", version=1)
    post(3, mode="none", version=1)  # the trainer reverted by itself after 2 clean steps, as allowed
    d = directive()
    assert (d["version"], d["mode"], d["set_by"]) == (2, "none", "trainer:auto-revert")
    post(4, mode="none", version=2, nan=5)  # a NaN: the rule issues a fresh directive, not silence
    assert (directive()["version"], directive()["mode"]) == (3, "fp32")


def test_a_directive_applies_at_the_earliest_step_every_rank_can(collector):
    """No margin: the next step for one rank, the next agreement step for ranks that agree every K."""
    admin = {"Authorization": f"Bearer {ADMIN}"}
    for run_id, world, every, expected in (("single", 1, None, 6), ("pair", 2, 4, 8), ("pair-k1", 2, 1, 6)):
        reports = [step_report(run_id=run_id, rank=rank, seq=0, step=5).model_copy(
            update={"world_size": world, "agree_every": every}) for rank in range(world)]
        resp = httpx.post(f"{collector.url}/v1/reports", content=ReportBatch(reports=reports).model_dump_json(),
                          headers=AUTH)
        assert resp.status_code == 200, resp.text
        d = httpx.put(f"{collector.url}/v1/directives/{run_id}", json={"mode": "fp32"}, headers=admin).json()
        assert d["apply_at_step"] == expected, (run_id, d)
