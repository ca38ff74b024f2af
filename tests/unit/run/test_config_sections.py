"""The run config's sections: the rollout section's mode and the options each engine reads."""

from __future__ import annotations

import pytest

from envloop.config.errors import ConfigError
from envloop.experience.rollout_options import (
    ASYNC_ONLY_SETTINGS,
    AsyncRolloutOptions,
    AsyncRolloutSettings,
    RolloutSettings,
)
from envloop.run.config import RunConfig, config_reference_rows, load_run_config
from envloop.run.config_sections import RolloutConfig

REQUIRED = ["policy.model_name=bundled:policy", "data.path=d.jsonl", "envs.math.name=math"]
SYNC_OPTIONS = {
    "observation_format": "chat_template", "env_step_timeout_s": 5.0, "on_env_error": "raise",
    "env_max_retries": 2, "env_startup_timeout_s": 120.0,
}  # fmt: skip


def rollout_problems(*overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_run_config(None, [*REQUIRED, *overrides], deep=False)
    return info.value.problems


def test_async_only_options_are_those_the_async_engine_adds():
    assert ASYNC_ONLY_SETTINGS == (
        "max_concurrent_samples", "coalesce_window_s", "max_coalesced_samples",
    )  # fmt: skip
    assert set(RolloutConfig.model_fields) >= {*RolloutSettings.model_fields, *ASYNC_ONLY_SETTINGS}


def test_engine_options_are_the_keywords_of_the_modes_engine():
    sync = RolloutConfig(**SYNC_OPTIONS, max_turns=2)
    assert sync.engine_options() == SYNC_OPTIONS
    overrides = [f"rollout.{key}={value}" for key, value in SYNC_OPTIONS.items()]
    config = load_run_config(
        None,
        [*REQUIRED, *overrides, "rollout.mode=async", "rollout.max_concurrent_samples=8",
         "rollout.coalesce_window_s=0", "rollout.max_coalesced_samples=16"],
        deep=False,
    )  # fmt: skip
    assert config.rollout.engine_options() == {
        **SYNC_OPTIONS, "max_concurrent_samples": 8, "coalesce_window_s": 0.0,
        "max_coalesced_samples": 16,
    }  # fmt: skip
    AsyncRolloutOptions.from_mapping(config.rollout.engine_options())  # the engine takes them


def test_async_options_keep_the_engines_constraints():
    assert rollout_problems(
        "rollout.mode=async", "rollout.max_concurrent_samples=0", "rollout.coalesce_window_s=-1",
        "rollout.max_coalesced_samples=true",
    ) == [
        "rollout.max_concurrent_samples: must be >= 1, got 0",
        "rollout.coalesce_window_s: must be >= 0, got -1",
        "rollout.max_coalesced_samples: expected int, got bool (True)",
    ]  # fmt: skip


def test_an_async_only_option_with_mode_sync_is_an_error():
    assert rollout_problems("rollout.max_concurrent_samples=8") == [
        "rollout.mode: 'sync' ignores max_concurrent_samples (8), an option of mode async: "
        "set mode: async, or leave it out"
    ]
    assert rollout_problems(
        "rollout.coalesce_window_s=0.01", "rollout.max_coalesced_samples=4",
        "rollout.max_concurrent_samples=0", "rollout.max_turns=0",
    ) == [
        "rollout.max_concurrent_samples: must be >= 1, got 0",
        "rollout.max_turns: must be >= 1, got 0",
        "rollout.mode: 'sync' ignores coalesce_window_s (0.01) and max_coalesced_samples (4), "
        "options of mode async: set mode: async, or leave them out",
    ]  # every problem at once  # fmt: skip


def test_a_sync_runs_config_yaml_loads_again():
    """``config.yaml`` lists every option, the async ones at their defaults."""
    config = load_run_config(None, REQUIRED, deep=False)
    resolved = config.to_dict()
    assert {key: resolved["rollout"][key] for key in ASYNC_ONLY_SETTINGS} == {
        "max_concurrent_samples": None, "coalesce_window_s": 0.002, "max_coalesced_samples": 256,
    }  # fmt: skip
    assert RunConfig.from_mapping(resolved) == config


def test_the_reference_shows_the_async_engines_declarations():
    rows = {key: rest for key, *rest in config_reference_rows()}
    for name in ASYNC_ONLY_SETTINGS:
        declared = AsyncRolloutSettings.model_fields[name]
        expected = " ".join(declared.description.replace("None", "null").split())
        assert rows[f"rollout.{name}"][2] == expected
    assert rows["rollout.max_concurrent_samples"][:2] == ["int or null", "null"]
    assert rows["rollout.coalesce_window_s"][:2] == ["float", "0.002"]
    assert rows["rollout.mode"][0] == "one of sync, async"
