"""End to end on loopback, real processes only: a collector (``nanwatch serve``), Prometheus scraping it
every second and evaluating deploy/prometheus/rules/nanwatch.yml every second, Alertmanager with
deploy/alertmanager/alertmanager.yml (its receivers pointed at a webhook this test runs, its group waits
shortened), and three tiny training runs:

* ``e2e-nan``: fp16, a guarded fused AdamW, attention on the math kernel for its first steps, then a NaN
  born in layer 0's MLP at step 3 (the guard skips that step; an MLP birth gets no precision directive),
  RLHF stats every step, one step without a forward (unmeasured): it pages, naming the MLP, and it is the
  run every dashboard panel is queried for (the NaN panels must show the NaN);
* ``e2e-math``: bf16 attention forced onto the math kernel with ``sdpa_kernel(SDPBackend.MATH)``: the
  math-fallback ticket's inputs (the calls, and the site and rank that ran them) reach Prometheus (it fires
  after 10 sustained minutes, which promtool's tests cover);
* ``e2e-healthy``: fp32, fused attention: it pages nobody;
* ``e2e-amp``: fp16 autocast under a real GradScaler whose first steps overflow by design: no ticket opens;
* ``e2e-moe``: a tiny Qwen3-MoE whose bf16 rollout copy's routes are compared (#39): the MoE row's run;
* ``e2e-rollout``: a tiny Qwen3 trained in fp32 on the samples of a copy generating on its own thread (#28);
  the trainer publishes each weight version and the copy posts its weight fingerprints; from step 4 the copy
  is no longer synced (stale weights, since its fingerprints mismatch: a sync mismatch) and at step 6 its
  sampler returns a NaN: three pages.

Only the receivers' URLs and the group timings differ from the shipped Alertmanager config; Prometheus
loads the shipped rule file as it is.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
import warnings
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
import yaml
from support import (
    MOE_VOCAB,
    CollectorProcess,
    RolloutEngine,
    free_port,
    grpo_step,
    load_script,
    require_tool,
    rollout_policy,
    tiny_moe,
    tiny_qwen3,
    token_ids,
)
from torch.nn.attention import SDPBackend, sdpa_kernel

import nanwatch
from nanwatch.hooks import record_routes
from nanwatch.weight_sync import post_weights

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
#: the most a page may take to reach the webhook once Prometheus fired it (Alertmanager's group wait is 1 s
#: here); how long a NaN took from its report to the page is printed, not asserted: a loaded machine's scrape
#: and evaluation delays are not the product's
PAGE_WITHIN_S = 60
LIVE_UNTIL_FIRING_S = 120  # the most a run stays open for Prometheus to fire what it must (a few s when idle)
MATH_INPUTS_WITHIN_S = 60  # the math ticket's inputs are in Prometheus within this (it fires 10 minutes on)


class _Webhook(ThreadingHTTPServer):
    """Alertmanager's webhook receiver: every notification, as received."""

    def __init__(self) -> None:
        self.received: list[dict] = []
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                hook.received.append({"path": self.path, "at": time.monotonic(), **json.loads(body)})
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"

    def alerts(self, *, path: str | None = None) -> list[dict]:
        return [dict(a, receiver=n["receiver"], at=n["at"]) for n in list(self.received) if path in (None, n["path"])
                for a in n["alerts"] if a["status"] == "firing"]


