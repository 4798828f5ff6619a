"""No accepted input can break a render or a read for anyone (#37 findings 1 and 2), and one made-up rank
cannot hide another rank's rollout drift (#36), against a real collector (uvicorn on loopback, in this
process) with two scoped tokens: team A is the attacker, team B and the collector's own health the victims.

The issue's exact attacks first (1e308 on two ranks, +-Infinity, 2^53-1 + 1 tokens), then a property test:
arbitrary valid reports, built by hypothesis from the wire schema's own bounds, through ingest, and every
``/metrics`` and ``GET /v1/runs/{id}`` render a 200."""

from __future__ import annotations

import itertools
import json
import math
import types
from typing import Annotated, Union, get_args, get_origin

import annotated_types as at
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel
from support import ADMIN, JSON, background_collector, sample, scrape, step_report

from nanwatch.monitor.data import rollout_figures
from nanwatch.monitor.read import exporter
from nanwatch.wire import MAX_INT, MAX_ROLLOUT_COUNT, ReportBatch, RlhfStat, RolloutStat, Spike, StepReport

TEAM_A, TEAM_B, READER = "team-a-secret", "team-b-secret", "reader-secret"
A_H = {"Authorization": f"Bearer {TEAM_A}", **JSON}
B_H = {"Authorization": f"Bearer {TEAM_B}", **JSON}
SITE = "model.layers.1.self_attn"
#: the drift alert's threshold (deploy/prometheus/rules.in/nanwatch.yml, NanwatchRolloutDrift)
DRIFT = 0.05


@pytest.fixture(scope="module")
def teams(tmp_path_factory):
    tokens = {"team-a": {"token": TEAM_A, "runs": "team-a-*"}, "team-b": {"token": TEAM_B, "runs": "team-b-*"}}
    with background_collector(tmp_path_factory.mktemp("render"), tokens=tokens, admin_tokens={"alice": ADMIN},
                              metrics_token=READER, metrics_min_interval_s=0) as srv:
        yield srv


def _post(url: str, headers: dict, *reports: StepReport) -> httpx.Response:
    return httpx.post(f"{url}/v1/reports", content=ReportBatch(reports=list(reports)).model_dump_json(),
                      headers=headers)


def _raw(url: str, headers: dict, *reports: dict) -> httpx.Response:
    """A batch as the attacker writes it (JSON constants NaN/Infinity, numbers beyond the schema's)."""
    return httpx.post(f"{url}/v1/reports", content=json.dumps({"reports": list(reports)}), headers=headers)


def _rollout_report(run_id: str, rank: int, *, world: int = 2, seq: int = 0, **rollout) -> StepReport:
    stat = RolloutStat.model_construct(**{**RolloutStat().model_dump(), **rollout})
    return step_report(run_id=run_id, rank=rank, world_size=world, seq=seq, step=seq + 1).model_copy(
        update={"rlhf": RlhfStat.model_construct(**{**RlhfStat().model_dump(), "rollout": stat})})


def _as_json(r: StepReport) -> dict:
    return json.loads(r.model_dump_json())


def _victim_still_served(url: str) -> None:
    """Team B's NaN counts, and /metrics renders with the collector's own health."""
    run = "team-b-victim"
    n = int(sample(scrape(url, READER), "nanwatch_run_nonfinite_calls_total", run_id=run, stage="train",
                   **{"pass": "forward", "kind": "nan"}) or 0)
    resp = _post(url, B_H, step_report(run_id=run, seq=n + 100, step=n + 100, nan_at=SITE, nan=2))
    assert resp.status_code == 200, resp.text
    s = scrape(url, READER)
    assert sample(s, "nanwatch_run_nonfinite_calls_total", run_id=run, stage="train",
                  **{"pass": "forward", "kind": "nan"}) == n + 2
    assert ("process_resident_memory_bytes", frozenset()) in s


