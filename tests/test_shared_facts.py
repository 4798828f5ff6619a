"""Facts both sides read from one place: the agreement cadence, the default logit threshold, and how a
bearer token is read and checked (``nanwatch.policy``, ``nanwatch.tokens``)."""

import pytest

from nanwatch.policy import DEFAULT_LOGIT_TAU, is_agreement_step, next_apply_step
from nanwatch.tokens import check_token, read_token_file, token_from_env


@pytest.mark.parametrize("latest,world,every,expected", [
    (0, 1, None, 1), (7, 1, 4, 8),          # one rank: the next step, whatever the cadence
    (7, 2, 1, 8), (7, 2, None, 8),          # ranks that agree every step: the next step
    (7, 2, 4, 8), (8, 2, 4, 12), (0, 4, 4, 4),  # otherwise the next agreement step after the latest
])
def test_the_collector_asks_for_the_first_step_every_rank_can_apply(latest, world, every, expected):
    step = next_apply_step(latest, world_size=world, agree_every=every)
    assert step == expected
    if world > 1 and every:  # and the trainer agrees exactly there
        assert is_agreement_step(step, every)
        assert not any(is_agreement_step(s, every) for s in range(latest + 1, step))


def test_both_sides_default_to_the_same_logit_tau():
    from nanwatch.monitor.settings import Settings

    assert Settings().logit_tau == DEFAULT_LOGIT_TAU
    pytest.importorskip("torch")
    from nanwatch.hooks.config import MonitorConfig

    assert MonitorConfig(run_id="r").directives.logit_tau == DEFAULT_LOGIT_TAU


def test_a_token_comes_from_the_variable_then_its_file(tmp_path):
    f = tmp_path / "tok"
    f.write_text("  from-file\n")
    assert token_from_env("NANWATCH_TOKEN", {}) is None
    assert token_from_env("NANWATCH_TOKEN", {"NANWATCH_TOKEN_FILE": str(f)}) == "from-file"
    assert token_from_env("NANWATCH_TOKEN", {"NANWATCH_TOKEN": "env", "NANWATCH_TOKEN_FILE": str(f)}) == "env"


@pytest.mark.parametrize("bad", ["with space", "ünïcode", "tab\there"])
def test_a_token_that_http_cannot_carry_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="NANWATCH_TOKEN token must be visible ASCII"):
        token_from_env("NANWATCH_TOKEN", {"NANWATCH_TOKEN": bad})
    assert check_token("x", "Ab0-_.~!") == "Ab0-_.~!"


def test_an_unreadable_or_empty_token_file_is_refused_by_path(tmp_path):
    with pytest.raises(ValueError, match="cannot read the ingest token file"):
        read_token_file("ingest", tmp_path / "missing")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        read_token_file("ingest", tmp_path / "empty")