def _wait_ready(url: str, proc: subprocess.Popen, what: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready at {url}")
        time.sleep(0.2)


def _alertmanager_config(webhook: str) -> dict:
    """The shipped config with its receivers pointed at the test's webhook and short group timings."""
    cfg = yaml.safe_load((ROOT / "deploy/alertmanager/alertmanager.yml").read_text())
    for receiver in cfg["receivers"]:
        for hook in receiver.get("webhook_configs", []):
            hook["url"] = f"{webhook}/{receiver['name']}"
    for route in [cfg["route"], *cfg["route"].get("routes", [])]:
        route.update(group_wait="1s", group_interval="1s", repeat_interval="1h")
    return cfg


def _prometheus_config(collector_port: int, am_port: int, token_file: Path) -> dict:
    """The shipped scrape job (its bearer token included) pointed at the test's collector and token file."""
    shipped = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    job = shipped["scrape_configs"][0]
    job["static_configs"] = [{"targets": [f"127.0.0.1:{collector_port}"]}]
    job["authorization"]["credentials_file"] = str(token_file)
    return {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(ROOT / "deploy/prometheus/rules/nanwatch.yml")],
            "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]},
            "scrape_configs": [job]}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    prometheus, alertmanager = require_tool("prometheus"), require_tool("prometheus-alertmanager")
    tmp = tmp_path_factory.mktemp("stack")
    webhook = _Webhook()
    threading.Thread(target=webhook.serve_forever, daemon=True).start()
    am_port, prom_port = free_port(), free_port()
    (tmp / "am.yml").write_text(yaml.safe_dump(_alertmanager_config(webhook.url)))
    procs = []
    # the fp32 directive two steps after the NaN: a short margin keeps the run short. A reader-only metrics
    # token makes /metrics need one (ingest stays open on loopback): Prometheus scrapes with it, as shipped.
    (tmp / "metrics_token").write_text("e2e-metrics-token\n")
    env = {"NANWATCH_DIRECTIVE_MARGIN_STEPS": "2", "NANWATCH_METRICS_TOKEN_FILE": str(tmp / "metrics_token")}
    with CollectorProcess(db_path=tmp / "c.db", env=env) as c:
        (tmp / "prom.yml").write_text(yaml.safe_dump(_prometheus_config(c.port, am_port, tmp / "metrics_token")))
        try:
            with open(tmp / "alertmanager.log", "wb") as log:
                procs.append(subprocess.Popen(
                    [alertmanager, f"--config.file={tmp / 'am.yml'}", f"--storage.path={tmp / 'am'}",
                     f"--web.listen-address=127.0.0.1:{am_port}", "--cluster.listen-address="],
                    stdout=log, stderr=log))
            _wait_ready(f"http://127.0.0.1:{am_port}/-/ready", procs[-1], "alertmanager")
            with open(tmp / "prometheus.log", "wb") as log:
                procs.append(subprocess.Popen(
                    [prometheus, f"--config.file={tmp / 'prom.yml'}", f"--storage.tsdb.path={tmp / 'prom'}",
                     f"--web.listen-address=127.0.0.1:{prom_port}"], stdout=log, stderr=log))
            _wait_ready(f"http://127.0.0.1:{prom_port}/-/ready", procs[-1], "prometheus")
            # Prometheus scrapes its first a few seconds after it is ready: train only once it does, or a
            # short run would end (and its per-rank series leave) before Prometheus ever saw them
            _wait_for(lambda: _query(f"http://127.0.0.1:{prom_port}", "up == 1"), 60, "Prometheus's first scrape")
            runs = _train(c.url, f"http://127.0.0.1:{prom_port}")
            yield {"collector": c, "webhook": webhook, "prometheus": f"http://127.0.0.1:{prom_port}",
                   "runs": runs, "tmp": tmp}
        finally:
            for p in procs:
                p.terminate()
                p.wait(10)
            webhook.shutdown()


def _firing(prometheus: str, alertname: str, run_id: str):
    """A poll for ``alertname`` firing about ``run_id`` in Prometheus (before Alertmanager routes it)."""
    return lambda: _query(prometheus, f'ALERTS{{alertname="{alertname}", run_id="{run_id}", alertstate="firing"}}')