@pytest.mark.parametrize("figure", [1e308, math.inf, -math.inf, math.nan, -0.5])
def test_an_unbounded_rollout_figure_is_a_422_naming_it_and_renders_stay_200(teams, figure):
    """Findings 1 (and #36): 1e308 on two ranks overflowed math.fsum, +-Infinity made it raise, a NaN or
    negative |dlogp| hid another rank's drift: each is refused at ingest, naming the field."""
    run = f"team-a-figure{figure}"
    ranks = [_as_json(_rollout_report(run, k, tokens=100, abs_mean=0.1)) for k in range(2)]
    for r in ranks:
        r["rlhf"]["rollout"]["abs_mean"] = figure
    body = json.dumps({"reports": ranks}, allow_nan=True)
    resp = httpx.post(f"{teams.url}/v1/reports", content=body, headers=A_H)
    assert resp.status_code == 422, resp.text
    assert "abs_mean" in resp.text
    _victim_still_served(teams.url)


def test_a_count_past_the_rollout_bound_is_a_422_and_two_valid_counts_sum(teams):
    """Finding 2: rank 0's 2^53-1 tokens and rank 1's 1 were each a valid count, and their sum failed
    re-validation inside every render. A count is now at most 2^32 a report; two at the bound sum exactly."""
    resp = _raw(teams.url, A_H, _as_json(_rollout_report("team-a-count", 0, tokens=1, abs_mean=0.01))
                | {"rlhf": {"rollout": {"tokens": MAX_INT}}})
    assert resp.status_code == 422 and "tokens" in resp.text, resp.text
    run = "team-a-counts"
    assert _post(teams.url, A_H, _rollout_report(run, 0, tokens=MAX_ROLLOUT_COUNT, abs_mean=0.01),
                 _rollout_report(run, 1, tokens=MAX_ROLLOUT_COUNT, abs_mean=0.01)).status_code == 200
    view = httpx.get(f"{teams.url}/v1/runs/{run}", headers=A_H)
    assert view.status_code == 200 and view.json()["rollout"]["tokens"] == 2 * MAX_ROLLOUT_COUNT
    _victim_still_served(teams.url)


def test_rlhf_figures_of_1e308_and_infinity_on_two_ranks_render(teams):
    """The same attack on the policy-gradient figures (NaN and Inf are their data, so they are accepted):
    statistics.fmean raised on 1e308 + 1e308 and inf + -inf inside every render."""
    for run, (a, b) in (("team-a-rlhf-big", (1e308, 1e308)), ("team-a-rlhf-inf", (math.inf, -math.inf))):
        reports = [step_report(run_id=run, rank=k, world_size=2).model_copy(
            update={"rlhf": RlhfStat(clip_fraction=v, kl_k1_mean=v, advantage_std=v)}) for k, v in enumerate((a, b))]
        assert _post(teams.url, A_H, *reports).status_code == 200
        assert httpx.get(f"{teams.url}/v1/runs/{run}", headers=A_H).status_code == 200
    s = scrape(teams.url, READER)
    assert sample(s, "nanwatch_rlhf_stat", run_id="team-a-rlhf-big", stat="clip_fraction") == math.inf
    assert math.isnan(sample(s, "nanwatch_rlhf_stat", run_id="team-a-rlhf-inf", stat="clip_fraction"))
    _victim_still_served(teams.url)


def test_combining_cannot_raise_whatever_the_figures(teams):
    """Defence in depth behind the wire's bounds: the combination is arithmetic that cannot raise, and a
    summed count beyond the integer bound is clamped and said."""
    huge = [RolloutStat.model_construct(**{**RolloutStat().model_dump(), "tokens": MAX_INT, "abs_mean": v,
                                           "rms": v, "mean": -v, "k3_mean": v}) for v in (1e308, math.inf)]
    huge.append(RolloutStat.model_construct(**{**RolloutStat().model_dump(), "tokens": 1, "abs_mean": -math.inf}))
    out = rollout_figures.combined(huge)
    assert out.clamped and out.stat.tokens == MAX_INT
    assert math.isnan(out.stat.abs_mean) or math.isinf(out.stat.abs_mean)


