"""The final batch of a rollout: the input batch with each sample's trajectory, rewards and
outcome (what ``run_multi_turn_rollout`` and the async engine return)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.experience.rollout_state import RolloutState

__all__ = ["final_rows", "grouped_slot_rows", "slot_rows"]


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
    return grouped_slot_rows([input_rows], state, [idx], own_components)[0]


def grouped_slot_rows(
    inputs: list[BatchedDataDict[Any]],
    state: RolloutState,
    groups: list[list[int]],
    own_components: bool = False,
) -> list[BatchedDataDict[Any]]:
    """:func:`slot_rows` of each group of slots (``groups[k]``, whose input rows are
    ``inputs[k]``), the state's columns read once for all of them: the cost of finishing
    many groups together is about that of one. With ``own_components``, each group's
    component columns are those its own samples reported."""
    flat = [i for group in groups for i in group]
    rows = np.asarray(flat, dtype=np.int64)
    sizes = [len(group) for group in groups]

    def taken(column: torch.Tensor) -> list[torch.Tensor]:
        # Indexed through numpy (a copy of the rows in a µs or two, not a torch call's ten),
        # then split into a view per group in one call.
        return list(torch.from_numpy(column.numpy()[rows]).split(sizes))

    def listed(column: list[Any]) -> list[list[Any]]:
        return [[column[i] for i in group] for group in groups]

    failed_rows = (state.failed | state.generation_failed).numpy()[rows]
    failed = list(torch.from_numpy(failed_rows).split(sizes))
    kept = list(torch.from_numpy((~failed_rows).astype(np.float32)).split(sizes))
    logs, metadata = listed(state.message_logs), listed(state.metadata)
    columns: dict[str, list[Any]] = {
        "total_reward": taken(state.total_reward),
        "truncated": taken(state.truncated),
        "terminated": taken(state.terminated),
        "num_turns": taken(state.turns),
        "turn_rewards": listed(state.turn_rewards),
        "env_error": listed(state.errors),
        "generation_error": listed(state.generation_errors),
    }
    components = {name: taken(totals) for name, totals in state.components.items()}
    names = listed(state.component_names)
    low, high = taken(state.min_version), taken(state.max_version)
    out = []
    for k, final in enumerate(inputs):
        given = final.get("loss_multiplier")
        final["message_log"] = logs[k]
        final["extra_env_info"] = metadata[k]
        final["loss_multiplier"] = kept[k] if given is None else _loss_multiplier(given, failed[k])
        for key, values in columns.items():
            final[key] = values[k]
        reported = set().union(*names[k]) if own_components else None
        for name, values in components.items():
            if reported is None or name in reported:
                final[name] = values[k]
        final["reward_components"] = [sorted(sample_names) for sample_names in names[k]]
        final["min_policy_version"] = low[k]
        final["max_policy_version"] = high[k]
        out.append(final)
    return out


def _loss_multiplier(given: Any, failed: torch.Tensor) -> Any:
    if isinstance(given, torch.Tensor):
        return torch.where(failed, torch.zeros_like(given), given)
    return [0.0 if f else m for m, f in zip(given, failed.tolist())]
