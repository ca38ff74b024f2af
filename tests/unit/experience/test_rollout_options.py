"""RolloutOptions: the rollout engine's keyword options, validated with every problem listed."""

from __future__ import annotations

import pydantic
import pytest

from envloop.config.errors import ConfigError
from envloop.experience.rollout_options import RolloutOptions


def test_defaults():
    options = RolloutOptions.from_mapping({})
    assert options == RolloutOptions(
        observation_format="raw",
        env_step_timeout_s=None,
        on_env_error="record",
        env_max_retries=1,
        on_turn=None,
    )


def test_from_kwargs_takes_every_option():
    seen = []
    options = RolloutOptions.from_mapping(
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
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        options.on_env_error = "raise"


@pytest.mark.parametrize(
    ("options", "problem"),
    [
        (
            {"observation_format": "xml"},
            "observation_format: 'xml' is not one of raw, chat_template",
        ),
        ({"on_env_error": "ignore"}, "on_env_error: 'ignore' is not one of record, raise"),
        ({"env_step_timeout_s": 0}, "env_step_timeout_s: must be > 0, got 0"),
        ({"env_step_timeout_s": "5"}, "env_step_timeout_s: expected number | None, got str ('5')"),
        ({"env_max_retries": -1}, "env_max_retries: must be >= 0, got -1"),
        ({"env_max_retries": 1.5}, "env_max_retries: expected int, got float (1.5)"),
        (
            {"on_turn": "print"},
            "on_turn: expected a function | None, got str ('print')",
        ),
    ],
)
def test_a_bad_value_is_named_with_its_key(options, problem):
    with pytest.raises(ConfigError) as info:
        RolloutOptions.from_mapping(options)
    assert info.value.problems == [problem]


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as info:
        RolloutOptions.from_mapping(
            {"on_env_eror": "raise", "observation_format": "xml", "env_max_retries": -1}
        )
    assert str(info.value) == (
        "Invalid rollout options:\n"
        "  - observation_format: 'xml' is not one of raw, chat_template\n"
        "  - env_max_retries: must be >= 0, got -1\n"
        "  - on_env_eror: unknown option. Did you mean 'on_env_error'?"
    )


def test_the_constructor_validates_too():
    with pytest.raises(ConfigError, match="on_env_error: 'crash' is not one of record, raise"):
        RolloutOptions(on_env_error="crash")


@pytest.mark.parametrize("key", ["env_step_timeout_s", "env_max_retries"])
def test_a_bool_is_not_a_number(key):
    with pytest.raises(ConfigError, match=key):
        RolloutOptions.from_mapping({key: True})


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_timeout_must_be_finite(value):
    with pytest.raises(ConfigError) as info:
        RolloutOptions.from_mapping({"env_step_timeout_s": value})
    assert info.value.problems == [f"env_step_timeout_s: must be a finite number, got {value!r}"]
