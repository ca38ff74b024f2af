"""GRPO advantages for the final batch of ``run_agent_rollouts``, whose rows are segments:
a sample whose agent rewrote its history has several rows, so the engines' layout (group
g = rows ``g*group_size`` to ``(g+1)*group_size - 1``) holds for its samples, not its rows.
"""

from __future__ import annotations

from typing import Any

import torch

from envloop.algorithms.grpo import group_advantages
from envloop.distributed.batched_data_dict import BatchedDataDict

__all__ = ["segment_advantages"]


def segment_advantages(
    final_batch: BatchedDataDict[Any], group_size: int, **options: Any
) -> torch.Tensor:
    """[B'] advantages, one per row: :func:`~envloop.algorithms.grpo.group_advantages` of
    the B samples (each sample's ``total_reward`` and ``loss_multiplier``, which all its rows
    share; samples grouped as the input rows were), each row given its sample's.
    ``options`` are those of ``group_advantages`` (``normalize_std``, ``leave_one_out``,
    ``epsilon``).

    >>> final = BatchedDataDict(agent_sample_index=torch.tensor([0, 1, 1, 2, 3]),
    ...                         total_reward=torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0]))
    >>> segment_advantages(final, 2, epsilon=0.0).tolist()
    [0.7071067690849304, -0.7071067690849304, -0.7071067690849304, 0.0, 0.0]
    """
    index = final_batch["agent_sample_index"].long()
    samples = int(index.max()) + 1 if len(index) else 0
    rows = torch.arange(len(index))
    none = len(index)  # each sample's first row; none: it has no row
    first = torch.full((samples,), none, dtype=torch.long).scatter_reduce(0, index, rows, "amin")
    if (first == none).any():
        missing = (first == none).nonzero().flatten().tolist()[:5]
        raise ValueError(
            f"agent_sample_index names no row for sample(s) {missing}; pass the whole final "
            "batch of run_agent_rollouts."
        )
    multiplier = final_batch.get("loss_multiplier")
    valid = None if multiplier is None else torch.as_tensor(multiplier, dtype=torch.float32)
    advantages = group_advantages(
        final_batch["total_reward"][first], group_size,
        valid=None if valid is None else valid[first], **options,
    )  # fmt: skip
    return advantages[index]
