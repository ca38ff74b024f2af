"""run_async_multi_turn_rollout called as NeMo-RL's function is (unpacked from synchronous
code), awaited inside an event loop, or handed to asyncio.run: the same results each way."""

from __future__ import annotations

import asyncio

import pytest

from envloop.experience.rollouts import run_async_multi_turn_rollout, run_multi_turn_rollout
from envloop.models.generation.scripted_generation import ScriptedGeneration
from tests.fixtures.batches import guess_sample, make_batch, scripted_respond
from tests.fixtures.envs import GuessNumberEnv


def rollout_args(tokenizer):
    policy = ScriptedGeneration(tokenizer, scripted_respond)
    batch = make_batch(tokenizer, [guess_sample(25), guess_sample(99)])
    return policy, batch, tokenizer, {"guess": GuessNumberEnv()}, 512


def turns_and_rewards(final):
    return final["num_turns"].tolist(), final["total_reward"].tolist()


def test_the_published_synchronous_call_returns_the_batch_and_metrics(tiny_tokenizer):
    final, metrics = run_async_multi_turn_rollout(*rollout_args(tiny_tokenizer))
    expected, expected_metrics = run_multi_turn_rollout(*rollout_args(tiny_tokenizer))
    assert turns_and_rewards(final) == turns_and_rewards(expected) == ([2, 6], [1.0, 1.0])
    assert metrics["total_turns"] == expected_metrics["total_turns"] == 8


def test_awaited_or_run_by_asyncio_it_gives_the_same(tiny_tokenizer):
    async def awaited():
        return await run_async_multi_turn_rollout(*rollout_args(tiny_tokenizer))

    for final, _ in (
        asyncio.run(awaited()),
        asyncio.run(run_async_multi_turn_rollout(*rollout_args(tiny_tokenizer))),
    ):
        assert turns_and_rewards(final) == ([2, 6], [1.0, 1.0])


def test_unpacked_inside_a_running_loop_it_says_to_await(tiny_tokenizer):
    async def unpacked():
        _final, _metrics = run_async_multi_turn_rollout(*rollout_args(tiny_tokenizer))

    with pytest.raises(RuntimeError, match="inside a running event loop.*await"):
        asyncio.run(unpacked())


def test_bad_options_fail_when_the_call_is_made(tiny_tokenizer):
    with pytest.raises(ValueError, match="max_concurrent_samples"):
        run_async_multi_turn_rollout(*rollout_args(tiny_tokenizer), max_concurrent_samples=0)