def _train(collector: str, prometheus: str) -> dict:
    """The runs, one after the other; returns when each NaN/math step was reported (monotonic). A run whose
    pages the tests wait for stays open (live, as a real run goes on for minutes) until Prometheus fires them:
    on a loaded machine a run closed seconds after its NaN could end (and its live series leave) before any
    scrape and evaluation saw it, and then nothing pages, rightly."""
    marks: dict = {"started": time.time()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # e2e-nan: fp16 SDPA; math kernel for steps 0-1; NaN from layer 0's MLP at step 3; RLHF stats
        model = tiny_qwen3("sdpa", dtype=torch.float16, num_hidden_layers=2, use_cache=False)
        state = {"step": -1}
        model.model.layers[0].mlp.register_forward_hook(
            lambda m, a, out: out * math.nan if state["step"] == 3 else out)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
        with nanwatch.attach(model, run_id="e2e-nan", collector=collector, optimizer=opt) as mon:
            for n in range(12):
                state["step"] = n
                with mon.step(n):
                    if n == 5:
                        continue  # a step with no forward: reported as unmeasured
                    ids = token_ids(seed=n)
                    ctx = sdpa_kernel(SDPBackend.MATH) if n < 2 else torch.enable_grad()
                    with ctx:
                        out = model(input_ids=ids, labels=ids)
                    lp = torch.log_softmax(out.logits.float(), -1)[..., :-1, :].gather(-1, ids[:, 1:, None])[..., 0]
                    mon.rlhf(logprobs=lp, old_logprobs=lp.detach() * 1.01, ref_logprobs=lp.detach() * 0.99,
                             advantages=torch.randn(ids.shape[0]), mask=torch.ones_like(lp, dtype=torch.bool),
                             rollout_logprobs=lp.detach() * 1.001)  # the rollout panels have data too
                    out.loss.backward()
                    opt.step()
                opt.zero_grad(set_to_none=True)
                mon.last_report()
                if n == 3:
                    marks["nan_reported"] = time.monotonic()
                time.sleep(0.3)  # let the poller see the directive between steps
            marks["nan_mode"] = mon.last_report().attention_mode
            _wait_for(_firing(prometheus, "NanwatchNonFiniteValues", "e2e-nan"), LIVE_UNTIL_FIRING_S, "the NaN alert")
        # e2e-math: bf16 attention forced onto the math kernel
        model = tiny_qwen3("sdpa", dtype=torch.bfloat16, use_cache=False)
        with nanwatch.attach(model, run_id="e2e-math", collector=collector) as mon:
            for n in range(3):
                with mon.step(n), sdpa_kernel(SDPBackend.MATH):
                    ids = token_ids(seed=n)
                    model(input_ids=ids, labels=ids).loss.backward()
                mon.last_report()
            marks["math_reported"] = time.monotonic()
        # e2e-healthy: fp32, fused kernels
        model = tiny_qwen3("sdpa", use_cache=False)
        with nanwatch.attach(model, run_id="e2e-healthy", collector=collector) as mon:
            for n in range(3):
                with mon.step(n):
                    ids = token_ids(seed=n)
                    model(input_ids=ids, labels=ids).loss.backward()
                assert mon.last_report().first_offender is None
        _train_amp(collector, marks)
        _train_rollout(collector, marks, prometheus)
        _train_moe(collector)
    return marks


def _train_amp(collector: str, marks: dict) -> None:
    """e2e-amp (#26): fp16 autocast with a real GradScaler("cpu", init_scale=2**24) and a fused AdamW, as AMP
    runs are written: the first steps overflow and are skipped by design (the scaler halves its scale until it
    fits; the fused optimizer steps with its found_inf, and the weight guard holds those updates back too),
    and from then on the scaled gradients sit near the fp16 limit on purpose. Each step's report is kept
    (what the trainer said) and the steps are spaced so that Prometheus scrapes most of them. One batch for
    every step: a batch's attention logits differ from the next's, and a trend of seconds that
    NanwatchAttentionLogitGrowing extrapolates by an hour would be this short run's artefact, not AMP's."""
    model = tiny_qwen3("sdpa", use_cache=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24)
    marks["amp_started"], marks["amp_reports"] = time.time(), []
    # every step reads the gradients the scaler scales (the test pins their headroom to the fp16 limit)
    with nanwatch.attach(model, run_id="e2e-amp", collector=collector, optimizer=opt, scaler=scaler) as mon:
        for n in range(12):
            with mon.step(n):
                ids = token_ids(seed=0)
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = model(input_ids=ids, labels=ids).loss
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad(set_to_none=True)
            marks["amp_reports"].append(mon.last_report())
            time.sleep(0.5)
    marks["amp_reported"] = time.monotonic()


def _train_rollout(collector: str, marks: dict, prometheus: str, *, stale_from: int = 4, nan_at: int = 6,
                   steps: int = 24) -> None:
    """e2e-rollout (#28): a GRPO-shaped loop; the rollout copy is synced (and posts its weight fingerprints
    of each version) until ``stale_from``, then keeps its old weights; its sampler returns a NaN at ``nan_at``.
    The steps go on for a few seconds after, so that Prometheus sees the run live when it pages."""
    policy = rollout_policy()
    engine = RolloutEngine(policy)
    engine.nan_at = nan_at
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    marks["rollout_events"] = []
    with nanwatch.attach(policy, run_id="e2e-rollout", collector=collector, optimizer=opt) as mon:
        for n in range(steps):
            if n < stale_from:
                engine.sync(policy)
            mon.publish_weights(n)
            post_weights(collector, "e2e-rollout", n, nanwatch.fingerprint(engine.model), worker="rollout-0")
            sequences, rollout = engine.sample(n)
            grpo_step(mon, policy, opt, n, sequences, rollout)
            marks["rollout_events"] += [(n, e.cause) for e in mon.last_report().rollout_events]
            time.sleep(0.4)
        for alertname in ("NanwatchRolloutStaleWeights", "NanwatchWeightSyncMismatch", "NanwatchSamplerNonfinite"):
            _wait_for(_firing(prometheus, alertname, "e2e-rollout"), LIVE_UNTIL_FIRING_S, alertname)
    engine.close()


def _train_moe(collector: str) -> None:
    """e2e-moe (#39): a tiny Qwen3-MoE trained on the samples of a bf16 copy whose routes were recorded while it
    generated (``record_routes``), the trainer claiming to replay them (``routing_replay="verify"``, which it
    does not): the MoE routing row's panels have their run."""
    policy = tiny_moe(0, router_scale=30.0)  # large router logits: bf16 rounding flips near-ties
    rollout = copy.deepcopy(policy).to(torch.bfloat16).eval()
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-4)
    with nanwatch.attach(policy, run_id="e2e-moe", collector=collector, optimizer=opt, routing_replay="verify") as mon:
        for n in range(4):
            prompt = torch.randint(1, MOE_VOCAB, (2, 6), generator=torch.Generator().manual_seed(n))
            with torch.no_grad(), record_routes(rollout) as rec:
                seq = rollout.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=5,
                                       do_sample=False, pad_token_id=0)
            with mon.step(n):
                logits = policy(input_ids=seq).logits[:, :-1].float()
                lp = logits.log_softmax(-1).gather(-1, seq[:, 1:, None])[..., 0]
                mon.rlhf(logprobs=lp, rollout_routes=rec.routes())
                lp.sum().backward()
                opt.step()
                opt.zero_grad()
            time.sleep(0.5)


