"""#36 as a user meets it: a hand-written GRPO loop (an fp32 policy trained with AdamW) whose rollout copy is
**bf16**, sampling on its own thread with ``generate(output_scores=True)``, with the README's two lines of weight
sync (``mon.publish_weights(v)`` on the trainer, ``post_weights(url, run_id, v, nanwatch.fingerprint(copy))``
on the rollout side), against a real ``nanwatch serve``. What the collector exported after each step is then
replayed through the shipped rules with promtool, a few minutes a step, to see what would page.

Each scenario breaks the rollout side one way and checks what nanwatch says:

* a correct bf16 sync verifies every version, and its precision drift is a drift, attributed;
* a sync that stops is a mismatch at the collector and one ``stale_weights`` event: never a jump, a drift, an
  offset or an attribution (at two learning rates: one jumps, one creeps);
* a temperature on the sampler alone is an offset, never a jump or a shift;
* a worker that stops loading and posting shows as lag within five publishes, and its mismatch is stale weights;
* a plain MLP with no recognised site is guarded through the collector;
* the three ways verification could be made to miss a bad sync are refused.
"""

from __future__ import annotations

import json
import math
import subprocess
import urllib.error
import urllib.request
import warnings
from pathlib import Path

import httpx
import pytest
import torch
import yaml
from prometheus_client.parser import text_string_to_metric_families
from support import (
    AUTH,
    TOKEN,
    RolloutEngine,
    grpo_step,
    require_tool,
    rollout_policy,
    run_view,
    step_report,
    wait_until,
)

import nanwatch
from nanwatch.weight_sync import WeightSyncRefused, post_weights
from nanwatch.wire import RlhfStat, RolloutStat

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "rules" / "nanwatch.yml"
MINUTES_PER_STEP = 3  # a GRPO step of a real run takes minutes; the 30-minute drift ticket needs ten such steps


@pytest.fixture(autouse=True)
def _capsules_in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # an attribution writes its capsule under ./nanwatch-capsules


