"""The wire schema: shared by both sides, lossless for non-finite floats, strict about versions."""

import json
import math
import subprocess
import sys

import pytest
from pydantic import ValidationError

from nanwatch.wire import SCHEMA_VERSION, ReportBatch, RlhfStat, SiteStat, StepReport


def _report(**kw) -> StepReport:
    base = dict(run_id="run-1", incarnation="abc", seq=0, step=7, time=1.5)
    base.update(kw)
    return StepReport(**base)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, 0.0, 1e308])
def test_non_finite_floats_round_trip_exactly(value):
    site = SiteStat(site="model.layers.0.self_attn", kind="attention", phase="forward", dtype="float16",
                    numel=4, nan=1, inf=0, amax=value, headroom=value)
    r = _report(sites=[site], rlhf=RlhfStat(logprob_min=value, kl_k3_max=value))
    text = ReportBatch(reports=[r]).model_dump_json()
    assert "null" not in text.split('"ratio_max"')[0]
    for back in (ReportBatch.model_validate_json(text), ReportBatch.model_validate(json.loads(text))):
        got = back.reports[0]
        for x in (got.sites[0].amax, got.sites[0].headroom, got.rlhf.logprob_min, got.rlhf.kl_k3_max):
            assert (math.isnan(x) and math.isnan(value)) or x == value


def test_unknown_major_version_is_rejected_and_named():
    with pytest.raises(ValidationError, match="'2.0'"):
        _report(v="2.0")
    assert _report(v="1.7").v == "1.7"
    assert _report().v == SCHEMA_VERSION


@pytest.mark.parametrize("bad", [{"run_id": "a\nb"}, {"run_id": "x" * 200}, {"step": -1},
                                 {"incarnation": ""}, {"rank": -2}, {"surprise": 1}])
def test_bad_fields_are_rejected(bad):
    with pytest.raises(ValidationError):
        _report(**bad)


def test_wire_imports_neither_torch_nor_web_stack():
    code = ("import sys, nanwatch.wire; bad = [m for m in ('torch', 'fastapi', 'starlette', 'uvicorn', "
            "'prometheus_client') if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_1_3_report_is_still_read_as_a_rank_report():
    old = {"v": "1.3", "run_id": "r", "incarnation": "abc", "seq": 0, "step": 1, "time": 0.0}
    r = StepReport.model_validate_json(json.dumps(old), strict=True)
    assert r.scope == "rank" and r.first_offender_rank is None and r.nonfinite_rank is None


@pytest.mark.parametrize("field", ["first_offender_rank", "nonfinite_rank"])
def test_a_rank_named_in_a_report_lies_inside_its_world(field):
    assert getattr(_report(world_size=4, **{field: 3}), field) == 3
    with pytest.raises(ValidationError, match=f"{field} 4 is outside world_size 4"):
        _report(world_size=4, **{field: 4})
    with pytest.raises(ValidationError, match="ranks_reporting 5 exceeds"):
        _report(scope="job", world_size=4, ranks_reporting=5)


def test_a_heartbeat_carries_no_measurements():
    beat = _report(scope="heartbeat", rank=3, world_size=8, attention_mode="fp32", dropped_reports=2)
    assert beat.nonfinite_total == 0
    site = SiteStat(site="s", kind="mlp", phase="forward", dtype="float32", numel=1, nan=1, inf=0, amax=0.0,
                    headroom=0.0)
    with pytest.raises(ValidationError, match="a heartbeat carries no measurements"):
        _report(scope="heartbeat", sites=[site])