def test_a_run_whose_series_cannot_be_built_is_left_out_counted_and_recorded(teams, monkeypatch):
    """The safety net: a run whose figures still cannot be rendered is left out of that render (none of its
    series half-written), counted and recorded as an event of the run; everyone else's render is a 200."""
    run = "team-a-broken"
    assert _post(teams.url, A_H, step_report(run_id=run, nan_at=SITE, nan=1)).status_code == 200
    real = exporter._where

    def broken(f, snap):
        real(f, snap)
        if snap.run_id == run:
            raise OverflowError("a figure no render can hold")

    monkeypatch.setattr(exporter, "_where", broken)
    before = sample(scrape(teams.url, READER), "nanwatch_collector_render_errors_total", reason="run_left_out")
    s = scrape(teams.url, READER)
    assert not [k for k in s if dict(k[1]).get("run_id") == run and k[0] != "nanwatch_events_total"]
    assert sample(s, "nanwatch_collector_render_errors_total", reason="run_left_out") > before
    _victim_still_served(teams.url)
    events = httpx.get(f"{teams.url}/v1/runs/{run}", headers=A_H).json()["events"]
    assert any(e["kind"] == "render_left_out" for e in events)
    monkeypatch.setattr(exporter, "_where", real)
    assert sample(scrape(teams.url, READER), "nanwatch_live_ranks", run_id=run) == 1  # back once it renders


@pytest.mark.parametrize("fake_tokens", [2**32, 2**20, 1])
def test_one_made_up_rank_cannot_hide_another_ranks_drift(teams, fake_tokens):
    """#36: a made-up rank at abs_mean 0 with a count far from the real rank's (2^40 then, 2^32 now, or a
    single token to shrink a median) diluted the real rank's drift below the alert's threshold: the counts
    are not believed as weights when they are more than TOKEN_SPREAD apart, and the render says so."""
    run = f"team-a-drift-{fake_tokens}"
    real = _rollout_report(run, 0, tokens=10_000, abs_mean=0.08, rms=0.1, k3_mean=0.004, mean=0.07,
                           truncated_fraction=0.01)
    fake = _rollout_report(run, 1, tokens=fake_tokens, abs_mean=0.0, rms=0.0, k3_mean=0.0, mean=0.0,
                           truncated_fraction=0.0).model_copy(update={"incarnation": "made-up"})
    assert _post(teams.url, A_H, real, fake).status_code == 200
    s = scrape(teams.url, READER)
    figures = {stat: sample(s, "nanwatch_rollout_mismatch", run_id=run, stat=stat)
               for stat in ("abs_mean", "rms", "k3_mean", "mean", "truncated_fraction")}
    assert figures["abs_mean"] > DRIFT
    assert figures == {"abs_mean": 0.08, "rms": 0.1, "k3_mean": 0.004, "mean": 0.07, "truncated_fraction": 0.01}
    assert sample(s, "nanwatch_collector_render_errors_total", reason="rollout_distrusted") >= 1
    assert httpx.get(f"{teams.url}/v1/runs/{run}", headers=A_H).json()["rollout"]["abs_mean"] == 0.08


def test_a_real_rank_at_the_threshold_stays_at_it():
    """The issue's numbers: a real rank at 0.05 with 1e4 tokens and a fake at 0 with 2^32: the gauge stays
    at 0.05 (it was 1.2e-7), so the alert's `> 0.05` fires on anything above it."""
    real = RolloutStat(tokens=10_000, abs_mean=DRIFT)
    fake = RolloutStat(tokens=MAX_ROLLOUT_COUNT, abs_mean=0.0)
    assert rollout_figures.combine([real, fake]).abs_mean == DRIFT
    # counts within the spread are exact token weights
    assert rollout_figures.combine([real, RolloutStat(tokens=30_000, abs_mean=0.01)]).abs_mean == pytest.approx(
        (10_000 * DRIFT + 30_000 * 0.01) / 40_000)


