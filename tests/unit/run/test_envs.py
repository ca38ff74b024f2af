"""A run's environments asked for metrics over finished sample records (in-process here;
as Ray actors in tests/integration/test_cli_run.py)."""

from __future__ import annotations

import pytest
import torch

from envloop.environments.games.sliding_puzzle import SlidingPuzzleEnv, new_episode_metadata
from envloop.environments.reward_model_environment import RewardModelEnvironment
from envloop.run.envs import EnvStartError, _final_error, check_gpus, env_metrics, records_to_batch

SOLVED = {**new_episode_metadata(0, size=2, shuffle_moves=1), "board": [[1, 2], [3, 0]]}
RECORDS = [
    {"task": "puzzle", "messages": [{"role": "user", "content": "go", "num_tokens": 3}],
     "extra_env_info": {**SOLVED, "moves_made": 1}, "total_reward": 1.0, "num_turns": 1,
     "truncated": False, "rewards": {}},
    {"task": "puzzle", "messages": [{"role": "user", "content": "go", "num_tokens": 3}],
     "extra_env_info": {**new_episode_metadata(1, size=2), "moves_made": 3}, "total_reward": 0.0,
     "num_turns": 3, "truncated": True, "rewards": {}},
    {"task": "other", "messages": [], "extra_env_info": None, "total_reward": 0.5,
     "num_turns": 1, "truncated": False, "rewards": {"reward/a": 0.5}},
]  # fmt: skip


def test_records_to_batch():
    batch = records_to_batch(RECORDS)
    assert batch["message_log"][0] == [{"role": "user", "content": "go"}]
    assert batch["task_name"] == ["puzzle", "puzzle", "other"]
    assert batch["total_reward"].tolist() == [1.0, 0.0, 0.5]
    assert batch["num_turns"].tolist() == [1, 3, 1]
    assert batch["truncated"].tolist() == [False, True, False]
    assert batch["reward/a"].tolist() == [0.0, 0.0, 0.5]
    assert batch["total_reward"].dtype == torch.float32


def test_env_metrics_per_task_from_records():
    metrics = env_metrics({"puzzle": SlidingPuzzleEnv(), "unused": SlidingPuzzleEnv()}, RECORDS)
    assert metrics == {
        "puzzle": {
            "sliding_puzzle_env/num_episodes": 2,
            "sliding_puzzle_env/solve_rate": 0.5,
            "sliding_puzzle_env/mean_moves": 2.0,
            "sliding_puzzle_env/invalid_move_rate": 0.0,
            "sliding_puzzle_env/move_limit_rate": 0.0,
            "sliding_puzzle_env/over_max_parse_chars": 0,
        }
    }


def test_final_error_keeps_the_constructor_error():
    text = "ray.exceptions.ActorDiedError: died\n  File x\nmod.ConfigError: Invalid X:\n  - a: bad"
    assert _final_error(text) == "mod.ConfigError: Invalid X:\n  - a: bad"
    assert _final_error("no error line") == "no error line"


@pytest.mark.ray
def test_check_gpus_refuses_more_gpus_than_the_ray_session_has(ray_session):
    gpus = ray_session.cluster_resources().get("GPU", 0)
    check_gpus("rm", {"num_gpus": gpus, "num_cpus": 1})  # what the session has: fine
    with pytest.raises(EnvStartError) as info:
        check_gpus("rm", RewardModelEnvironment.actor_options(
            {"resources": {"gpus_per_node": gpus + 1, "num_nodes": 1}}
        ))  # fmt: skip
    assert str(info.value) == (
        f"envs.rm: the environment asks Ray for {gpus + 1:g} GPU(s) but the Ray session has "
        f"{gpus:g}; set its config's resources (e.g. resources.gpus_per_node: 0 to run on CPU) "
        "or start envloop on a machine or cluster with GPUs."
    )


@pytest.mark.ray
def test_a_run_whose_environment_never_starts_stops_with_the_timeout_named(ray_session, tmp_path):
    from envloop.run.config_sections import EnvConfig
    from envloop.run.envs import wait_until_ready
    from tests.fixtures.containment_envs import NeverStartsEnv
    from tests.fixtures.envs import EchoEnv

    release = tmp_path / "release"
    handles = {
        "echo": EchoEnv.options(num_cpus=0).remote(),
        "slow": NeverStartsEnv.options(num_cpus=0).remote(str(release), str(tmp_path / "c")),
    }
    envs = {
        "echo": EnvConfig(name="tests.fixtures.envs:EchoEnv"),
        "slow": EnvConfig(name="tests.fixtures.containment_envs:NeverStartsEnv"),
    }
    try:
        ray_session.get(handles["echo"].__ray_ready__.remote())
        with pytest.raises(EnvStartError) as info:
            wait_until_ready(handles, envs, timeout_s=2.0)
        assert str(info.value) == (
            "envs.slow ('tests.fixtures.containment_envs:NeverStartsEnv') did not start within "
            "rollout.env_startup_timeout_s=2.0 s: the constructor is still running. Raise "
            "rollout.env_startup_timeout_s if it needs longer (loading a large reward model), "
            "or fix what it waits for."
        )
        release.touch()
        wait_until_ready(handles, envs, timeout_s=None)  # started once released
    finally:
        release.touch()
        for handle in handles.values():
            ray_session.kill(handle)
