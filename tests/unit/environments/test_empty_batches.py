"""Every built-in environment answers an empty batch with empty, well-typed results (in-process
instances: the rollout engine may step an environment whose task has no active sample)."""

from __future__ import annotations

import pytest
import torch

from envloop.environments.registry import BUILTIN_ENVS, get_env_class
from tests.fixtures.tiny_reward_model import save_tiny_reward_model


@pytest.fixture(scope="module")
def configs(tmp_path_factory):
    rm_dir = save_tiny_reward_model(tmp_path_factory.mktemp("tiny_rm"))
    return {
        "math": {"num_workers": 1},
        "math_default": {"num_workers": 1},
        "math_multi_reward": {"num_workers": 1},
        "reward_model": {"model_name": str(rm_dir), "precision": "float32"},
    }


def _assert_empty_float32(rewards):
    assert isinstance(rewards, torch.Tensor)
    assert (rewards.dtype, tuple(rewards.shape)) == (torch.float32, (0,))


@pytest.mark.parametrize("name", sorted(BUILTIN_ENVS))
def test_an_empty_batch_gets_empty_well_typed_results(name, configs):
    env = get_env_class(name)(configs.get(name))
    try:
        ret = env.step([], [])
    finally:
        env.shutdown()
    assert (ret.observations, ret.metadata, ret.next_stop_strings) == ([], [], [])
    assert ret.answers in ([], None)
    assert (ret.terminateds.dtype, tuple(ret.terminateds.shape)) == (torch.bool, (0,))
    if isinstance(ret.rewards, dict):
        assert ret.rewards and all(key.startswith("reward/") for key in ret.rewards)
        for component in ret.rewards.values():
            _assert_empty_float32(component)
    else:
        _assert_empty_float32(ret.rewards)


def test_the_multi_reward_environment_has_its_three_components(configs):
    env = get_env_class("math_multi_reward")(configs["math_multi_reward"])
    try:
        rewards = env.step([], []).rewards
    finally:
        env.shutdown()
    assert set(rewards) == {"reward/correctness", "reward/integer", "reward/format"}
