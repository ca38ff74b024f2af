"""run_async_multi_turn_rollout_groups, the published group-by-group call: each prompt
group's final rows and its own metrics, on a real scripted policy and environment."""

from __future__ import annotations

import asyncio

import pytest
import torch

from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.experience.rollouts import run_async_multi_turn_rollout_groups, run_multi_turn_rollout
from envloop.models.generation.scripted_generation import ScriptedGeneration
from tests.fixtures.batches import guess_sample, make_batch, scripted_respond
from tests.fixtures.envs import GuessNumberEnv

SECRETS = [25, 99, 50]  # 2, 6 and 1 turns


def _args(tokenizer):
    batch = make_batch(tokenizer, [guess_sample(s) for s in SECRETS]).repeat_interleave(2)
    policy = ScriptedGeneration(tokenizer, scripted_respond)
    return policy, batch, tokenizer, {"guess": GuessNumberEnv()}, 512


def _collect(tokenizer, **kwargs):
    async def run():
        return [
            group
            async for group in run_async_multi_turn_rollout_groups(
                *_args(tokenizer), num_generations=2, **kwargs
            )
        ]

    return asyncio.run(run())


def test_groups_come_in_input_order_and_join_to_the_whole_rollout(tiny_tokenizer):
    groups = _collect(tiny_tokenizer, deduplicate_multimodal_data=True)
    whole, metrics = run_multi_turn_rollout(*_args(tiny_tokenizer))
    assert [g.group_index for g in groups] == [0, 1, 2]
    assert [g.task_index for g in groups] == [None, None, None]
    joined = BatchedDataDict.from_batches([g.final_batch for g in groups])
    for key in ("num_turns", "total_reward"):
        assert torch.equal(joined[key], whole[key])
    assert joined["loss_multiplier"] == whole["loss_multiplier"]
    assert joined["idx"] == whole["idx"] == [0, 0, 1, 1, 2, 2]
    assert [g.rollout_metrics["total_turns"] for g in groups] == [4, 12, 2]
    assert sum(g.rollout_metrics["total_turns"] for g in groups) == metrics["total_turns"]
    for key in ("avg_turns_per_sample", "natural_termination_rate", "mean_gen_tokens_per_sample"):
        mean = sum(g.rollout_metrics[key] for g in groups) / len(groups)
        assert mean == pytest.approx(metrics[key])
    assert [g.rollout_metrics["mean_total_reward"] for g in groups] == [1.0, 1.0, 1.0]


def test_in_completion_order_every_group_comes_once_with_its_own_rows(tiny_tokenizer):
    groups = _collect(tiny_tokenizer, completion_order=True)
    assert sorted(g.group_index for g in groups) == [0, 1, 2]
    for g in groups:
        assert g.final_batch["idx"] == [g.group_index] * 2
        assert g.final_batch["num_turns"].tolist() == [[2, 6, 1][g.group_index]] * 2


@pytest.mark.parametrize(
    ("num_generations", "message"),
    [(0, "num_generations must be greater than zero, got 0"), (4, "6 samples, num_generations=4")],
)
def test_a_group_size_that_does_not_divide_the_batch_is_refused(
    tiny_tokenizer, num_generations, message
):
    async def run():
        async for _ in run_async_multi_turn_rollout_groups(
            *_args(tiny_tokenizer), num_generations=num_generations
        ):
            pass

    with pytest.raises(ValueError, match=message):
        asyncio.run(run())
