"""Rollout metrics and the progress snapshot, on a real RolloutState."""

from __future__ import annotations

import time

import pytest
import torch

from envloop.experience.phase_timer import PhaseTimer
from envloop.experience.rollout_metrics import RolloutProgress, rollout_metrics, rollout_progress
from envloop.experience.rollout_state import RolloutState
from tests.fixtures.batches import make_batch


@pytest.fixture
def batch(tiny_tokenizer):
    return make_batch(tiny_tokenizer, [{"task": "echo", "prompt": p} for p in "abcd"])


@pytest.fixture
def state(batch, tiny_tokenizer):
    """Four samples as a rollout leaves them: one terminated, one truncated, one failed and
    one still active, with 3, 1, 0 and 2 turns and 10, 4, 0 and 6 tokens after the prompt."""
    state = RolloutState.start(batch, tiny_tokenizer, max_seq_len=64)
    state.turns = torch.tensor([3, 1, 0, 2])
    state.gen_tokens = torch.tensor([30, 10, 0, 20])
    state.env_tokens = torch.tensor([6, 2, 0, 4])
    state.tokens.append_ragged(torch.arange(4), torch.arange(20), torch.tensor([10, 4, 0, 6]))
    state.terminated[0] = state.truncated[1] = state.failed[2] = True
    return state


def timer_with(**seconds: float) -> PhaseTimer:
    timer = PhaseTimer()
    timer.seconds.update(seconds)
    return timer


def test_metrics_count_turns_and_endings(state):
    metrics = rollout_metrics(state, ~state.done, timer_with())
    assert metrics["total_turns"] == 6
    assert metrics["avg_turns_per_sample"] == 1.5
    assert metrics["max_turns_per_sample"] == 3
    assert metrics["natural_termination_rate"] == 0.25
    assert metrics["truncation_rate"] == 0.25
    assert metrics["env_error_rate"] == 0.25
    assert metrics["max_turns_reached_rate"] == 0.25


def test_metrics_average_tokens_per_sample(state, batch):
    metrics = rollout_metrics(state, ~state.done, timer_with())
    prompts = sum(batch["length"])
    assert metrics["mean_gen_tokens_per_sample"] == 15.0
    assert metrics["mean_env_tokens_per_sample"] == 3.0
    assert metrics["mean_total_tokens_per_sample"] == (prompts + 20) / 4
    assert metrics["total_generated_tokens"] == 60


def test_metrics_time_every_phase_and_the_generation_throughput(state):
    timer = timer_with(generation=2.0, env_step=0.5, flatten=0.25)
    metrics = rollout_metrics(state, ~state.done, timer)
    assert {k: v for k, v in metrics.items() if k.startswith("timing/")} == {
        "timing/flatten_s": 0.25,
        "timing/generation_s": 2.0,
        "timing/gen_bookkeeping_s": 0.0,
        "timing/env_startup_s": 0.0,
        "timing/env_step_s": 0.5,
        "timing/rewards_and_status_s": 0.0,
        "timing/obs_tokenization_s": 0.0,
    }
    assert metrics["generation_tokens_per_s"] == 30.0
    assert metrics["generation_time_s"] == 2.0 and metrics["env_time_s"] == 0.5


def test_throughput_is_zero_without_generation_time(state):
    assert rollout_metrics(state, ~state.done, timer_with())["generation_tokens_per_s"] == 0.0


def test_metrics_of_an_empty_rollout_are_zero(tiny_tokenizer):
    batch = make_batch(tiny_tokenizer, [])
    state = RolloutState.start(batch, tiny_tokenizer, max_seq_len=8)
    metrics = rollout_metrics(state, ~state.done, timer_with())
    assert metrics["total_turns"] == 0 and metrics["max_turns_per_sample"] == 0
    assert all(value == 0 for value in metrics.values())


def test_progress_reports_the_rollout_so_far(state):
    timer = timer_with(generation=4.0)
    timer.started = time.perf_counter() - 100.0
    progress = rollout_progress(state, timer)
    assert (progress.samples, progress.samples_done, progress.turns) == (4, 3, 6)
    assert (progress.generated_tokens, progress.generation_s) == (60, 4.0)
    assert progress.tokens_per_s == 15.0
    assert progress.elapsed_s >= 100.0


def test_progress_throughput_is_zero_before_any_generation():
    progress = RolloutProgress(4, 0, 0, 0, generation_s=0.0, elapsed_s=1.0)
    assert progress.tokens_per_s == 0.0