def _wait_for(condition, within_s: float, what: str):
    """``condition()`` once it is truthy, polled every 0.5 s; checked at least once, however late."""
    deadline = time.monotonic() + within_s
    while not (found := condition()):
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what} did not arrive within {within_s} s")
        time.sleep(0.5)
    return found


def _pages(hook, alertname: str, run_id: str):
    """A poll for the pages of ``alertname`` about ``run_id`` the webhook's pager receiver got."""
    return lambda: [a for a in hook.alerts(path="/pager")
                    if a["labels"]["alertname"] == alertname and a["labels"]["run_id"] == run_id]


def test_a_non_finite_run_pages_with_run_and_site(stack):
    start = stack["runs"]["nan_reported"]
    page = _pages(stack["webhook"], "NanwatchNonFiniteValues", "e2e-nan")
    pages = _wait_for(page, PAGE_WITHIN_S, "the NaN page")
    assert all("site" in a["labels"] for a in pages), pages  # never a page without its site beside the real one
    (alert, *_) = pages
    assert alert["receiver"] == "pager" and alert["labels"]["severity"] == "critical"
    # this incident's offender: the NaN was born in layer 0's MLP, and the page names it there
    assert (alert["labels"]["site"], alert["labels"]["pass"], alert["labels"]["rank"]) == (
        "model.layers.0.mlp", "forward", "0")
    assert "model.layers.0.mlp" in alert["annotations"]["description"]
    assert alert["annotations"]["runbook_url"].endswith("/deploy/runbook.md#nanwatchnonfinitevalues")
    assert "var-run_id=e2e-nan" in alert["annotations"]["dashboard_url"]
    # measured, not asserted beyond the bound above: the README quotes it (scrape and evaluation every 1 s here)
    print(f"\nNaN step reported -> page at the webhook: {min(a['at'] for a in page()) - start:.1f} s")
    # an MLP birth: the remedy follows the birth, so no precision directive (an fp16 attention overflow gets
    # one through a real collector: tests/hooks/test_weight_guard.py::test_with_a_collector_*)
    assert stack["runs"]["nan_mode"] == "none"


