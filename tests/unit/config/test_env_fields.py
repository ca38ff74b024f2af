"""Reading an environment's config TypedDict, defaults and field comments."""

from __future__ import annotations

from typing import TypedDict

from envloop.config.env_fields import (
    EnvConfigField,
    env_config_fields,
    env_config_problems,
    env_config_spec,
    env_defaults,
)
from envloop.environments.math_environment import MathEnvConfig, MathEnvironment
from envloop.environments.reward_model_environment import RewardModelEnvironment
from tests.fixtures.envs import EchoEnv


class _Inner(TypedDict):
    depth: int  # how deep


class _Config(TypedDict, total=False):
    size: int  # the size
    inner: _Inner  # nested options
    note: str


class _Env:
    def __init__(self, cfg: _Config | None = None) -> None:
        self.cfg = cfg


def test_fields_defaults_and_comments():
    assert env_config_spec(MathEnvironment) is MathEnvConfig
    assert env_defaults(MathEnvironment)["verify_timeout_s"] == 10.0
    assert env_config_fields(MathEnvironment)[3] == EnvConfigField(
        "reward_mode",
        "one of correctness, multi",
        "correctness",
        "one reward, or correctness + format",
    )
    assert env_config_fields(_Env) == [
        EnvConfigField("size", "int", None, "the size"),
        EnvConfigField("inner", "mapping", None, "nested options"),
        EnvConfigField("note", "str", None, ""),
    ]


def test_classes_without_a_typed_config_degrade_gracefully():
    assert env_config_spec(EchoEnv) is None
    assert env_config_fields(EchoEnv) == [] and env_defaults(EchoEnv) == {}
    assert env_config_problems(EchoEnv, {"anything": 1}, "envs.e.config") == []


def test_problems_include_nested_sections():
    problems = env_config_problems(_Env, {"sise": 1, "inner": {"depth": "x"}}, "envs.t.config")
    assert problems == [
        "envs.t.config.inner.depth: expected int, got str ('x')",
        "envs.t.config.sise: unknown option. Did you mean 'size'?",
    ]
    assert env_config_problems(_Env, [1], "envs.t.config") == [
        "envs.t.config: expected a mapping, got list ([1])"
    ]
    # Nested sections are checked over the module's defaults, as the environment merges them.
    partial = {"dynamic_batching": {"enabled": False}, "resources": {"num_gpu": 1}}
    assert env_config_problems(RewardModelEnvironment, partial, "envs.rm.config") == [
        "envs.rm.config.resources.num_gpu: unknown option. Did you mean 'num_gpus'?"
    ]
