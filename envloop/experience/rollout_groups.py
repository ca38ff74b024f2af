"""``run_async_multi_turn_rollout_groups``: the published group-by-group rollout call, as an
adapter over :meth:`RolloutStream.groups <envloop.experience.async_rollouts.RolloutStream.groups>`.

NeMo-RL's function is an async generator yielding a ``RolloutGroupResult`` (``group_index``,
``final_batch``, ``rollout_metrics``, ``task_index``) per prompt group of
``num_generations`` consecutive samples, in input order, after the whole batch finished.
Here a group is yielded as soon as it and every group before it have finished (so never
later than there), or with ``completion_order=True`` as soon as it has finished itself.
``rollout_metrics`` are the group's own (see :func:`group_metrics`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import torch

from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.experience.async_rollouts import FinishedGroup, RolloutStream
from envloop.experience.rollout_state import RolloutState
from envloop.models.generation.interfaces import GenerationInterface

__all__ = ["RolloutGroupResult", "group_metrics", "run_async_multi_turn_rollout_groups"]


@dataclass
class RolloutGroupResult:
    """One prompt group's final rows and metrics.

    Attributes:
        group_index: the group's position in the input batch (rows
            ``group_index * num_generations`` onward).
        final_batch: the group's final rows (the columns ``run_multi_turn_rollout``
            returns), in input order.
        rollout_metrics: the group's metrics (:func:`group_metrics`).
        task_index: None (the published field names a NeMo-Gym prompt; not used here).
        min_policy_version: oldest policy version of a token the group generated (-1: none).
        max_policy_version: newest one (-1: none).
    """

    group_index: int
    final_batch: BatchedDataDict[Any]
    rollout_metrics: dict[str, Any]
    task_index: int | None = None
    min_policy_version: int = -1
    max_policy_version: int = -1


async def run_async_multi_turn_rollout_groups(
    policy_generation: GenerationInterface,
    input_batch: BatchedDataDict[Any],
    tokenizer: Any,
    task_to_env: dict[str, Any],
    max_seq_len: int,
    num_generations: int,
    max_rollout_turns: int = 999999,
    greedy: bool = False,
    deduplicate_multimodal_data: bool = False,
    *,
    completion_order: bool = False,
    **options: Any,
) -> AsyncIterator[RolloutGroupResult]:
    """Run ``input_batch`` (prompts repeated ``num_generations`` times in a row, as
    ``repeat_interleave`` lays them out) and yield each group's :class:`RolloutGroupResult`.

    Groups come in input order, each once it and all groups before it have finished; with
    ``completion_order=True``, each as soon as its last member finishes.
    ``deduplicate_multimodal_data`` and ``options`` are those of
    ``run_async_multi_turn_rollout`` (the policy is handed only the representation of each
    sample's images it reads).

    Raises ``ValueError`` if ``num_generations`` is not a positive divisor of the batch.

    >>> import inspect
    >>> inspect.isasyncgenfunction(run_async_multi_turn_rollout_groups)
    True
    """
    if not isinstance(num_generations, int) or num_generations < 1:
        raise ValueError(f"num_generations must be greater than zero, got {num_generations!r}.")
    if input_batch.size % num_generations:
        raise ValueError(
            f"Native rollout batch size must be divisible by num_generations: "
            f"{input_batch.size} samples, num_generations={num_generations}. Repeat each "
            "prompt num_generations times (BatchedDataDict.repeat_interleave)."
        )
    stream = RolloutStream(
        policy_generation, input_batch, tokenizer, task_to_env, max_seq_len,
        max_rollout_turns, greedy, deduplicate_multimodal_data=deduplicate_multimodal_data,
        **options,
    )  # fmt: skip
    waiting: dict[int, RolloutGroupResult] = {}
    next_index = 0
    async for finished in stream.groups(num_generations):
        result = _result(stream.state, finished, num_generations)
        if completion_order:
            yield result
            continue
        waiting[result.group_index] = result
        while next_index in waiting:
            yield waiting.pop(next_index)
            next_index += 1


def _result(state: RolloutState, group: FinishedGroup, size: int) -> RolloutGroupResult:
    return RolloutGroupResult(
        group_index=group.indices[0] // size,
        final_batch=group.batch,
        rollout_metrics=group_metrics(state, group.indices),
        min_policy_version=group.min_policy_version,
        max_policy_version=group.max_policy_version,
    )


def group_metrics(state: RolloutState, indices: list[int]) -> dict[str, float | int]:
    """The rollout metrics of the samples at ``indices`` (all finished): the per-sample
    metrics of ``run_multi_turn_rollout`` over those samples alone (timings are the whole
    rollout's and are left out), plus ``mean_total_reward``.

    The means over a batch's groups average to the batch's means (equal-sized groups);
    ``total_turns`` and ``total_generated_tokens`` add up to the batch's.
    """
    rows = torch.as_tensor(indices, dtype=torch.long)

    def mean(values: torch.Tensor) -> float:
        return float(values[rows].float().mean()) if len(rows) else 0.0

    turns = state.turns[rows]
    return {
        "total_turns": int(turns.sum()),
        "avg_turns_per_sample": mean(state.turns),
        "max_turns_per_sample": int(turns.max()) if len(rows) else 0,
        "natural_termination_rate": mean(state.terminated),
        "truncation_rate": mean(state.truncated),
        "max_turns_reached_rate": mean(~state.done),
        "env_error_rate": mean(state.failed),
        "generation_error_rate": mean(state.generation_failed),
        "mean_gen_tokens_per_sample": mean(state.gen_tokens),
        "mean_env_tokens_per_sample": mean(state.env_tokens),
        "mean_total_tokens_per_sample": mean(state.tokens.lengths),
        "total_generated_tokens": int(state.gen_tokens[rows].sum()),
        "mean_total_reward": mean(state.total_reward),
    }
