"""GRPO building blocks: advantages worked out by hand, DAPO's filter and penalty, and the
training batch of a real multi-turn rollout (scripted policy, in-process environments)."""

from __future__ import annotations

import math

import pytest
import torch

from envloop.algorithms.grpo import (
    add_grpo_token_loss_masks_and_generation_logprobs,
    filter_informative_groups,
    group_advantages,
    overlong_penalty,
    training_batch,
)
from envloop.data.multimodal_utils import PackedTensor
from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.experience.rollouts import run_multi_turn_rollout
from envloop.models.generation.scripted_generation import ScriptedGeneration
from tests.fixtures.batches import calc_sample, guess_sample, make_batch, scripted_respond
from tests.fixtures.envs import CalculatorEnv, FailingEnv, GuessNumberEnv

# Three groups of four: one informative, one all equal, one with a failed member (reward 9).
REWARDS = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 2.0, 4.0, 9.0, 0.0])
VALID = torch.tensor([1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 1])


def test_group_advantages_normalised_by_the_group_std():
    advantages = group_advantages(REWARDS, 4, valid=VALID, epsilon=0.0)
    # group 0: mean 1/4, std sqrt((9/16 + 3/16) / 3) = 1/2; group 2: {2, 4, 0}: mean 2, std 2
    expected = [1.5, -0.5, -0.5, -0.5, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0, -1.0]
    assert advantages.tolist() == pytest.approx(expected, rel=1e-6)


def test_group_advantages_without_std_and_with_epsilon():
    advantages = group_advantages(REWARDS, 4, valid=VALID, normalize_std=False)
    assert advantages.tolist() == [0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0, 0, 2, 0, -2]
    advantages = group_advantages(REWARDS[:4], 4, epsilon=0.5)
    assert advantages.tolist() == [0.75, -0.25, -0.25, -0.25]  # / (0.5 + 0.5)


def test_group_advantages_leave_one_out():
    advantages = group_advantages(REWARDS, 4, valid=VALID, leave_one_out=True, epsilon=0.0)
    # row 0: others {0, 0, 0}: baseline 0, std 0, so 1 - 0 is not divided (NeMo-RL)
    # rows 1-3: others {1, 0, 0}: baseline 1/3, std sqrt(1/3): -1/3 / sqrt(1/3) = -sqrt(1/3)
    # group 2: row 8 others {4, 0}: baseline 2, std sqrt(8): 0; row 9 {2, 0}: (4-1)/sqrt(2);
    # row 11 {2, 4}: (0 - 3) / sqrt(2)
    third = math.sqrt(1 / 3)
    expected = [1.0, -third, -third, -third, 0, 0, 0, 0, 0, 3 / math.sqrt(2), 0, -3 / math.sqrt(2)]
    assert advantages.tolist() == pytest.approx(expected, rel=1e-6)


def test_valid_may_be_a_list_like_an_input_batchs_loss_multiplier():
    as_list = group_advantages(REWARDS, 4, valid=VALID.float().tolist())
    assert as_list.tolist() == group_advantages(REWARDS, 4, valid=VALID).tolist()


def test_singletons_and_groups_with_one_valid_member_get_zero():
    assert group_advantages(torch.tensor([1.0, 5.0, -2.0]), 1).tolist() == [0.0, 0.0, 0.0]
    advantages = group_advantages(torch.tensor([1.0, 5.0]), 2, valid=torch.tensor([0, 1]))
    assert advantages.tolist() == [0.0, 0.0]


def test_identical_rewards_give_exactly_zero_despite_rounding():
    rewards = torch.full((3,), 0.1)  # the mean of three 0.1s is not exactly 0.1 in float32
    for leave_one_out in (True, False):
        advantages = group_advantages(rewards, 3, leave_one_out=leave_one_out)
        assert advantages.tolist() == [0.0, 0.0, 0.0]


