"""GRPO building blocks on envloop's rollouts: group advantages, DAPO's dynamic sampling and
overlong penalty, and the training batch a policy-gradient step takes.

A rollout of G prompts with ``group_size`` generations each lays its B = G * group_size rows
out group by group, as ``BatchedDataDict.repeat_interleave`` and ``RolloutStream.groups``
do: group g is rows ``g * group_size`` to ``(g + 1) * group_size - 1``. A row with
``loss_multiplier`` 0 (its environment or generation failed) is a member of its group that
takes part in nothing. Torch only; no trainer framework.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from envloop.algorithms.utils import baseline_and_std_by_group
from envloop.data.interfaces import LLMMessageLogType
from envloop.data.llm_message_utils import batched_message_log_to_flat_message
from envloop.data.multimodal_utils import PackedTensor
from envloop.distributed.batched_data_dict import BatchedDataDict

__all__ = [
    "InformativeGroups",
    "add_grpo_token_loss_masks_and_generation_logprobs",
    "filter_informative_groups",
    "group_advantages",
    "overlong_penalty",
    "training_batch",
]


def add_grpo_token_loss_masks_and_generation_logprobs(
    message_logs: Sequence[LLMMessageLogType],
) -> None:
    """Mark each message's tokens trainable or not, in place, as NeMo-RL's GRPO does.

    An assistant message that carries ``generation_logprobs`` was generated in the rollout:
    its ``token_loss_mask`` is ``ones_like(token_ids)``. Every other message (prompts,
    observations, assistant turns that came with the prompt) gets
    ``zeros_like(token_ids)``. A message without ``generation_logprobs`` gains a float32
    zero tensor of its length, so the key flattens aligned with ``token_ids``; existing
    ``generation_logprobs`` are kept as they are.

    Args:
        message_logs: per sample, its tokenized message log (each message with ``role``
            and ``token_ids`` [T]).

    >>> log = [{"role": "user", "token_ids": torch.tensor([5, 6])},
    ...        {"role": "assistant", "token_ids": torch.tensor([7]),
    ...         "generation_logprobs": torch.tensor([-0.5])}]
    >>> add_grpo_token_loss_masks_and_generation_logprobs([log])
    >>> [m["token_loss_mask"].tolist() for m in log], log[0]["generation_logprobs"].tolist()
    ([[0, 0], [1]], [0.0, 0.0])
    """
    for sample, log in enumerate(message_logs):
        for position, message in enumerate(log):
            token_ids = message.get("token_ids")
            if not isinstance(token_ids, torch.Tensor):
                raise ValueError(
                    f"message {position} (role {message.get('role')!r}) of sample {sample} has "
                    f"no token_ids tensor; tokenize the log first (get_formatted_message_log)."
                )
            generated = message["role"] == "assistant" and "generation_logprobs" in message
            mask = torch.ones_like if generated else torch.zeros_like
            message["token_loss_mask"] = mask(token_ids)
            if "generation_logprobs" not in message:
                message["generation_logprobs"] = torch.zeros_like(token_ids, dtype=torch.float32)


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    valid: torch.Tensor | Sequence[float] | None = None,
    normalize_std: bool = True,
    leave_one_out: bool = False,
    epsilon: float = 1e-6,
) -> torch.Tensor:
    """GRPO's advantage of each sample: its reward less its group's baseline, over the
    group's std.

    Rows are laid out group by group (group g: rows ``g*group_size`` to
    ``(g+1)*group_size - 1``). Only valid members enter a group's statistics
    (:func:`~envloop.algorithms.utils.baseline_and_std_by_group`: baseline = mean of the
    valid rewards, or of the *other* valid members' with ``leave_one_out``; std = their
    unbiased std). With ``normalize_std`` the difference is divided by ``std + epsilon``
    where the std is above 0 and left as it is elsewhere (NeMo-RL's
    ``GRPOAdvantageEstimator``: "don't sharpen the ones with no variation"). The advantage
    is 0 for an invalid member, for every member of a group whose valid rewards are all
    equal, and for a group with fewer than two valid members (a singleton group included).

    Args:
        rewards: [B] float rewards (e.g. a final batch's ``total_reward``).
        group_size: generations per prompt; must divide B.
        valid: [B] 0/1 or bool, a tensor or a list (e.g. a final batch's
            ``loss_multiplier``); None: every row is valid.
        normalize_std: divide by the group's std.
        leave_one_out: RLOO's baseline (and std) over the other valid members.
        epsilon: added to the std before dividing.

    Returns:
        [B] advantages, dtype and device of ``rewards`` (float32 for integer rewards).

    >>> rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    >>> group_advantages(rewards, 4, epsilon=0.0).tolist()
    [1.5, -0.5, -0.5, -0.5, 0.0, 0.0, 0.0, 0.0]
    >>> group_advantages(rewards, 4, valid=torch.tensor([0, 1, 1, 1, 1, 1, 1, 1])).tolist()
    [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    """
    rewards, valid_rows = _checked_groups(rewards, group_size, valid)
    if epsilon < 0:
        raise ValueError(f"epsilon must be >= 0, got {epsilon}.")
    group_ids = torch.arange(len(rewards), device=rewards.device) // group_size
    baseline, std = baseline_and_std_by_group(group_ids, rewards, valid_rows, leave_one_out)
    advantages = rewards - baseline
    if normalize_std:
        advantages = torch.where(std > 0, advantages / (std + epsilon), advantages)
    informative = _informative(rewards, valid_rows, group_size).repeat_interleave(group_size)
    return torch.where(valid_rows & informative, advantages, 0.0)


class InformativeGroups(NamedTuple):
    """What :func:`filter_informative_groups` kept and how many groups it dropped."""

    batch: BatchedDataDict[Any]  # the kept groups' rows, in their order (all columns)
    dropped_groups: int


def filter_informative_groups(batch: BatchedDataDict[Any], group_size: int) -> InformativeGroups:
    """DAPO's dynamic sampling (https://arxiv.org/abs/2503.14476): the whole groups whose
    valid rewards are not all equal, i.e. those :func:`group_advantages` gives a nonzero
    advantage to.

    A group with fewer than two valid members is dropped as well. Reads the batch's
    ``total_reward`` [B] and, when present, ``loss_multiplier`` [B] (list or tensor; a row
    is valid when it is not 0). Works on a whole final batch and on one group
    (``group_size`` rows, e.g. a ``FinishedGroup.batch`` from ``ExperienceStream``): an
    uninformative group gives an empty batch (``size`` 0) and ``dropped_groups`` 1.

    Args:
        batch: rows laid out group by group, with ``total_reward``.
        group_size: rows per group; must divide the batch size.

    Returns:
        :class:`InformativeGroups`: ``batch`` (the kept rows, via ``select_indices``) and
        ``dropped_groups``.

    >>> batch = BatchedDataDict(total_reward=torch.tensor([1.0, 0.0, 1.0, 1.0]), idx=[0, 0, 1, 1],
    ...                         loss_multiplier=[1.0, 1.0, 1.0, 1.0])
    >>> kept = filter_informative_groups(batch, 2)
    >>> kept.batch["idx"], kept.dropped_groups
    ([0, 0], 1)
    """
    if "total_reward" not in batch:
        raise ValueError(
            f"filter_informative_groups reads the batch's total_reward column, which it lacks "
            f"(columns: {', '.join(sorted(batch)) or 'none'}); pass a final batch of a rollout."
        )
    valid = batch.get("loss_multiplier")
    rewards, valid_rows = _checked_groups(batch["total_reward"], group_size, valid)
    informative = _informative(rewards, valid_rows, group_size)
    rows = informative.repeat_interleave(group_size).nonzero().flatten().cpu()
    return InformativeGroups(batch.select_indices(rows), int((~informative).sum()))


def overlong_penalty(
    lengths: torch.Tensor | Sequence[int],
    max_len: int,
    buffer_len: int,
    penalty_factor: float = 1.0,
) -> torch.Tensor:
    """DAPO's soft overlong punishment, a reward to add to each sample's.

    0 for a length up to ``max_len - buffer_len``, then falling linearly to
    ``-penalty_factor`` at ``max_len``, and ``-penalty_factor`` beyond (verl's
    ``DAPORewardManager`` names the same knobs ``overlong_buffer.len`` and
    ``penalty_factor``).

    Args:
        lengths: [B] response lengths in tokens (e.g. the generated tokens of each sample).
        max_len: the longest response allowed.
        buffer_len: the width of the linear ramp, in (0, max_len].
        penalty_factor: the penalty at ``max_len``, >= 0.

    Returns:
        [B] float32 penalties (<= 0), on the device of ``lengths``.

    >>> overlong_penalty(torch.tensor([50, 80, 90, 100, 120]), max_len=100, buffer_len=20).tolist()
    [0.0, 0.0, -0.5, -1.0, -1.0]
    """
    if not 0 < buffer_len <= max_len:
        raise ValueError(
            f"buffer_len must be in (0, max_len] = (0, {max_len}], got {buffer_len}; it is the "
            f"number of tokens before max_len over which the penalty ramps up."
        )
    if penalty_factor < 0:
        raise ValueError(f"penalty_factor must be >= 0 (the penalty's size), got {penalty_factor}.")
    lengths = torch.as_tensor(lengths)
    over = (lengths.float() - (max_len - buffer_len)).clamp(min=0, max=buffer_len)
    return over * (-penalty_factor / buffer_len) + 0.0  # + 0.0: no -0.0 below the ramp


def training_batch(
    final_batch: BatchedDataDict[Any], advantages: torch.Tensor, pad_token_id: int
) -> BatchedDataDict[Any]:
    """The [B, L] tensors a policy-gradient step trains on, from a rollout's final batch.

    Each row is exactly the tokens the policy saw and produced: the sample's
    ``message_log`` concatenated (``batched_message_log_to_flat_message``), right-padded with
    ``pad_token_id``. Trainable tokens are those of the assistant messages the rollout
    generated (:func:`add_grpo_token_loss_masks_and_generation_logprobs`, applied to copies
    of the messages: ``final_batch`` is not changed) of the samples whose
    ``loss_multiplier`` is not 0; prompt, observation and pad tokens are not.
    Every per-token column is aligned with ``input_ids``: position t holds the value of
    token ``input_ids[:, t]``, so a trainer's logprobs must be aligned the same way (logits
    at t - 1 scoring the token at t; position 0 is never trainable).

    Columns:
        ``input_ids`` [B, L] int64; ``input_lengths`` [B] int32 (each row's tokens);
        ``token_loss_mask`` [B, L] int64, 1 at trainable tokens; ``generation_logprobs``
        [B, L] float32, the sampler's logprob of each generated token (0 elsewhere);
        ``advantages`` [B, L] float32, each sample's advantage at its trainable tokens and
        0 elsewhere; ``sample_mask`` [B] float32, the ``loss_multiplier`` (1 when absent;
        already folded into ``token_loss_mask``; NeMo-RL's loss multiplies by it again,
        which changes nothing); and, for vision-language policies, each vision input the
        messages carry (``pixel_values``, ``image_grid_thw``, ...) as a ``PackedTensor``
        with one item per sample.

    Args:
        final_batch: a final batch of ``run_multi_turn_rollout`` (or of any engine built on
            it), with ``message_log`` and, optionally, ``loss_multiplier``.
        advantages: [B] one advantage per sample (e.g. :func:`group_advantages`).
        pad_token_id: the tokenizer's pad id.

    >>> final = BatchedDataDict(message_log=[[
    ...     {"role": "user", "token_ids": torch.tensor([5, 6])},
    ...     {"role": "assistant", "token_ids": torch.tensor([7, 8]),
    ...      "generation_logprobs": torch.tensor([-0.5, -0.25])}]], loss_multiplier=[1.0])
    >>> train = training_batch(final, torch.tensor([2.0]), pad_token_id=0)
    >>> train["token_loss_mask"].tolist(), train["advantages"].tolist()
    ([[0, 0, 1, 1]], [[0.0, 0.0, 2.0, 2.0]])
    """
    logs = final_batch.get("message_log")
    if logs is None:
        raise ValueError(
            "training_batch needs the final batch's message_log column; pass the batch "
            "run_multi_turn_rollout returned."
        )
    size = len(logs)
    if not isinstance(advantages, torch.Tensor) or tuple(advantages.shape) != (size,):
        shape = tuple(advantages.shape) if isinstance(advantages, torch.Tensor) else advantages
        raise ValueError(
            f"advantages must be a [B] tensor with one advantage per sample (B = {size}), got "
            f"{shape}; group_advantages(final_batch['total_reward'], group_size) gives one."
        )
    copies = [[dict(message) for message in log] for log in logs]
    add_grpo_token_loss_masks_and_generation_logprobs(copies)
    flat, input_lengths = batched_message_log_to_flat_message(
        copies, pad_value_dict={"token_ids": pad_token_id}, deduplicate_multimodal_data=True
    )
    multiplier = final_batch.get("loss_multiplier")
    sample_mask = torch.ones(size) if multiplier is None else torch.as_tensor(multiplier)
    sample_mask = sample_mask.to(torch.float32).cpu()
    token_loss_mask = flat["token_loss_mask"] * (sample_mask != 0).long()[:, None]
    per_token = advantages.to(torch.float32).cpu()[:, None].expand_as(token_loss_mask)
    vision = {key: value for key, value in flat.items() if isinstance(value, PackedTensor)}
    return BatchedDataDict(
        input_ids=flat["token_ids"],
        input_lengths=input_lengths,
        token_loss_mask=token_loss_mask,
        generation_logprobs=flat["generation_logprobs"].to(torch.float32),
        advantages=torch.where(token_loss_mask != 0, per_token, 0.0),
        sample_mask=sample_mask,
        **vision,
    )


def _checked_groups(
    rewards: torch.Tensor, group_size: int, valid: torch.Tensor | Sequence[float] | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rewards`` as a float [B] tensor and ``valid`` as bool [B] on its device, once B is
    known to be a multiple of ``group_size``."""
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 1:
        raise ValueError(f"rewards must be a 1-D [B] tensor, got {rewards!r}.")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(
            f"group_size must be an int >= 1 (generations per prompt), got {group_size!r}."
        )
    size = rewards.shape[0]
    if size % group_size:
        raise ValueError(
            f"the batch has {size} rows, not a multiple of group_size={group_size}: pass the "
            f"whole groups of the rollout (rows laid out group by group), or the group_size "
            f"it was generated with."
        )
    if valid is None:
        return _float(rewards), torch.ones(size, dtype=torch.bool, device=rewards.device)
    valid = torch.as_tensor(valid)
    if tuple(valid.shape) != (size,):
        raise ValueError(
            f"valid must be [B] like rewards (B = {size}), got shape {tuple(valid.shape)}; "
            f"pass one entry per row (e.g. the batch's loss_multiplier)."
        )
    return _float(rewards), (valid != 0).to(rewards.device)


def _float(rewards: torch.Tensor) -> torch.Tensor:
    return rewards if rewards.is_floating_point() else rewards.float()


def _informative(rewards: torch.Tensor, valid: torch.Tensor, group_size: int) -> torch.Tensor:
    """[G] whether each group has two valid members with different rewards."""
    grouped, valid_grouped = rewards.view(-1, group_size), valid.view(-1, group_size)
    highest = torch.where(valid_grouped, grouped, -torch.inf).amax(dim=1)
    lowest = torch.where(valid_grouped, grouped, torch.inf).amin(dim=1)
    return highest > lowest
