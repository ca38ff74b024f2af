"""Rollout metrics (SPEC §7) and the per-phase wall-clock timer behind the timing metrics."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from envloop.experience.rollout_state import RolloutState

TIMING_PHASES = (
    "flatten",
    "generation",
    "gen_bookkeeping",
    "env_step",
    "rewards_and_status",
    "obs_tokenization",
)
"""Phases of a turn, in order; ``timing/<phase>_s`` sums each over the rollout."""


class PhaseTimer:
    """Accumulates wall-clock seconds per named phase.

    >>> timer = PhaseTimer()
    >>> with timer.phase("flatten"):
    ...     pass
    >>> sorted(timer.seconds) == ["flatten"]
    True
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start


def rollout_metrics(
    state: RolloutState, max_turns_reached: torch.Tensor, timer: PhaseTimer
) -> dict[str, float | int]:
    """The metrics of a finished rollout. ``max_turns_reached`` is [B] bool."""
    turns = state.turns.float()
    metrics: dict[str, float | int] = {
        "total_turns": int(state.turns.sum()),
        "avg_turns_per_sample": _mean(turns),
        "max_turns_per_sample": int(state.turns.max()) if state.size else 0,
        "natural_termination_rate": _mean(state.terminated),
        "truncation_rate": _mean(state.truncated),
        "max_turns_reached_rate": _mean(max_turns_reached),
        "env_error_rate": _mean(state.failed),
        "mean_gen_tokens_per_sample": _mean(state.gen_tokens),
        "mean_env_tokens_per_sample": _mean(state.env_tokens),
        "mean_total_tokens_per_sample": _mean(state.tokens.lengths),
    }
    for name in TIMING_PHASES:
        metrics[f"timing/{name}_s"] = timer.seconds.get(name, 0.0)
    metrics["generation_time_s"] = metrics["timing/generation_s"]
    metrics["env_time_s"] = metrics["timing/env_step_s"]
    return metrics


def _mean(values: torch.Tensor) -> float:
    return float(values.float().mean()) if len(values) else 0.0
