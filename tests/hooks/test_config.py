"""MonitorConfig in sections: each section validates itself, the flat option names map to the sections in
one place (every field once), an unknown name is a TypeError naming the nearest, ``resolve_config`` fills a
copy, and the parts of the trainer receive a section, never the whole config."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from nanwatch.hooks.config import (
    FLAT_OPTIONS,
    SECTIONS,
    ForensicsConfig,
    LocalLogConfig,
    MonitorConfig,
    SpikesConfig,
    WeightsConfig,
    flat_option,
    resolve_config,
)

HOOKS = Path(__file__).resolve().parents[2] / "hooks"


def _paths() -> list[str]:
    """``section.field`` of every section field, and the top level's option fields."""
    out = []
    for f in dataclasses.fields(MonitorConfig):
        if f.name in SECTIONS:
            out += [f"{f.name}.{g.name}" for g in dataclasses.fields(SECTIONS[f.name])]
        elif f.init:
            out.append(f.name)
    return out


def test_every_field_has_one_flat_name_and_every_flat_name_one_field():
    paths = _paths()
    assert sorted(FLAT_OPTIONS.values()) == sorted(paths)  # each field once: no field left out, none twice
    assert set(SECTIONS) == {f.name for f in dataclasses.fields(MonitorConfig) if f.name in SECTIONS}
    for name, path in FLAT_OPTIONS.items():
        section, field = flat_option(name)
        assert (f"{section}.{field}" if section else field) == path


def test_flat_options_and_sections_build_the_same_config():
    flat = MonitorConfig.from_options(run_id="r", guard="off", guard_reduce=False, spike_factor=5.0,
                                      spike_action="skip", log_every=7, rerun=False, report_scope="rank",
                                      max_pending_reports=3, rollout_dtype="float16", grads=False)
    nested = MonitorConfig(run_id="r", weights=WeightsConfig(guard="off", guard_reduce=False),
                           spikes=SpikesConfig(factor=5.0, action="skip"), log=LocalLogConfig(every=7),
                           forensics=ForensicsConfig(rerun=False))
    assert flat != nested
    nested.reports.scope, nested.reports.max_pending = "rank", 3
    nested.rollout.dtype, nested.measure.grads = "float16", False
    assert flat == nested
    assert flat.option("spike_factor") == flat.spikes.factor == 5.0 and flat.option("guard") == "off"
    defaults = MonitorConfig(run_id="r")
    assert MonitorConfig.from_options(run_id="r", **{n: defaults.option(n) for n in FLAT_OPTIONS
                                                      if n != "run_id"}) == defaults


def test_an_unknown_name_is_a_type_error_that_names_the_nearest():
    with pytest.raises(TypeError, match=r"spike_facter= is not an option; the nearest: spike_factor"):
        MonitorConfig.from_options(run_id="r", spike_facter=5)
    with pytest.raises(TypeError, match="spike_window"):  # a section's own field name: its flat name
        MonitorConfig.from_options(run_id="r", window=5)
    with pytest.raises(TypeError, match=r"config=MonitorConfig\(spikes=SpikesConfig"):
        MonitorConfig.from_options(run_id="r", spikes=SpikesConfig())
    with pytest.raises(TypeError, match="is not an option"):  # with a config too
        resolve_config(MonitorConfig(run_id="r"), lgo_every=3)
    with pytest.raises(TypeError, match=r"takes a WeightsConfig, got 'off'"):  # a flat value where a section goes
        MonitorConfig(run_id="r", weights="off")


@pytest.mark.parametrize(("section", "kwargs", "named"), [
    ("measure", {"exact_logit_every": -1}, r"exact_logit_every \(measure.exact_logit_every\)"),
    ("weights", {"guard": "sometimes"}, r"guard \(weights.guard\) must be 'auto' or 'off'"),
    ("weights", {"replica_check_every": -1}, r"replica_check_every \(weights.replica_check_every\)"),
    ("forensics", {"capsule_dir": "s3://bucket"}, "object-store"),
    ("spikes", {"factor": 0.5}, r"spike_factor \(spikes.factor\)"),
    ("rollout", {"dtype": "int8"}, r"rollout_dtype \(rollout.dtype\)"),
    ("directives", {"check_every": 0}, r"directive_check_every \(directives.check_every\)"),
    ("reports", {"heartbeat_s": 0}, r"heartbeat_s \(reports.heartbeat_s\)"),
    ("log", {"max_bytes": 10}, r"log_max_bytes \(log.max_bytes\)"),
])
def test_each_section_checks_its_values_and_names_the_option(section, kwargs, named):
    with pytest.raises(ValueError, match=named):
        SECTIONS[section](**kwargs)
    flat = {next(n for n, p in FLAT_OPTIONS.items() if p == f"{section}.{k}"): v for k, v in kwargs.items()}
    with pytest.raises(ValueError, match=named):
        MonitorConfig.from_options(run_id="r", **flat)


def test_resolving_fills_a_copy_and_leaves_the_given_config_and_its_sections_alone(monkeypatch, tmp_path):
    monkeypatch.setenv("NANWATCH_LOG_DIR", str(tmp_path))
    monkeypatch.setenv("NANWATCH_CAPSULE_MAX", "2")
    given = MonitorConfig.from_options(run_id="r", log_every=5)
    resolved = resolve_config(given)
    assert (resolved.log.dir, resolved.log.every, resolved.forensics.capsule_max) == (str(tmp_path), 5, 2)
    assert (given.log.dir, given.forensics.capsule_max) == (None, None)
    assert all(getattr(resolved, s) is not getattr(given, s) for s in SECTIONS)
    assert resolve_config(resolved) is resolved
    with pytest.raises(ValueError, match=r"log_every=6 conflicts with config.log.every=5"):
        resolve_config(given, log_every=6)
    assert resolve_config(given, log_every=5, run_id="r").log.every == 5  # repeating the config is fine


def _names_monitor_config(path: Path) -> bool:
    tree = ast.parse(path.read_text())
    return any(isinstance(n, ast.ImportFrom) and any(a.name == "MonitorConfig" for a in n.names)
               for n in ast.walk(tree))


def test_only_the_monitor_and_the_callbacks_hold_the_whole_config():
    """The parts receive their section (``ReportFlow`` the reports, ``LocalLog`` the log...); the Monitor
    hands them out, and the integrations build a config from their callback's options."""
    holders = {p.relative_to(HOOKS).as_posix() for p in HOOKS.rglob("*.py") if _names_monitor_config(p)}
    assert holders <= {"__init__.py", "facade.py", "integrations/transformers.py", "integrations/lightning.py"}
    assert "facade.py" in holders