def test_group_advantages_refuses_a_batch_that_is_not_whole_groups():
    with pytest.raises(ValueError, match=r"10 rows, not a multiple of group_size=4"):
        group_advantages(torch.zeros(10), 4)
    with pytest.raises(ValueError, match=r"valid must be \[B\]"):
        group_advantages(torch.zeros(8), 4, valid=torch.ones(4))
    with pytest.raises(ValueError, match="group_size must be an int >= 1"):
        group_advantages(torch.zeros(8), 0)


def rollout_like_batch(rewards, loss_multiplier) -> BatchedDataDict:
    n = len(rewards)
    return BatchedDataDict(
        total_reward=torch.tensor(rewards),
        loss_multiplier=loss_multiplier,
        idx=list(range(n)),
        message_log=[[{"role": "user", "content": str(i)}] for i in range(n)],
    )


def test_filter_keeps_whole_informative_groups():
    batch = rollout_like_batch(REWARDS.tolist(), VALID.float())
    kept = filter_informative_groups(batch, 4)
    assert kept.dropped_groups == 1
    assert kept.batch["idx"] == [0, 1, 2, 3, 8, 9, 10, 11]
    assert kept.batch["total_reward"].tolist() == REWARDS[[0, 1, 2, 3, 8, 9, 10, 11]].tolist()
    assert kept.batch["message_log"][4] == [{"role": "user", "content": "8"}]
    # The kept groups are exactly those with a nonzero advantage.
    advantages = group_advantages(REWARDS, 4, valid=VALID).view(3, 4)
    assert (advantages != 0).any(dim=1).tolist() == [True, False, True]


def test_filter_drops_a_group_whose_only_difference_is_a_failed_member():
    batch = rollout_like_batch([1.0, 1.0, 0.0], [1.0, 1.0, 0.0])  # a list, as in input rows
    kept = filter_informative_groups(batch, 3)
    assert kept.dropped_groups == 1 and kept.batch.size == 0 and kept.batch["idx"] == []


def test_filter_works_one_group_at_a_time():
    batch = rollout_like_batch(REWARDS.tolist(), VALID.float())
    results = [filter_informative_groups(batch.slice(g * 4, g * 4 + 4), 4) for g in range(3)]
    assert [r.dropped_groups for r in results] == [0, 1, 0]
    assert [r.batch.size for r in results] == [4, 0, 4]


def test_filter_names_a_missing_reward_column():
    with pytest.raises(ValueError, match="total_reward"):
        filter_informative_groups(BatchedDataDict(idx=[0, 1]), 2)


def test_overlong_penalty_in_its_three_regions():
    lengths = torch.tensor([0, 80, 85, 90, 100, 101, 500])
    assert overlong_penalty(lengths, max_len=100, buffer_len=20).tolist() == [
        0.0, 0.0, -0.25, -0.5, -1.0, -1.0, -1.0,
    ]  # fmt: skip
    assert overlong_penalty([90, 200], 100, 20, penalty_factor=0.5).tolist() == [-0.25, -0.5]
    assert overlong_penalty([0, 50, 100], 100, 100).tolist() == [0.0, -0.5, -1.0]


@pytest.mark.parametrize("buffer_len", [0, -5, 101])
def test_overlong_penalty_refuses_a_buffer_outside_its_range(buffer_len):
    with pytest.raises(ValueError, match=r"buffer_len must be in \(0, max_len\] = \(0, 100\]"):
        overlong_penalty(torch.tensor([1]), max_len=100, buffer_len=buffer_len)


