"""envloop.algorithms.utils: NeMo-RL's per-prompt baseline (values worked out by hand) and
its import path for get_tokenizer."""

import math

import pytest
import torch

from envloop.algorithms.utils import (
    baseline_and_std_by_group,
    calculate_baseline_and_std_per_prompt,
)
from envloop.models import tokenizers


def test_get_tokenizer_imports_from_nemo_rls_path(tmp_path):
    from envloop.algorithms.utils import TokenizerConfig, get_tokenizer

    assert get_tokenizer is tokenizers.get_tokenizer
    assert TokenizerConfig is tokenizers.TokenizerConfig
    tokenizer = get_tokenizer({"name": "bundled:policy", "chat_template": None})
    text = tokenizer.apply_chat_template([{"role": "user", "content": "2+2?"}], tokenize=False)
    assert text == "2+2?"


ONE_PROMPT = torch.tensor([[3, 1]] * 4)


def stats(prompts, rewards, valid, leave_one_out, std_rewards=None):
    baseline, std = calculate_baseline_and_std_per_prompt(
        prompts, torch.tensor(rewards), torch.tensor(valid), leave_one_out, std_rewards
    )
    return baseline.tolist(), std.tolist()


def test_mean_and_unbiased_std_over_the_group():
    baseline, std = stats(ONE_PROMPT, [1.0, 2.0, 3.0, 6.0], [1, 1, 1, 1], False)
    # mean 3; squared deviations 4 + 1 + 0 + 9 = 14 over n - 1 = 3
    assert baseline == [3.0] * 4
    assert std == pytest.approx([math.sqrt(14 / 3)] * 4, rel=1e-6)


def test_leave_one_out_uses_the_other_members():
    baseline, std = stats(ONE_PROMPT, [1.0, 2.0, 3.0, 6.0], [1, 1, 1, 1], True)
    # row 0: others {2, 3, 6}, mean 11/3, deviations -5/3 -2/3 7/3: (25 + 4 + 49) / 9 / 2
    # row 1: {1, 3, 6}: 10/3, (49 + 1 + 64) / 9 / 2; row 2: {1, 2, 6}: 3, 14 / 2; row 3: {1, 2, 3}
    assert baseline == pytest.approx([11 / 3, 10 / 3, 3.0, 2.0], rel=1e-6)
    assert std == pytest.approx([math.sqrt(39 / 9), math.sqrt(57 / 9), math.sqrt(7), 1.0], rel=1e-6)


def test_invalid_members_stay_out_of_the_statistics():
    rewards, valid = [1.0, 2.0, 9.0, 3.0], [1, 1, 0, 1]
    baseline, std = stats(ONE_PROMPT, rewards, valid, False)
    assert baseline == [2.0] * 4  # the 9 is not counted, for any member
    assert std == pytest.approx([1.0] * 4)
    baseline, std = stats(ONE_PROMPT, rewards, valid, True)
    # valid rows: the other two valid rewards; the invalid row: all three over n - 1 = 2
    assert baseline == [2.5, 2.0, 3.0, 1.5]
    # {2, 3} and {1, 3} and {1, 2}; the invalid row: (14/2 - 3**2) * 2 < 0 -> 0
    assert std == pytest.approx([math.sqrt(0.5), math.sqrt(2), 0.0, math.sqrt(0.5)], rel=1e-6)


def test_singleton_groups_and_groups_with_one_valid_member_keep_their_reward():
    prompts = torch.tensor([[1], [2], [2], [2]])
    for leave_one_out in (True, False):
        baseline, std = stats(prompts, [4.0, 1.0, 2.0, 3.0], [1, 0, 1, 0], leave_one_out)
        assert baseline == [4.0, 1.0, 2.0, 3.0]
        assert std == [0.0] * 4


def test_leave_one_out_with_two_valid_members_has_zero_std():
    baseline, std = stats(ONE_PROMPT[:2], [1.0, 5.0], [1, 1], True)
    assert baseline == [5.0, 1.0] and std == [0.0, 0.0]


def test_groups_are_found_by_prompt_anywhere_in_the_batch():
    prompts = torch.tensor([[1, 2], [3, 4], [1, 2], [3, 4], [3, 4]])
    baseline, std = stats(prompts, [1.0, 0.0, 3.0, 6.0, 3.0], [1, 1, 1, 1, 1], False)
    assert baseline == [2.0, 3.0, 2.0, 3.0, 3.0]
    assert std == pytest.approx([math.sqrt(2), 3.0, math.sqrt(2), 3.0, 3.0], rel=1e-6)


def test_std_rewards_give_the_std_and_rewards_the_baseline():
    baseline, std = stats(
        ONE_PROMPT[:3], [1.0, 2.0, 3.0], [1, 1, 1], False, std_rewards=torch.tensor([0.0, 0, 3])
    )
    assert baseline == [2.0] * 3
    assert std == pytest.approx([math.sqrt(3)] * 3, rel=1e-6)  # {0, 0, 3}: mean 1, (1+1+4)/2


def test_random_groups_match_a_direct_per_member_evaluation():
    generator = torch.Generator().manual_seed(3)
    group_ids = torch.randint(0, 5, (40,), generator=generator)
    rewards = torch.randn(40, generator=generator, dtype=torch.float64)
    valid = torch.rand(40, generator=generator) < 0.8
    for leave_one_out in (True, False):
        baseline, std = baseline_and_std_by_group(group_ids, rewards, valid, leave_one_out)
        for i in range(40):
            others = (group_ids == group_ids[i]) & valid
            if leave_one_out:
                others[i] = False
            counted = rewards[others]
            if int(((group_ids == group_ids[i]) & valid).sum()) <= 1:
                assert (baseline[i], std[i]) == (rewards[i], 0.0)
            elif not valid[i] and leave_one_out:
                continue  # NeMo-RL's formula for an invalid member: see the test above
            else:
                assert baseline[i].item() == pytest.approx(counted.mean().item(), rel=1e-9)
                expected = counted.std().item() if len(counted) > 1 else 0.0
                assert std[i].item() == pytest.approx(expected, rel=1e-7, abs=1e-12)


def test_outputs_follow_the_rewards_dtype_and_integer_rewards_become_float():
    baseline, std = calculate_baseline_and_std_per_prompt(
        ONE_PROMPT[:2], torch.tensor([1, 3]), torch.ones(2), False
    )
    assert baseline.dtype == std.dtype == torch.float32 and baseline.tolist() == [2.0, 2.0]


def test_shape_errors_name_the_input():
    with pytest.raises(ValueError, match=r"prompts must be \[B, S\]"):
        calculate_baseline_and_std_per_prompt(torch.tensor([1, 2]), torch.ones(2), torch.ones(2))
    with pytest.raises(ValueError, match="valid_mask must be"):
        calculate_baseline_and_std_per_prompt(ONE_PROMPT[:2], torch.ones(2), torch.ones(3))
