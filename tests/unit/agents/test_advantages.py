from __future__ import annotations

import pytest
import torch

from envloop.agents import segment_advantages
from envloop.algorithms.grpo import group_advantages
from envloop.distributed.batched_data_dict import BatchedDataDict


def test_samples_are_grouped_and_every_segment_row_gets_its_sample_s_advantage():
    final = BatchedDataDict(
        agent_sample_index=torch.tensor([0, 0, 0, 1, 2, 3, 3]),
        total_reward=torch.tensor([1.0, 1.0, 1.0, 0.0, 0.5, 0.25, 0.25]),
        loss_multiplier=[1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 1.0],
    )
    per_sample = group_advantages(
        torch.tensor([1.0, 0.0, 0.5, 0.25]), 2, valid=torch.tensor([1.0, 1.0, 0.0, 1.0])
    )
    expected = per_sample[[0, 0, 0, 1, 2, 3, 3]]
    assert segment_advantages(final, 2).tolist() == expected.tolist()
    assert segment_advantages(final, 2).tolist()[:4] == pytest.approx(
        [0.7071] * 3 + [-0.7071], abs=1e-4
    )


def test_a_batch_missing_a_sample_s_rows_is_refused():
    final = BatchedDataDict(agent_sample_index=torch.tensor([0, 2]), total_reward=torch.ones(2))
    with pytest.raises(ValueError, match=r"names no row for sample\(s\) \[1\]"):
        segment_advantages(final, 1)