def _metrics(url: str) -> str:
    req = urllib.request.Request(url + "/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.read().decode()


def _weights(url: str, run_id: str) -> dict:
    resp = httpx.get(f"{url}/v1/runs/{run_id}/weights", headers=AUTH)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _grpo(url: str, run_id: str, *, steps: int, stale_from: int | None = None, silent_from: int | None = None,
          lr: float = 1e-4, temperature_from: tuple[int, float] | None = None) -> dict:
    """``steps`` GRPO steps on a bf16 rollout copy's samples. The copy is synced and posts its fingerprints of
    each published version, until ``stale_from`` (no longer synced, still posting) or ``silent_from`` (neither);
    ``temperature_from`` (step, T): its sampler alone switches to T. Returns each step's report, each step's
    /metrics text (once the collector has the step) and the weight-sync view after each step."""
    policy = rollout_policy()
    engine = RolloutEngine(policy, dtype=torch.bfloat16)
    opt = torch.optim.AdamW(policy.parameters(), lr=lr)
    out: dict = {"reports": [], "scrapes": [], "views": []}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the mismatch's log lines are the point here
        mon = nanwatch.attach(policy, run_id=run_id, collector=url, token=TOKEN, optimizer=opt)
    try:
        for n in range(steps):
            quiet = silent_from is not None and n >= silent_from
            if not quiet and (stale_from is None or n < stale_from):
                engine.sync(policy)
            mon.publish_weights(n)  # the README's trainer line: rollout_dtype bfloat16 by default
            if not quiet:
                post_weights(url, run_id, n, nanwatch.fingerprint(engine.model), worker="rollout-0", token=TOKEN)
            if temperature_from is not None and n == temperature_from[0]:
                engine.temperature = temperature_from[1]
            sequences, rollout = engine.sample(n)
            grpo_step(mon, policy, opt, n, sequences, rollout)
            out["reports"].append(mon.last_report())
            wait_until(lambda n=n: run_view(url, run_id)["latest_step"] >= n, f"step {n} at the collector")
            out["scrapes"].append(_metrics(url))
            out["views"].append(_weights(url, run_id))
    finally:
        mon.close()
        engine.close()
    return out



def _events(run: dict) -> list[tuple[int, str]]:
    return [(r.step, e.cause) for r in run["reports"] for e in r.rollout_events]


def _attributions(run: dict) -> list:
    return [r.rollout_attribution for r in run["reports"] if r.rollout_attribution is not None]


# ---- the shipped rules, on what the collector exported --------------------------------------------------------
def _series(scrapes: list[str], run_id: str) -> list[dict]:
    """promtool input series of the run's samples, one value per step (``_`` where a step lacked it)."""
    rows: dict[str, list[str]] = {}
    for i, text in enumerate(scrapes):
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.labels.get("run_id") != run_id or s.name.endswith("_created"):
                    continue
                labels = {"job": "nanwatch-collector", "instance": "collector:8000", **s.labels}
                key = s.name + "{" + ", ".join(f"{k}={json.dumps(v)}" for k, v in sorted(labels.items())) + "}"
                rows.setdefault(key, ["_"] * len(scrapes))[i] = "NaN" if math.isnan(s.value) else repr(s.value)
    return [{"series": k, "values": " ".join(v)} for k, v in rows.items()]


def _firing(tmp_path: Path, scrapes: list[str], run_id: str, checks: list[tuple[int, str, dict | None]]) -> None:
    """Replay the run's exported samples, ``MINUTES_PER_STEP`` apart, through the shipped rules with promtool
    and check, at each (step, alertname, labels), that the alert fires with exactly those labels (besides
    ``alertname`` and ``run_id``), or (None) that it does not. The annotations are left out: deploy's promtool
    tests check their text; this checks what fires on real figures."""
    promtool = require_tool("promtool")
    rules = yaml.safe_load(RULES.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
    tests = [{"eval_time": f"{step * MINUTES_PER_STEP}m", "alertname": name,
              "exp_alerts": [] if labels is None else [{"exp_labels": {"run_id": run_id, **labels}}]}
             for step, name, labels in checks]
    spec = {"rule_files": [str(tmp_path / "rules.yml")], "evaluation_interval": "1m",
            "tests": [{"interval": f"{MINUTES_PER_STEP}m", "input_series": _series(scrapes, run_id),
                       "alert_rule_test": tests}]}
    (tmp_path / "replay-test.yml").write_text(yaml.safe_dump(spec))
    out = subprocess.run([promtool, "test", "rules", str(tmp_path / "replay-test.yml")], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-2000:]


STALE = {"severity": "critical", "stage": "generate", "cause": "stale_weights"}
JUMP = {"severity": "critical", "stage": "generate", "cause": "jump"}
SHIFT = {"severity": "warning", "stage": "generate", "cause": "shift"}
SYNC_MISMATCH = {"severity": "critical"}


# ---- the scenarios ---------------------------------------------------------------------------------------------
def test_a_correct_bf16_sync_verifies_every_version_and_its_drift_is_attributed(collector, tmp_path):
    run = _grpo(collector.url, "grpo-bf16", steps=8)
    view = run["views"][-1]
    assert view["latest_published"] == 7
    assert view["workers"]["rollout-0"] == {"latest_posted": 7, "latest_verified": 7, "outcome": "verified", "lag": 0}
    assert all(r.attention_mode == "none" for r in run["reports"])
    causes = {c for _, c in _events(run)}
    assert causes == {"drift"}, _events(run)  # bf16 rounding: a drift, verified weights
    drift = next(e for r in run["reports"] for e in r.rollout_events)
    assert "weights verified" in drift.evidence
    (found,) = _attributions(run)
    assert found.rollout_dtype == "bfloat16" and found.module is not None
    _firing(tmp_path, run["scrapes"], "grpo-bf16", [
        (n, name, None) for n in (2, 5, 7) for name in
        ("NanwatchWeightSyncMismatch", "NanwatchRolloutMismatchJump", "NanwatchRolloutStaleWeights",
         "NanwatchRolloutMismatchShift")])


@pytest.mark.parametrize("lr", [1e-3, 3e-3])
def test_a_stopped_sync_is_stale_weights_never_a_jump_drift_offset_or_attribution(collector, tmp_path, lr):
    run_id, k, steps = f"grpo-stale-{lr:g}", 6, 16
    run = _grpo(collector.url, run_id, steps=steps, stale_from=k, lr=lr)
    events = _events(run)
    before = [c for n, c in events if n < k and c != "outliers"]
    assert before[:1] == ["drift"] and set(before) == {"drift"}, events  # bf16's precision, verified weights
    assert [c for n, c in events if n >= k and c != "outliers"] == ["stale_weights"], events
    (stale_step,) = [n for n, c in events if c == "stale_weights"]
    assert k <= stale_step <= k + 1
    stale = next(e for r in run["reports"] for e in r.rollout_events if e.cause == "stale_weights")
    assert "rollout worker rollout-0" in stale.evidence and "differ" in stale.evidence
    assert [a.step for a in _attributions(run) if a.step >= k] == []  # the verified drift's only, before k
    view = run["views"][-1]["workers"]["rollout-0"]
    assert view["outcome"] == "mismatch" and view["latest_verified"] == k - 1
    _firing(tmp_path, run["scrapes"], run_id, [
        (stale_step + 1, "NanwatchRolloutStaleWeights", STALE),
        (stale_step + 1, "NanwatchWeightSyncMismatch", SYNC_MISMATCH),
        (stale_step + 1, "NanwatchRolloutMismatchJump", None),
        (stale_step + 1, "NanwatchRolloutMismatchShift", None),
        (steps - 1, "NanwatchRolloutDrift", None)])


def test_a_temperature_on_the_sampler_alone_is_an_offset_never_a_jump(collector, tmp_path):
    run = _grpo(collector.url, "grpo-temperature", steps=11, temperature_from=(6, 0.7))
    events = [(n, c) for n, c in _events(run) if n >= 6]
    assert [c for _, c in events] == ["offset"], _events(run)
    offset = next(e for r in run["reports"] for e in r.rollout_events if e.cause == "offset")
    assert "temperature" in offset.evidence
    assert all(v["workers"]["rollout-0"]["outcome"] == "verified" for v in run["views"][1:])
    _firing(tmp_path, run["scrapes"], "grpo-temperature", [
        (n, name, None) for n in (7, 9) for name in
        ("NanwatchRolloutMismatchJump", "NanwatchRolloutStaleWeights", "NanwatchRolloutMismatchShift",
         "NanwatchWeightSyncMismatch")])


def test_a_silent_worker_shows_as_lag_within_five_publishes_and_its_mismatch_is_stale(collector, tmp_path):
    run_id, k, steps = "grpo-silent", 7, 14
    run = _grpo(collector.url, run_id, steps=steps, silent_from=k, lr=1e-3)
    lags = [v["workers"]["rollout-0"]["lag"] for v in run["views"]]
    assert lags[:k] == [0] * k
    first = next(n for n, lag in enumerate(lags) if lag > 0)
    assert first < k + 5 and lags[first:] == sorted(lags[first:]) and lags[-1] == steps - k
    gauge = f'nanwatch_weight_sync_lag_versions{{run_id="{run_id}",worker="rollout-0"}}'
    assert f"{gauge} {float(steps - k)}" in run["scrapes"][-1]
    causes = [c for n, c in _events(run) if n >= k and c != "outliers"]
    assert causes == ["stale_weights"], _events(run)  # before k: bf16's verified drift
    _firing(tmp_path, run["scrapes"], run_id, [
        (first + 1, "NanwatchWeightSyncLag", {"severity": "warning", "worker": "rollout-0"}),
        (steps - 1, "NanwatchRolloutDrift", None)])


def test_a_plain_mlp_is_guarded_through_the_collector(collector, tmp_path):
    """No attention, no logits: the step whose gradients are non-finite is still skipped, the weights stay
    finite, and the collector counts the skipped step (NanwatchStepsSkipped)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scrapes = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        mon = nanwatch.attach(model, run_id="grpo-mlp", collector=collector.url, token=TOKEN, optimizer=opt)
    with mon:
        for n in range(4):
            x = torch.randn(4, 8)
            if n == 1:
                x[0, 0] = math.inf
            with mon.step(n):
                model(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
            wait_until(lambda n=n: run_view(collector.url, "grpo-mlp")["latest_step"] >= n, f"step {n}")
            scrapes.append(_metrics(collector.url))
    assert all(torch.isfinite(p).all() for p in model.parameters())
    view = run_view(collector.url, "grpo-mlp")
    assert view["skipped_steps"] == 1
    fo = view["first_offender"]
    assert fo["step"] == 1 and fo["site"]  # the site the fallback detection found, named
    _firing(tmp_path, scrapes, "grpo-mlp", [(2, "NanwatchNonFiniteValues", {
        "severity": "critical", "stage": "train", "site": fo["site"], "pass": fo["phase"], "rank": "0"})])


# ---- the ways verification could be made to miss a bad sync ----------------------------------------------------
def test_a_rollout_worker_cannot_post_the_trainers_side(collector):
    """A rollout-side token holder posting side=trainer first: without the trainer's incarnation it is refused
    (403); with a made-up one it never binds, and the real trainer's set is still taken, so the stale worker
    is a mismatch."""
    run_id = "grpo-side"
    policy = rollout_policy()
    stale = {k: v.clone() for k, v in policy.state_dict().items()}
    fps_stale = nanwatch.fingerprint(stale)
    with pytest.raises(WeightSyncRefused) as refused:
        post_weights(collector.url, run_id, 0, fps_stale, side="trainer", worker="trainer", token=TOKEN)
    assert refused.value.status == 403
    post_weights(collector.url, run_id, 0, fps_stale, side="trainer", worker="trainer", token=TOKEN,
                 incarnation="made-up")
    opt = torch.optim.SGD(policy.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        mon = nanwatch.attach(policy, run_id=run_id, collector=collector.url, token=TOKEN, optimizer=opt)
    with mon:
        with mon.step(0):
            policy(torch.randint(1, 50, (2, 8))).logits.float().mean().backward()
            opt.step()
        wait_until(lambda: run_view(collector.url, run_id)["latest_step"] >= 0, "step 0")
        mon.publish_weights(0)  # the trainer's real set of version 0: its weights moved on
    answer = post_weights(collector.url, run_id, 0, fps_stale, worker="rollout-0", token=TOKEN)
    assert [v["verified"] for v in answer["compared"]] == [False]
    assert _weights(collector.url, run_id)["workers"]["rollout-0"]["outcome"] == "mismatch"


def test_a_worker_lagging_more_than_eight_publishes_is_still_compared(collector):
    run_id = "grpo-lag12"
    policy = rollout_policy()
    opt = torch.optim.SGD(policy.parameters(), lr=0.1)
    sets = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        mon = nanwatch.attach(policy, run_id=run_id, collector=collector.url, token=TOKEN, optimizer=opt)
    with mon:
        for n in range(12):
            with mon.step(n):
                policy(torch.randint(1, 50, (2, 8))).logits.float().mean().backward()
                opt.step()
                opt.zero_grad()
            wait_until(lambda n=n: run_view(collector.url, run_id)["latest_step"] >= n, f"step {n}")
            sets.append(nanwatch.fingerprint(policy))
            mon.publish_weights(n)
            if n == 0:
                post_weights(collector.url, run_id, 0, sets[0], worker="rollout-0", token=TOKEN)
    assert _weights(collector.url, run_id)["workers"]["rollout-0"]["lag"] == 11
    answer = post_weights(collector.url, run_id, 1, sets[0], worker="rollout-0", token=TOKEN)  # 10 behind: stale
    assert [v["verified"] for v in answer["compared"]] == [False]
    answer = post_weights(collector.url, run_id, 2, sets[2], worker="rollout-0", token=TOKEN)
    assert [v["verified"] for v in answer["compared"]] == [True]


@pytest.mark.parametrize("figures", [{"abs_mean": math.nan}, {"tokens": 2**40, "abs_mean": 0.0}],
                         ids=["nan", "2^40-tokens-at-0"])
def test_a_made_up_rank_cannot_hide_the_runs_drift(collector, figures):
    """One rank reporting abs_mean NaN, or 2^40 tokens at 0, made the run's drift gauge NaN or ~0: refused at
    ingest (422), and the run's gauge still reads the real ranks' drift."""
    run_id = f"grpo-hide-{'nan' if 'tokens' not in figures else 'tokens'}"
    real = RolloutStat(tokens=1000, sequences=8, abs_mean=0.08, mean=0.0, rms=0.1)
    rlhf = RlhfStat(tokens=real.tokens, rollout=real)
    for rank in (0, 1):
        body = step_report(run_id=run_id, seq=0, rank=rank, world_size=3).model_copy(update={"rlhf": rlhf})
        resp = httpx.post(f"{collector.url}/v1/reports", headers=AUTH,
                          content=json.dumps({"reports": [json.loads(body.model_dump_json())]}))
        assert resp.status_code == 200, resp.text
    bad = json.loads(step_report(run_id=run_id, seq=0, rank=2, world_size=3).model_copy(
        update={"rlhf": rlhf}).model_dump_json())
    bad["rlhf"]["rollout"].update(figures)
    resp = httpx.post(f"{collector.url}/v1/reports", headers=AUTH, content=json.dumps({"reports": [bad]}))
    assert resp.status_code == 422, resp.text
    gauge = f'nanwatch_rollout_mismatch{{run_id="{run_id}",stat="abs_mean"}}'
    line = next(ln for ln in _metrics(collector.url).splitlines() if ln.startswith(gauge))
    assert float(line.split()[-1]) == pytest.approx(0.08)


def test_the_weights_view_is_scoped_and_404_without_sets(collector):
    resp = httpx.get(f"{collector.url}/v1/runs/never-posted/weights", headers=AUTH)
    assert resp.status_code == 404
    with pytest.raises(urllib.error.HTTPError) as denied:
        urllib.request.urlopen(f"{collector.url}/v1/runs/grpo-bf16/weights", timeout=10)
    assert denied.value.code == 401