def test_math_fallback_in_half_precision_feeds_its_ticket_with_the_site(stack):
    """The math ticket fires after 10 sustained minutes (promtool's tests cover its timing and labels): live,
    its two inputs must be there, the half-precision math calls and the site and rank that ran them."""
    start = stack["runs"]["math_reported"]
    prometheus = stack["prometheus"]

    def inputs():
        calls = _query_range(prometheus, 'run_id_dtype:nanwatch_sdpa_math_half_calls:increase5m{run_id="e2e-math"} > 0')
        info = _query_range(prometheus, 'nanwatch_math_fallback_info{run_id="e2e-math"}')
        return (calls, info) if calls and info else None

    calls, info = _wait_for(inputs, MATH_INPUTS_WITHIN_S - (time.monotonic() - start), "the math ticket's inputs")
    assert {c["metric"]["dtype"] for c in calls} == {"bfloat16"}
    assert {(i["metric"]["site"].startswith("model.layers."), i["metric"]["rank"]) for i in info} == {(True, "0")}


@pytest.mark.parametrize(("alertname", "figure"), [
    ("NanwatchRolloutStaleWeights", "mean |dlogp| is now"), ("NanwatchWeightSyncMismatch", "differ"),
    ("NanwatchSamplerNonfinite", "non-finite")])
def test_a_rollout_that_stops_syncing_pages_with_the_run_and_the_figure(stack, alertname, figure):
    # what the trainer classified, first: the sync's verdict said the copy's fingerprints differ (#36)
    assert stack["runs"]["rollout_events"][0] == (4, "stale_weights")
    pages = _wait_for(_pages(stack["webhook"], alertname, "e2e-rollout"), PAGE_WITHIN_S, alertname)
    (alert, *_) = pages
    assert alert["receiver"] == "pager" and alert["labels"]["severity"] == "critical"
    assert "e2e-rollout" in alert["annotations"]["description"] and figure in alert["annotations"]["description"]


def test_a_healthy_run_pages_nobody(stack):
    # by now the other runs' pages have arrived (the tests above waited for them)
    _wait_for(lambda: stack["webhook"].alerts(), 5, "any notification")
    assert [a for a in stack["webhook"].alerts() if a["labels"].get("run_id") == "e2e-healthy"] == []


def test_loss_scaling_search_opens_no_ticket(stack):
    """#26: the GradScaler's search (steps it skips while its scale falls, the fused optimizer's found_inf
    holding them back) and its scaled gradients' headroom open no ticket, pending or firing; the collector
    counts those steps as loss-scale overflows, never as steps the weight guard skipped."""
    reports, prometheus = stack["runs"]["amp_reports"], stack["prometheus"]
    # what the trainer said, so that this test cannot pass for want of the case: steps the scaler handled
    # that the guard also held back, and scaled gradients within 10x of the fp16 limit (+Inf while overflowing)
    assert any(r.scaler_overflow and r.step_skipped for r in reports), [(r.scaler_overflow, r.step_skipped) for r in reports]
    assert all(r.incident is None for r in reports)
    grad_headroom = max(s.headroom for r in reports for s in r.sites if s.phase == "backward" and s.headroom == s.headroom)
    assert grad_headroom > 0.1, grad_headroom
    since = stack["runs"]["amp_started"]

    def arrived():  # the run's overflows and its gradients' headroom reached Prometheus, and were evaluated
        overflows = _query_range(prometheus, 'nanwatch_loss_scale_overflows_total{run_id="e2e-amp"} > 0', since)
        headroom = _query_range(prometheus, 'nanwatch_tensor_headroom_ratio{run_id="e2e-amp", site_kind="grad"} > 0.1',
                                since)
        return overflows and headroom and time.monotonic() > stack["runs"]["amp_reported"] + 5

    _wait_for(arrived, 60, "the loss-scaled run's overflows and headroom in Prometheus")
    skipped = _query_range(prometheus, 'nanwatch_skipped_steps_total{run_id="e2e-amp"}', since)
    assert skipped and {v for series in skipped for _, v in series["values"]} == {"0"}, skipped
    # ALERTS holds pending alerts too: an expression that held at any evaluation is a ticket on its way
    alerts = _query_range(prometheus, 'ALERTS{run_id="e2e-amp"}', since)
    assert alerts == [], sorted({(a["metric"]["alertname"], a["metric"]["alertstate"]) for a in alerts})
    assert [a for a in stack["webhook"].alerts() if a["labels"].get("run_id") == "e2e-amp"] == []


