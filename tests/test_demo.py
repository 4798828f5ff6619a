"""The demo is the product end to end: real model, real collector on loopback, real directive."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("transformers")


def test_demo_breaks_then_recovers_through_the_collectors_directive(tmp_path):
    from nanwatch.cli.demo import run

    out = run(steps=12, spike_at=4, db_dir=tmp_path, quiet=True)
    rows = out["rows"]
    assert [r["step"] for r in rows] == list(range(12))
    assert all(r["nonfinite"] == 0 and r["mode"] == "none" for r in rows[:4])
    broken = [r for r in rows if r["nonfinite"]]
    assert broken[0]["step"] == 4 and broken[0]["first_offender"] == "model.layers.0.self_attn"
    fixed = [r for r in rows if r["mode"] == "fp32"]
    assert fixed, "the fp32 directive never reached the trainer"
    # at defaults (no margin): applied within two steps of the NaN, and the NaN step's update was skipped
    assert 4 < fixed[0]["step"] <= 4 + 2 and fixed[0]["version"] == 1
    # every non-finite step, and only those, had its update skipped (the NaN never reached the weights)
    assert [r["step"] for r in rows if r["skipped"]] == [r["step"] for r in rows if r["nonfinite"]]
    assert rows[4]["incident"] == "precision"
    assert all(r["nonfinite"] == 0 and math.isfinite(r["loss"]) for r in fixed)
    assert rows[-1]["mode"] == "fp32"
    kinds = {(e["kind"], e["site"]) for e in out["events"]}
    assert ("first_nonfinite", "model.layers.0.self_attn") in kinds
    assert ("half_attention_nonfinite", "model.layers.0.self_attn") in kinds
    assert any(k == "directive_set" for k, _ in kinds) and any(k == "mode_applied" for k, _ in kinds)
    metrics = "\n".join(out["metrics"])
    assert 'nanwatch_directive_info{mode="fp32",run_id="demo",version="1"} 1.0' in metrics
    assert 'nanwatch_attention_mode{mode="fp32",rank="0",run_id="demo"} 1.0' in metrics
