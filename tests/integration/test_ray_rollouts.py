"""Multi-turn rollouts through real Ray actor environments."""

from __future__ import annotations

import asyncio

import pytest
import torch

from envloop.distributed.ray_utils import init_ray
from envloop.environments.registry import create_env, register_env
from envloop.experience.rollouts import (
    EnvironmentStepError,
    run_async_multi_turn_rollout,
    run_multi_turn_rollout,
)
from envloop.models.generation.scripted_generation import ScriptedGeneration
from tests.fixtures.batches import calc_sample, guess_sample, make_batch, scripted_respond
from tests.fixtures.envs import CalculatorEnv, GuessNumberEnv

pytestmark = pytest.mark.ray

register_env("test_calc", "tests.fixtures.envs:CalculatorEnv", overwrite=True)
register_env("test_guess", "tests.fixtures.envs:GuessNumberEnv", overwrite=True)
register_env("test_failing", "tests.fixtures.envs:FailingEnv", overwrite=True)
register_env("test_slow", "tests.fixtures.envs:SlowEnv", overwrite=True)
register_env("test_die_once", "tests.fixtures.envs:DieOnceEnv", overwrite=True)
register_env("test_slow_start", "tests.fixtures.envs:SlowStartEnv", overwrite=True)

MIXED = [
    guess_sample(37),
    calc_sample("What is 12 * 7 + 1?", 85),
    guess_sample(50),
    calc_sample("What is 9 - 2?", 7),
    guess_sample(99, max_guesses=4),
]


def _run(tokenizer, task_to_env, samples=MIXED, **options):
    policy = ScriptedGeneration(tokenizer, scripted_respond)
    return run_multi_turn_rollout(
        policy, make_batch(tokenizer, samples), tokenizer, task_to_env, 512, **options
    )


def test_ray_actors_and_in_process_envs_give_identical_rollouts(ray_session, tiny_tokenizer):
    actors = {
        "calc": create_env("test_calc", num_cpus=0),
        "guess": create_env("test_guess", num_cpus=0),
    }
    local = {"calc": CalculatorEnv(), "guess": GuessNumberEnv()}
    ray_final, ray_metrics = _run(tiny_tokenizer, actors)
    local_final, local_metrics = _run(tiny_tokenizer, local)
    for ray_log, local_log in zip(ray_final["message_log"], local_final["message_log"]):
        assert [m["role"] for m in ray_log] == [m["role"] for m in local_log]
        assert [m["content"] for m in ray_log] == [m["content"] for m in local_log]
        assert torch.equal(
            torch.cat([m["token_ids"] for m in ray_log]),
            torch.cat([m["token_ids"] for m in local_log]),
        )
    assert ray_final["total_reward"].tolist() == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert ray_final["total_reward"].tolist() == local_final["total_reward"].tolist()
    assert ray_final["extra_env_info"] == local_final["extra_env_info"]
    assert ray_final["num_turns"].tolist() == [3, 3, 1, 1, 4]
    for key in ("total_turns", "natural_termination_rate", "mean_total_tokens_per_sample"):
        assert ray_metrics[key] == local_metrics[key]


def test_async_rollout_through_actors_equals_the_sync_one(ray_session, tiny_tokenizer):
    actors = {
        "calc": create_env("test_calc", num_cpus=0),
        "guess": create_env("test_guess", num_cpus=0),
        "failing": create_env("test_failing", num_cpus=0),
    }
    samples = [*MIXED, {"task": "failing", "prompt": "Anything."}]
    policy = ScriptedGeneration(tiny_tokenizer, scripted_respond)
    batch = make_batch(tiny_tokenizer, samples)
    sync, _ = run_multi_turn_rollout(policy, batch, tiny_tokenizer, actors, 512)
    final, metrics = asyncio.run(
        run_async_multi_turn_rollout(policy, batch, tiny_tokenizer, actors, 512)
    )
    for log, sync_log in zip(final["message_log"], sync["message_log"], strict=True):
        assert [(m["role"], m["content"]) for m in log] == [
            (m["role"], m["content"]) for m in sync_log
        ]
        assert torch.equal(
            torch.cat([m["token_ids"] for m in log]), torch.cat([m["token_ids"] for m in sync_log])
        )
    assert final["num_turns"].tolist() == [3, 3, 1, 1, 4, 1]
    assert final["total_reward"].tolist() == sync["total_reward"].tolist()
    assert final["extra_env_info"] == sync["extra_env_info"]
    assert final["env_error"][5].startswith("env failing.step raised:")
    assert metrics["env_error_rate"] == pytest.approx(1 / 6)