def _dashboards():
    return load_script(ROOT / "grafana" / "generate.py", "grafana_generate")


VARIABLES = {"$run_id": "e2e-nan", "${run_id}": "e2e-nan", "$rank": "0", "${rank}": "0",
             "$__rate_interval": "1m", "$__interval": "1m", "$__range": "5m"}


#: the run-health panels that must show the e2e-nan run's NaN (a value above 0 in the range), not a flat zero
NAN_PANELS = ("Non-finite values", "Non-finite values by stage", "Non-finite values by site and pass",
              "Non-finite values by rank and kind", "First offender", "Latest offender by stage",
              "Optimizer steps skipped")
#: the panels the README's screenshots show, by title (the panels' own queries)
SCREENSHOTS = {"nonfinite": "Non-finite values by site and pass", "skipped": "Optimizer steps skipped",
               "backends": "SDPA backend share (train)", "logit": "Attention-logit bound per layer vs tau"}


def _query(prometheus: str, expr: str) -> list:
    """The expression now (an instant query)."""
    return _api(prometheus, "query", {"query": expr})


def _query_range(prometheus: str, expr: str, since: float | None = None) -> list:
    """The expression from ``since`` (wall time; default: the last 10 minutes) to now, as a dashboard panel
    draws it (the runs have ended by now: an instant query would miss the series that left with them)."""
    now = time.time()
    return _api(prometheus, "query_range", {"query": expr, "start": since or now - 600, "end": now, "step": "1s"})


def _api(prometheus: str, endpoint: str, params: dict) -> list:
    with urllib.request.urlopen(f"{prometheus}/api/v1/{endpoint}?" + urllib.parse.urlencode(params), timeout=30) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


def _panels(gen) -> list[tuple[str, str, str]]:
    out = []
    for name, dashboard in gen.dashboards().items():
        for title, expr in gen.panel_queries(dashboard):
            moe = "nanwatch_moe_" in expr  # the MoE routing row: the MoE run's
            for var, value in VARIABLES.items():
                expr = expr.replace(var, "e2e-moe" if moe and "run_id" in var else value)
            out.append((name, title, expr))
    return out


def test_every_dashboard_panel_returns_data_and_the_nan_panels_show_the_nan(stack):
    # give the recording rules and every series a few evaluations after the last run
    time.sleep(3)
    panels = _panels(_dashboards())
    empty, flat = [], []
    for name, title, expr in panels:
        result = _query_range(stack["prometheus"], expr, since=stack["runs"]["started"])
        if not result:
            empty.append((name, title, expr))
        elif name == "run-health.json" and title in NAN_PANELS:
            peak = max(float(v) for series in result for _, v in series["values"])
            if not peak > 0:
                flat.append((title, expr))
    assert len(panels) >= 10 and empty == [], empty
    assert {t for t, _ in flat} == set(), flat  # each NaN panel shows the NaN (counters are born at zero)
    assert set(NAN_PANELS) <= {t for _, t, _ in panels}  # the check above saw every one of them
    shots = os.environ.get("NANWATCH_SCREENSHOT_DIR")
    if shots:
        exprs = {t: e for n, t, e in panels if n == "run-health.json"}
        _screenshot(stack["prometheus"], Path(shots), {name: exprs[t] for name, t in SCREENSHOTS.items()})


def _screenshot(prometheus: str, out: Path, queries: dict[str, str]) -> None:
    """Prometheus's own graph page (not Grafana, which cannot be installed here) of the dashboard panels'
    own queries, variables substituted."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium is not installed")
    out.mkdir(parents=True, exist_ok=True)
    for name, q in queries.items():
        url = f"{prometheus}/graph?" + urllib.parse.urlencode(
            {"g0.expr": q, "g0.tab": "0", "g0.range_input": "1m", "g0.stacked": "0"})
        subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        "--window-size=1100,1000", "--virtual-time-budget=15000",
                        f"--screenshot={out / f'prometheus-e2e-{name}.png'}", url],
                       check=True, capture_output=True, timeout=120)

