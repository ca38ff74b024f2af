"""Config errors report every problem at once, each naming its key."""

from __future__ import annotations

import pytest

from envloop.config.errors import ConfigError
from envloop.experience.rollout_options import RolloutOptions
from envloop.models.generation.hf_generation import HfGenerationConfig


def test_unknown_keys_and_bad_values_together():
    with pytest.raises(ConfigError) as info:
        RolloutOptions.from_mapping(
            {"observation_fromat": "raw", "on_env_error": "ignore", "env_max_retries": -1}
        )
    assert info.value.problems == [
        "on_env_error: 'ignore' is not one of record, raise",
        "env_max_retries: must be >= 0, got -1",
        "observation_fromat: unknown option. Did you mean 'observation_format'?",
    ]
    assert str(info.value).startswith("Invalid rollout options:\n  - on_env_error")


def test_missing_required_field_is_named():
    with pytest.raises(ConfigError) as info:
        HfGenerationConfig.from_mapping({"seed": 1, "colour": "red"})
    assert info.value.problems == [
        "model_name: required",
        "colour: unknown option. Known: "
        + ", ".join(f for f in HfGenerationConfig.model_fields)
        + ".",
    ]


def test_valid_mapping_builds_the_config():
    assert RolloutOptions.from_mapping({"env_step_timeout_s": 2}).env_step_timeout_s == 2


def test_config_error_survives_pickling():
    import pickle

    error = pickle.loads(pickle.dumps(ConfigError("MathEnvConfig", ["num_workers: must be >= 1"])))
    assert error.problems == ["num_workers: must be >= 1"]
    assert str(error) == "Invalid MathEnvConfig:\n  - num_workers: must be >= 1"
