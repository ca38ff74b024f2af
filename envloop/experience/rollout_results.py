"""The final batch of a rollout: the input batch with each sample's trajectory, rewards and
outcome (what ``run_multi_turn_rollout`` and the async engine return)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.experience.rollout_state import RolloutState

__all__ = ["final_rows", "slot_rows"]


def final_rows(
    input_batch: BatchedDataDict[Any], state: RolloutState, indices: list[int] | None = None
) -> BatchedDataDict[Any]:
    """The final batch (see :func:`run_multi_turn_rollout`) at ``indices`` (None: every
    sample, in input order); ``input_batch`` is not mutated."""
    if indices is None:
        return slot_rows(input_batch.copy(), state, list(range(state.size)))
    return slot_rows(input_batch.select_indices(indices), state, list(indices))


def slot_rows(
    input_rows: BatchedDataDict[Any],
    state: RolloutState,
    idx: list[int],
    own_components: bool = False,
) -> BatchedDataDict[Any]:
    """The final rows of the samples in ``state``'s slots ``idx``, whose input rows are
    ``input_rows`` (in the same order; the dict is filled in and returned). A reward
    component column for every component the rollout's samples reported (0 where a sample
    did not), or with ``own_components`` only for those these samples reported (slots
    reused for sample after sample: a column never depends on who held the slots before)."""
    final = input_rows
    rows = np.asarray(idx, dtype=np.int64)

    def taken(column: torch.Tensor) -> torch.Tensor:
        # Indexed through numpy: a copy of the rows in a µs or two, not a torch call's ten.
        return torch.from_numpy(column.numpy()[rows])

    failed = taken(state.failed) | taken(state.generation_failed)
    given = final.get("loss_multiplier")
    final["message_log"] = [state.message_logs[i] for i in idx]
    final["extra_env_info"] = [state.metadata[i] for i in idx]
    final["loss_multiplier"] = _loss_multiplier(given, failed)
    final["total_reward"] = taken(state.total_reward)
    final["truncated"] = taken(state.truncated)
    final["terminated"] = taken(state.terminated)
    final["num_turns"] = taken(state.turns)
    final["turn_rewards"] = [state.turn_rewards[i] for i in idx]
    final["env_error"] = [state.errors[i] for i in idx]
    final["generation_error"] = [state.generation_errors[i] for i in idx]
    reported = set().union(*(state.component_names[i] for i in idx)) if own_components else None
    for name, totals in state.components.items():
        if reported is None or name in reported:
            final[name] = taken(totals)
    final["reward_components"] = [sorted(state.component_names[i]) for i in idx]
    final["min_policy_version"] = taken(state.min_version)
    final["max_policy_version"] = taken(state.max_version)
    return final


def _loss_multiplier(given: Any, failed: torch.Tensor) -> Any:
    if given is None:
        return (~failed).float()
    if isinstance(given, torch.Tensor):
        return torch.where(failed, torch.zeros_like(given), given)
    return [0.0 if f else m for m, f in zip(given, failed.tolist())]