def test_loss_masks_and_logprobs_are_added_as_published():
    generated = torch.tensor([-0.5, -0.25])
    log = [
        {"role": "system", "token_ids": torch.tensor([1])},
        {"role": "assistant", "token_ids": torch.tensor([2, 3])},  # from the dataset
        {"role": "assistant", "token_ids": torch.tensor([4, 5]), "generation_logprobs": generated},
        {
            "role": "tool",
            "token_ids": torch.tensor([6]),
            "generation_logprobs": torch.tensor([-9.0]),
        },
    ]
    add_grpo_token_loss_masks_and_generation_logprobs([log])
    assert [m["token_loss_mask"].tolist() for m in log] == [[0], [0, 0], [1, 1], [0]]
    assert all(m["token_loss_mask"].dtype == torch.long for m in log)
    logprobs = [m["generation_logprobs"] for m in log]
    assert [lp.tolist() for lp in logprobs] == [[0.0], [0.0, 0.0], [-0.5, -0.25], [-9.0]]
    assert logprobs[2] is generated and logprobs[0].dtype == torch.float32
    with pytest.raises(ValueError, match=r"message 0 \(role 'user'\) of sample 0 has no token_ids"):
        add_grpo_token_loss_masks_and_generation_logprobs([[{"role": "user", "content": "x"}]])


def multi_turn_rollout(tokenizer, logprob=-0.75):
    policy = ScriptedGeneration(tokenizer, scripted_respond, logprob=logprob)
    samples = [
        calc_sample("What is 12 * 7 + 1?", 85),  # three assistant turns, two tool results
        guess_sample(30),  # binary search: several turns
        calc_sample("What is 9 - 2?", 7),  # wrong, reward 0
        {**calc_sample("What is 3 + 4?", 7), "task": "broken"},  # the environment raises
    ]
    envs = {"calc": CalculatorEnv(), "guess": GuessNumberEnv(), "broken": FailingEnv()}
    final, _ = run_multi_turn_rollout(policy, make_batch(tokenizer, samples), tokenizer, envs, 512)
    return final


def per_token(log, value) -> torch.Tensor:
    """``value(message, its token count)`` of every message, concatenated."""
    return torch.cat([value(m, len(m["token_ids"])) for m in log])


def test_training_batch_of_a_real_multi_turn_rollout(tiny_tokenizer):
    final = multi_turn_rollout(tiny_tokenizer)
    logs_before = [[dict(m) for m in log] for log in final["message_log"]]
    advantages = torch.tensor([0.5, -1.0, 2.0, 3.0])
    train = training_batch(final, advantages, tiny_tokenizer.pad_token_id)
    assert final["loss_multiplier"][3] == 0.0  # the failed sample
    width = max(sum(len(m["token_ids"]) for m in log) for log in final["message_log"])
    assert train["input_ids"].shape == (4, width)
    for i, log in enumerate(final["message_log"]):
        tokens = torch.cat([m["token_ids"] for m in log])
        n = len(tokens)
        assert train["input_lengths"][i] == n
        assert train["input_ids"][i, :n].tolist() == tokens.tolist()  # exactly what it saw
        assert set(train["input_ids"][i, n:].tolist()) <= {tiny_tokenizer.pad_token_id}
        # Trainable: the assistant tokens, and nothing of the failed sample.
        assistant = per_token(log, lambda m, n: torch.full((n,), m["role"] == "assistant"))
        expected_mask = assistant & (final["loss_multiplier"][i] != 0)
        assert train["token_loss_mask"][i, :n].bool().tolist() == expected_mask.tolist()
        assert not train["token_loss_mask"][i, n:].any()
        turns = sum(m["role"] == "assistant" for m in log)
        assert turns == final["num_turns"][i] and turns >= (2 if i < 2 else 1)  # multi-turn
        # The sampler's logprobs sit on the assistant tokens, the advantage on trainable ones.
        logprobs = per_token(log, lambda m, n: m.get("generation_logprobs", torch.zeros(n)))
        assert train["generation_logprobs"][i, :n].tolist() == logprobs.tolist()
        assert logprobs[assistant].tolist() == [-0.75] * int(assistant.sum())
        assert train["advantages"][i].tolist() == (
            torch.where(train["token_loss_mask"][i].bool(), advantages[i], 0.0).tolist()
        )
    assert train["sample_mask"].tolist() == [1.0, 1.0, 1.0, 0.0]
    assert train["token_loss_mask"][3].sum() == 0 and train["advantages"][3].abs().sum() == 0
    assert [len(log) for log in final["message_log"]] == [len(log) for log in logs_before]
    for log, before in zip(final["message_log"], logs_before):  # the final batch is unchanged
        assert all("token_loss_mask" not in m and m.keys() == b.keys() for m, b in zip(log, before))


