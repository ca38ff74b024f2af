"""envloop.environments.utils: NeMo-RL's module (one registry, create_env, chunking) and the
helpers environments share."""

from __future__ import annotations

import pytest

from envloop.environments import registry, utils
from envloop.environments.utils import chunk_list_to_workers, last_assistant_text


def test_utils_names_are_the_registry_itself():
    assert utils.ENV_REGISTRY is registry.ENV_REGISTRY
    assert utils.register_env is registry.register_env
    assert utils.EnvRegistryEntry is registry.EnvRegistryEntry
    assert utils.create_env is registry.create_env


def test_register_env_through_utils_is_seen_by_the_registry():
    utils.register_env("utils_echo", "tests.fixtures.envs.EchoEnv", overwrite=True)
    assert registry.get_env_class("utils_echo").__name__ == "EchoEnv"
    with pytest.raises(ValueError, match="Env name utils_echo already registered"):
        utils.register_env("utils_echo", "tests.fixtures.envs.FailingEnv")


@pytest.mark.parametrize(
    ("items", "workers", "chunks"),
    [
        (list(range(6)), 3, [[0, 1], [2, 3], [4, 5]]),
        (list(range(7)), 3, [[0, 1, 2], [3, 4, 5], [6]]),
        (list(range(5)), 4, [[0, 1], [2, 3], [4]]),  # ceil(5/4) = 2: three chunks
        (list(range(3)), 5, [[0], [1], [2], [], []]),
        (list(range(3)), 3, [[0], [1], [2]]),
        ([], 3, [[], [], []]),
        (["a", "b"], 1, [["a", "b"]]),
    ],
)
def test_chunk_list_to_workers(items, workers, chunks):
    assert chunk_list_to_workers(items, workers) == chunks
    assert [x for chunk in chunks for x in chunk] == items


def test_chunks_are_new_lists():
    items = [1, 2, 3, 4]
    for chunk in chunk_list_to_workers(items, 2):
        chunk.append(99)
    assert items == [1, 2, 3, 4]


@pytest.mark.parametrize("workers", [0, -1])
def test_chunking_needs_a_worker(workers):
    with pytest.raises(ValueError, match=f"num_workers must be >= 1, got {workers}"):
        chunk_list_to_workers([1, 2], workers)


def test_last_assistant_text():
    log = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "first"},
        {"role": "environment", "content": "try again"},
        {"role": "assistant", "content": "second"},
        {"role": "user", "content": "thanks"},
    ]
    assert last_assistant_text(log) == "second"
    assert last_assistant_text([{"role": "user", "content": "q"}]) == ""
    assert last_assistant_text([{"role": "assistant", "content": ["not", "text"]}]) == ""


@pytest.mark.ray
def test_create_env_takes_nemo_arguments_by_position_or_keyword(ray_session):
    env = utils.create_env("code_jaccard", {"num_workers": 2})
    log = [{"role": "assistant", "content": "return a + b"}]
    ret = ray_session.get(env.step.remote([log], [{"ground_truth": "x = a + b"}]))
    assert ret.rewards.tolist() == [0.375]  # NeMo-RL's score: 3 of 6 words, 9 of 12 characters
    ray_session.kill(env)
    named = utils.create_env(
        env_name="code_jaccard", env_config={"num_workers": 1}, name="utils_named_env"
    )
    assert ray_session.get_actor("utils_named_env")._actor_id == named._actor_id
    ray_session.kill(named)
    with pytest.raises(ValueError, match="No environment named 'code_jacard'.*'code_jaccard'"):
        utils.create_env("code_jacard", {})