def test_failing_actor_fails_only_its_samples(ray_session, tiny_tokenizer):
    envs = {
        "calc": create_env("test_failing", num_cpus=0),
        "guess": create_env("test_guess", num_cpus=0),
    }
    final, metrics = _run(tiny_tokenizer, envs)
    assert final["total_reward"].tolist() == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert final["loss_multiplier"] == [1.0, 0.0, 1.0, 0.0, 1.0]
    assert "boom: the failing environment always raises" in final["env_error"][1]
    assert final["env_error"][0] is None
    assert metrics["env_error_rate"] == pytest.approx(2 / 5)
    with pytest.raises(EnvironmentStepError, match=r"env calc\.step raised(.|\n)*boom"):
        _run(tiny_tokenizer, envs, on_env_error="raise")


def test_slow_actor_times_out(ray_session, tiny_tokenizer):
    envs = {
        "calc": create_env("test_slow", 60.0, num_cpus=0),  # no timeout sees it finish
        "guess": create_env("test_guess", num_cpus=0),
    }  # a timeout generous for the quick actor's steps on a loaded machine
    try:
        final, _ = _run(tiny_tokenizer, envs, env_step_timeout_s=5.0)
    finally:
        ray_session.kill(envs["calc"])  # its step sleeps on: cancelling does not stop a sleep
    timed_out = "env calc.step timed out after 5.0 s; its actor was killed for Ray to restart"
    assert final["env_error"][1].startswith(timed_out)
    assert final["total_reward"][0].item() == 1.0


def test_actor_start_up_is_timed_apart_from_its_steps(ray_session, tiny_tokenizer):
    policy = ScriptedGeneration(tiny_tokenizer, scripted_respond)
    batch = make_batch(tiny_tokenizer, [guess_sample(37), guess_sample(50)])
    # margins for a loaded machine: start-up (10 s) twice the step timeout (5 s), which is
    # generous for three quick steps
    env = create_env("test_slow_start", 10.0, num_cpus=0)  # its constructor sleeps 10 s
    final, metrics = run_multi_turn_rollout(
        policy, batch, tiny_tokenizer, {"guess": env}, 512, env_step_timeout_s=5.0
    )
    assert final["env_error"] == [None, None]  # start-up never counts against the timeout
    assert final["num_turns"].tolist() == [3, 1]
    assert metrics["timing/env_startup_s"] >= 5.0  # most of the 10 s sleep, waited on once
    assert metrics["timing/env_step_s"] < 5.0  # three quick steps, no start-up in them


@pytest.mark.slow
def test_reward_model_actor_uses_one_torch_thread_per_reserved_cpu(ray_session, tmp_path):
    from tests.fixtures.tiny_reward_model import save_tiny_reward_model

    folder = save_tiny_reward_model(tmp_path / "rm")
    config = {"model_name": str(folder), "precision": "float32", "resources": {"num_cpus": 2}}
    env = create_env("reward_model", config)  # 2 CPUs: Ray's OMP default would be 2 as well
    lean = create_env("reward_model", {**config, "resources": {"num_cpus": 0}})
    try:
        threads = [e.__ray_call__.remote(lambda _: torch.get_num_threads()) for e in (env, lean)]
        assert ray_session.get(threads, timeout=300) == [2, 1]
    finally:
        for actor in (env, lean):
            ray_session.kill(actor)


def test_dead_actor_is_restarted_and_the_step_retried(ray_session, tiny_tokenizer, tmp_path):
    env = create_env("test_die_once", str(tmp_path / "died"), num_cpus=0)
    final, metrics = _run(tiny_tokenizer, {"echo": env}, samples=[{"task": "echo", "prompt": "hi"}])
    assert (tmp_path / "died").exists()
    assert final["env_error"] == [None]
    assert final["total_reward"].tolist() == [0.5]
    assert metrics["env_error_rate"] == 0.0


def test_init_ray_is_safe_to_call_twice(ray_session):
    init_ray(num_cpus=2)
    init_ray()
    assert ray_session.is_initialized()
