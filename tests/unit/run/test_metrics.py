"""Run-level metrics: per-task tallies, rollout metrics combined over batches, the summary."""

from __future__ import annotations

import pytest

from envloop.run.metrics import (
    TaskStats,
    combine_rollout_metrics,
    per_task_metrics,
    summary_table,
    tally,
)


def test_combine_rollout_metrics_sums_maxes_and_weights():
    parts = [
        ({"total_turns": 6, "max_turns_per_sample": 2, "truncation_rate": 0.5,
          "timing/generation_s": 1.0, "generation_time_s": 1.0, "label": "x"}, 4),
        ({"total_turns": 3, "max_turns_per_sample": 3, "truncation_rate": 0.0,
          "timing/generation_s": 0.5, "generation_time_s": 0.5}, 2),
    ]  # fmt: skip
    assert combine_rollout_metrics(parts) == {
        "total_turns": 9,
        "max_turns_per_sample": 3,
        "truncation_rate": pytest.approx(2 / 6),
        "timing/generation_s": 1.5,
        "generation_time_s": 1.5,
    }  # "label" is not a number: left out
    assert combine_rollout_metrics([]) == {}


def test_combined_tokens_per_s_is_total_tokens_over_total_generation_time():
    parts = [
        ({"total_generated_tokens": 300, "timing/generation_s": 1.0,
          "generation_tokens_per_s": 300.0}, 4),
        ({"total_generated_tokens": 100, "timing/generation_s": 3.0,
          "generation_tokens_per_s": 100 / 3}, 2),
    ]  # fmt: skip
    assert combine_rollout_metrics(parts) == {
        "total_generated_tokens": 400,
        "timing/generation_s": 4.0,
        "generation_tokens_per_s": 100.0,  # not the sum, nor the mean of the two rates
    }


def test_tally_per_task_and_summary_table():
    stats: dict[str, TaskStats] = {}
    tally([{"task": "sliding_puzzle", "total_reward": 1.0, "num_turns": 4},
           {"task": "math", "total_reward": 0.5, "num_turns": 1},
           {"task": "sliding_puzzle", "total_reward": 0.0, "num_turns": 2}], stats)  # fmt: skip
    assert per_task_metrics(stats) == {
        "sliding_puzzle": {"num_samples": 2, "mean_reward": 0.5, "mean_turns": 3.0},
        "math": {"num_samples": 1, "mean_reward": 0.5, "mean_turns": 1.0},
    }
    assert summary_table(stats).splitlines() == [
        "task            samples  mean reward  mean turns",
        "sliding_puzzle        2        0.500        3.00",
        "math                  1        0.500        1.00",
        "total                 3        0.500        2.33",
    ]
    assert TaskStats().mean_reward == 0.0 and TaskStats().mean_turns == 0.0
