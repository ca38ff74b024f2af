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


def test_no_total_over_tasks_whose_reward_scales_differ():
    stats: dict[str, TaskStats] = {}
    tally([{"task": "math", "total_reward": 1.0, "num_turns": 1},
           {"task": "rm", "total_reward": 8.25, "num_turns": 1},
           {"task": "puzzle", "total_reward": -0.5, "num_turns": 3},
           {"task": "math", "total_reward": float("nan"), "num_turns": 1}], stats)  # fmt: skip
    assert [s.off_unit_scale for s in stats.values()] == [False, True, True]
    assert summary_table(stats).splitlines()[-2:] == [
        "puzzle        1       -0.500        3.00",
        "no total: rm, puzzle have rewards outside [0, 1], scales of their own",
    ]
    one_task = {"rm": stats["rm"]}
    assert summary_table(one_task).splitlines() == [
        "task  samples  mean reward  mean turns",
        "rm          1        8.250        1.00",
    ]
