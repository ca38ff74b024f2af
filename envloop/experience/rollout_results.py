"""The final batch of a rollout: the input batch with each sample's trajectory, rewards and
outcome (what ``run_multi_turn_rollout`` and the async engine return)."""

from __future__ import annotations

from typing import Any

import torch

from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.experience.rollout_state import RolloutState

__all__ = ["final_rows"]


def final_rows(
    input_batch: BatchedDataDict[Any], state: RolloutState, indices: list[int] | None = None
) -> BatchedDataDict[Any]:
    """The final batch (see :func:`run_multi_turn_rollout`) at ``indices`` (None: every
    sample, in input order); ``input_batch`` is not mutated."""
    if indices is None:
        final, idx = input_batch.copy(), list(range(state.size))
    else:
        final, idx = input_batch.select_indices(indices), list(indices)
    index = torch.tensor(idx, dtype=torch.long)
    failed = state.failed[index] | state.generation_failed[index]
    given = final.get("loss_multiplier")
    final["message_log"] = [state.message_logs[i] for i in idx]
    final["extra_env_info"] = [state.metadata[i] for i in idx]
    final["loss_multiplier"] = _loss_multiplier(given, failed)
    final["total_reward"] = state.total_reward[index]
    final["truncated"] = state.truncated[index]
    final["terminated"] = state.terminated[index]
    final["num_turns"] = state.turns[index]
    final["turn_rewards"] = [state.turn_rewards[i] for i in idx]
    final["env_error"] = [state.errors[i] for i in idx]
    final["generation_error"] = [state.generation_errors[i] for i in idx]
    for name, totals in state.components.items():
        final[name] = totals[index]
    final["reward_components"] = [sorted(state.component_names[i]) for i in idx]
    return final


def _loss_multiplier(given: Any, failed: torch.Tensor) -> Any:
    if given is None:
        return (~failed).float()
    if isinstance(given, torch.Tensor):
        return torch.where(failed, torch.zeros_like(given), given)
    return [0.0 if f else m for m, f in zip(given, failed.tolist())]