def test_training_batch_keeps_each_samples_images():
    pixels = torch.arange(12.0).view(2, 6)
    grid = torch.tensor([[1, 1, 2]])
    with_image = [
        {"role": "user", "token_ids": torch.tensor([1, 9, 9, 2]),
         "pixel_values": PackedTensor([pixels], dim_to_pack=0),
         "image_grid_thw": PackedTensor([grid], dim_to_pack=0)},
        {"role": "assistant", "token_ids": torch.tensor([3]),
         "generation_logprobs": torch.tensor([-1.0])},
    ]  # fmt: skip
    text_only = [
        {"role": "user", "token_ids": torch.tensor([4])},
        {"role": "assistant", "token_ids": torch.tensor([5, 6]),
         "generation_logprobs": torch.tensor([-2.0, -3.0])},
    ]  # fmt: skip
    final = BatchedDataDict(message_log=[with_image, text_only])
    train = training_batch(final, torch.tensor([1.0, -1.0]), pad_token_id=0)
    assert train["pixel_values"][0] is pixels and train["pixel_values"][1] is None
    assert train["image_grid_thw"][0].tolist() == [[1, 1, 2]]
    assert train["input_ids"].tolist() == [[1, 9, 9, 2, 3], [4, 5, 6, 0, 0]]
    assert train["advantages"].tolist() == [[0, 0, 0, 0, 1.0], [0, -1.0, -1.0, 0, 0]]
    assert train["sample_mask"].tolist() == [1.0, 1.0]  # no loss_multiplier: all trainable


def test_training_batch_aligns_shared_prompt_images_with_multi_image_samples():
    """Prompts repeated sharing their image (as build_rollout_batch does), beside a text
    prompt whose sample got two image observations: one row per sample, each image once."""

    def image(n: int) -> PackedTensor:
        return PackedTensor([torch.full((n, 6), float(n))], dim_to_pack=0)

    def reply() -> dict:
        return {"role": "assistant", "token_ids": torch.tensor([7]),
                "generation_logprobs": torch.tensor([-1.0])}  # fmt: skip

    prompts = BatchedDataDict(
        message_log=[
            [{"role": "user", "token_ids": torch.tensor([1]), "pixel_values": image(4)}],
            [{"role": "user", "token_ids": torch.tensor([2])}],
        ]
    )
    logs = prompts.repeat_interleave(2, share_immutable_media=True)["message_log"]
    for log in logs:
        log.append(reply())
    for n in (2, 3):
        logs[2] += [{"role": "user", "token_ids": torch.tensor([5]), "pixel_values": image(n)}]
        logs[2].append(reply())
    train = training_batch(BatchedDataDict(message_log=logs), torch.ones(4), pad_token_id=0)
    pixels = train["pixel_values"]
    assert pixels.logical_segment_counts_by_row() == [1, 1, 2, 0]
    assert len(pixels.tensors) == 3  # the prompt's image stored once for its two samples
    assert [None if row is None else row[:, 0].tolist() for row in pixels] == [
        [4.0] * 4,
        [4.0] * 4,
        [2.0, 2.0, 3.0, 3.0, 3.0],
        None,
    ]


def test_training_batch_refuses_advantages_of_the_wrong_shape(tiny_tokenizer):
    final = BatchedDataDict(message_log=[[{"role": "user", "token_ids": torch.tensor([1])}]])
    with pytest.raises(ValueError, match=r"advantages must be a \[B\] tensor .* \(B = 1\)"):
        training_batch(final, torch.zeros(1, 3), pad_token_id=0)
    with pytest.raises(ValueError, match="message_log"):
        training_batch(BatchedDataDict(idx=[0]), torch.zeros(1), pad_token_id=0)
