"""RolloutOptions: the rollout engine's keyword options, validated with every problem listed."""

from __future__ import annotations

import dataclasses

import pytest

from envloop.config.errors import ConfigError
from envloop.experience.rollout_options import RolloutOptions


def test_defaults():
    options = RolloutOptions.from_kwargs({})
    assert options == RolloutOptions(
        observation_format="raw",
        env_step_timeout_s=None,
        on_env_error="record",
        env_max_retries=1,
        on_turn=None,
    )


def test_from_kwargs_takes_every_option():
    seen = []
    options = RolloutOptions.from_kwargs(
        {
            "observation_format": "chat_template",
            "env_step_timeout_s": 30,
            "on_env_error": "raise",
            "env_max_retries": 0,
            "on_turn": seen.append,
        }
    )
    assert options.observation_format == "chat_template"
    assert options.env_step_timeout_s == 30 and options.env_max_retries == 0
    assert options.on_env_error == "raise" and options.on_turn == seen.append


def test_options_are_frozen():
    options = RolloutOptions()
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.on_env_error = "raise"


@pytest.mark.parametrize(
    ("options", "problem"),
    [
        (
            {"observation_format": "xml"},
            "observation_format: 'xml' is not one of raw, chat_template",
        ),
        ({"on_env_error": "ignore"}, "on_env_error: 'ignore' is not one of record, raise"),
        ({"env_step_timeout_s": 0}, "env_step_timeout_s: 0 must be a positive number or None"),
        ({"env_step_timeout_s": "5"}, "env_step_timeout_s: '5' must be a positive number or None"),
        ({"env_max_retries": -1}, "env_max_retries: -1 must be an int >= 0"),
        ({"env_max_retries": 1.5}, "env_max_retries: 1.5 must be an int >= 0"),
        (
            {"on_turn": "print"},
            "on_turn: 'print' is not callable; pass a function of one RolloutProgress, or None",
        ),
    ],
)
def test_a_bad_value_is_named_with_its_key(options, problem):
    with pytest.raises(ConfigError) as info:
        RolloutOptions.from_kwargs(options)
    assert info.value.problems == [problem]


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as info:
        RolloutOptions.from_kwargs(
            {"on_env_eror": "raise", "observation_format": "xml", "env_max_retries": -1}
        )
    assert str(info.value) == (
        "Invalid rollout options:\n"
        "  - on_env_eror: unknown option. Did you mean 'on_env_error'?\n"
        "  - observation_format: 'xml' is not one of raw, chat_template\n"
        "  - env_max_retries: -1 must be an int >= 0"
    )


def test_the_constructor_validates_too():
    with pytest.raises(ConfigError, match="on_env_error: 'crash' is not one of record, raise"):
        RolloutOptions(on_env_error="crash")


@pytest.mark.xfail(
    strict=True,
    reason="RolloutOptions accepts bools as numbers: env_step_timeout_s=True is a 1 s timeout "
    "and env_max_retries=True one retry (typed_dict_problems rejects bools for int/float)",
)
@pytest.mark.parametrize("key", ["env_step_timeout_s", "env_max_retries"])
def test_a_bool_is_not_a_number(key):
    with pytest.raises(ConfigError, match=key):
        RolloutOptions.from_kwargs({key: True})


@pytest.mark.xfail(
    strict=True,
    reason="env_step_timeout_s=nan passes validation (nan <= 0 is False); every environment "
    "step then fails with 'timed out after nan s'",
)
def test_a_nan_timeout_is_rejected():
    with pytest.raises(ConfigError, match="env_step_timeout_s"):
        RolloutOptions.from_kwargs({"env_step_timeout_s": float("nan")})
