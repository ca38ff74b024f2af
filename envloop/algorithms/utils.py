"""``nemo_rl.algorithms.utils`` at the same path, for code ported from NeMo-RL
(``from nemo_rl.algorithms.utils import ...`` becomes ``from envloop.algorithms.utils import
...``): the per-prompt reward baseline of GRPO/RLOO and the tokenizer helper.

``get_tokenizer`` and ``TokenizerConfig`` live in :mod:`envloop.models.tokenizers`; new code
can import them from there.

>>> from envloop.models import tokenizers
>>> get_tokenizer is tokenizers.get_tokenizer and TokenizerConfig is tokenizers.TokenizerConfig
True
"""

from __future__ import annotations

import torch

from envloop.models.tokenizers import TokenizerConfig, get_tokenizer

__all__ = [
    "TokenizerConfig",
    "baseline_and_std_by_group",
    "calculate_baseline_and_std_per_prompt",
    "get_tokenizer",
]


def calculate_baseline_and_std_per_prompt(
    prompts: torch.Tensor,
    rewards: torch.Tensor,
    valid_mask: torch.Tensor,
    leave_one_out_baseline: bool = True,
    std_rewards: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample's reward baseline and reward std over the samples of the same prompt,
    with NeMo-RL's semantics.

    Rows whose ``prompts`` rows are equal form a group (anywhere in the batch). Only members
    with ``valid_mask`` 1 enter a group's statistics; the std is the unbiased (n - 1) one.
    See :func:`baseline_and_std_by_group` for the rules, edge cases included.

    Args:
        prompts: [B, S] the prompt tokens of each sample (any device; equal rows = one group).
        rewards: [B] float rewards.
        valid_mask: [B] 0/1 (or bool): 0 leaves a sample out of every statistic.
        leave_one_out_baseline: a sample's baseline and std are over the *other* valid
            members of its group (RLOO, https://arxiv.org/abs/2402.14740).
        std_rewards: [B] optional rewards that only the std is computed from (default
            ``rewards``); NeMo-RL's DAPO uses the raw task reward here.

    Returns:
        ``(baseline, std)``, each [B], with the dtype and device of ``rewards``.

    >>> prompts = torch.tensor([[7, 7], [7, 7], [7, 7], [9, 9]])
    >>> rewards = torch.tensor([1.0, 0.0, 2.0, 5.0])
    >>> baseline, std = calculate_baseline_and_std_per_prompt(prompts, rewards, torch.ones(4))
    >>> baseline.tolist(), std.tolist()  # leave-one-out; the lone 4th sample keeps its reward
    ([1.0, 1.5, 0.5, 5.0], [1.4142135381698608, 0.7071067690849304, 0.7071067690849304, 0.0])
    """
    rewards = _float_rewards("rewards", rewards)
    if prompts.dim() != 2 or prompts.shape[0] != rewards.shape[0]:
        raise ValueError(
            f"prompts must be [B, S] with B = len(rewards) = {rewards.shape[0]}, got shape "
            f"{tuple(prompts.shape)}; pad the prompts' token ids into one [B, S] tensor "
            f"(batched_message_log_to_flat_message does)."
        )
    _, group_ids = torch.unique(prompts, dim=0, return_inverse=True)
    return baseline_and_std_by_group(
        group_ids.to(rewards.device), rewards, valid_mask, leave_one_out_baseline, std_rewards
    )


def baseline_and_std_by_group(
    group_ids: torch.Tensor,
    rewards: torch.Tensor,
    valid_mask: torch.Tensor,
    leave_one_out_baseline: bool = True,
    std_rewards: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample's baseline and std over the valid members of its group, where groups
    are given by id (as :func:`calculate_baseline_and_std_per_prompt` finds them).

    With n the group's valid members and m = n - 1 under leave-one-out (else m = n):

    - baseline = (sum of the valid rewards counted) / m, where leave-one-out leaves the
      sample's own reward out of the sum; an *invalid* member's sum holds all n valid
      rewards but is still divided by m (NeMo-RL's formula, kept: its baseline is
      never trained on).
    - std = sqrt((mean of squares - square of mean) * m / (m - 1)), over the same sums
      (the unbiased std of the rewards counted, for a valid member); 0 where m <= 1, and 0
      where rounding makes the variance negative.
    - a group with at most one valid member: baseline = the sample's own reward, std = 0,
      so ``rewards - baseline`` is 0 for all its members (a singleton group included).

    NeMo-RL computes the same with a per-group matrix product; the only difference is for
    an invalid member of a leave-one-out group with two valid members, where m = 1 and
    NeMo-RL's 0 * inf or x * inf can give nan (then 0) or the largest float: here 0.

    Args:
        group_ids: [B] integer group of each sample (any non-negative ids).
        rewards: [B] float rewards.
        valid_mask: [B] 0/1 (or bool).
        leave_one_out_baseline: statistics over the other valid members of the group.
        std_rewards: [B] optional rewards the std alone is computed from.

    Returns:
        ``(baseline, std)``, each [B], dtype and device of ``rewards``.

    >>> ids = torch.tensor([0, 0, 0, 1, 1])
    >>> rewards = torch.tensor([1.0, 2.0, 6.0, 4.0, 4.0])
    >>> valid = torch.tensor([1, 1, 0, 1, 1])
    >>> baseline, std = baseline_and_std_by_group(ids, rewards, valid, False)
    >>> baseline.tolist()
    [1.5, 1.5, 1.5, 4.0, 4.0]
    >>> [round(s, 4) for s in std.tolist()]  # std of {1, 2}: sqrt(0.5)
    [0.7071, 0.7071, 0.7071, 0.0, 0.0]
    """
    rewards = _float_rewards("rewards", rewards)
    size = rewards.shape[0]
    std_rewards = rewards if std_rewards is None else _float_rewards("std_rewards", std_rewards)
    columns = {"group_ids": group_ids, "valid_mask": valid_mask, "std_rewards": std_rewards}
    for name, tensor in columns.items():
        if tuple(tensor.shape) != (size,):
            raise ValueError(
                f"{name} must be [B] like rewards (B = {size}), got shape {tuple(tensor.shape)}."
            )
    valid = (valid_mask != 0).to(rewards.device, rewards.dtype)
    std_rewards = std_rewards.to(rewards.device, rewards.dtype)
    ids = group_ids.to(rewards.device).long()
    groups = int(ids.max()) + 1 if size else 0

    def group_total(values: torch.Tensor) -> torch.Tensor:
        """Per sample, the sum of ``values`` over its group."""
        totals = torch.zeros(groups, dtype=rewards.dtype, device=rewards.device)
        return totals.index_add(0, ids, values)[ids]

    own = valid if leave_one_out_baseline else torch.zeros_like(valid)

    def counted_sum(values: torch.Tensor) -> torch.Tensor:
        """Per sample, the sum of ``values`` over its group's valid members (less its own
        under leave-one-out)."""
        return group_total(values * valid) - values * own

    valid_members = group_total(valid)
    counted = valid_members - int(leave_one_out_baseline)
    baseline = counted_sum(rewards) / counted
    std_mean = baseline if std_rewards is rewards else counted_sum(std_rewards) / counted
    variance = (counted_sum(std_rewards.square()) / counted - std_mean.square()) * (
        counted / (counted - 1)
    )
    std = torch.where(counted > 1, variance.clamp(min=0).sqrt(), 0.0).nan_to_num(0.0)
    few = valid_members <= 1
    return torch.where(few, rewards, baseline), torch.where(few, 0.0, std)


def _float_rewards(name: str, rewards: torch.Tensor) -> torch.Tensor:
    """``rewards`` as a floating [B] tensor (integer rewards become float32)."""
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 1:
        shape = (
            tuple(rewards.shape) if isinstance(rewards, torch.Tensor) else type(rewards).__name__
        )
        raise ValueError(f"{name} must be a 1-D [B] tensor, got {shape}.")
    return rewards if rewards.is_floating_point() else rewards.float()