# ---- the property: arbitrary valid reports, from the wire schema's own bounds ---------------------------

def _number(kind: type, meta: list) -> st.SearchStrategy | None:
    """A number strategy from pydantic's field metadata (annotated_types bounds, ``allow_inf_nan``)."""
    lo = next((m.ge for m in meta if isinstance(m, at.Ge)), None)
    gt = next((m.gt for m in meta if isinstance(m, at.Gt)), None)
    hi = next((m.le for m in meta if isinstance(m, at.Le)), None)
    if kind is int:
        return st.integers(min_value=lo if lo is not None else gt + 1 if gt is not None else None, max_value=hi)
    finite = any(getattr(m, "allow_inf_nan", True) is False for m in meta)
    bounded = lo is not None or gt is not None or hi is not None
    return st.floats(min_value=lo if lo is not None else gt, max_value=hi, exclude_min=gt is not None,
                     allow_nan=not (finite or bounded), allow_infinity=None if not finite else False)


def _strategy(annotation: object, meta: list) -> st.SearchStrategy | None:
    """A strategy for one field's type (None: leave its default): numbers, bools, optional and nested models."""
    origin = get_origin(annotation)
    if origin is Annotated:
        inner, *extra = get_args(annotation)
        return _strategy(inner, [*meta, *(m for fi in extra for m in getattr(fi, "metadata", [fi]))])
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        inner = _strategy(args[0], meta) if len(args) == 1 else None
        return None if inner is None else st.none() | inner
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return _model(annotation)
    if annotation is bool:
        return st.booleans()
    if annotation in (int, float):
        return _number(annotation, meta)
    return None


def _model(model: type[BaseModel], **fixed: object) -> st.SearchStrategy:
    fields = {name: s for name, f in model.model_fields.items()
              if name not in fixed and (s := _strategy(f.annotation, list(f.metadata))) is not None}
    return st.builds(model, **fields, **{k: st.just(v) for k, v in fixed.items()})


_run_ids = itertools.count()


@st.composite
def _reports(draw) -> list[StepReport]:
    """One to three ranks' reports of a fresh run: RLHF and rollout figures, headroom, logit bounds, loss
    scale and spikes drawn from the schema; the rest a plain step."""
    world = draw(st.integers(1, 3))
    run_id = f"team-a-prop-{next(_run_ids)}"
    out = []
    for rank in range(world):
        base = step_report(run_id=run_id, rank=rank, world_size=world, seq=0, step=1, nan_at=SITE,
                           nan=draw(st.integers(0, 3)), dtype="float16")
        floats = st.floats()  # amax, headroom, logit bounds: NaN and Inf are their data
        sites = [s.model_copy(update={"amax": draw(floats), "headroom": draw(floats)}) for s in base.sites]
        logits = [lg.model_copy(update={"bound": draw(floats)}) for lg in base.logits]
        report = base.model_copy(update={
            "rlhf": draw(_model(RlhfStat)), "sites": sites, "logits": logits,
            "loss_scale": draw(st.none() | st.floats(min_value=0)),
            "spikes": draw(st.lists(_model(Spike, site=SITE, phase="backward", kind="attention"), max_size=2))})
        out.append(StepReport.model_validate_json(report.model_dump_json()))  # valid on the wire, as sent
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(batch=_reports())
def test_every_render_of_arbitrary_valid_reports_is_200(teams, batch):
    resp = _post(teams.url, A_H, *batch)
    assert resp.status_code == 200, resp.text
    run = batch[0].run_id
    view = httpx.get(f"{teams.url}/v1/runs/{run}", headers=A_H)
    assert view.status_code == 200, view.text
    metrics = httpx.get(f"{teams.url}/metrics", headers={"Authorization": f"Bearer {READER}"})
    assert metrics.status_code == 200, metrics.text[:500]
    assert f'run_id="{run}"' in metrics.text  # rendered, not left out
