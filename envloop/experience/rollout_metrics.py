"""Rollout metrics (docs/contract.md, "Rollout semantics") and the progress snapshot a
running rollout reports after every turn, both read from a RolloutState and its PhaseTimer."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from envloop.experience.phase_timer import TIMING_PHASES, PhaseTimer
from envloop.experience.rollout_state import RolloutState


@dataclass(frozen=True)
class RolloutProgress:
    """Where a running rollout stands; the ``on_turn`` option receives one after every turn.

    >>> RolloutProgress(samples=4, samples_done=1, turns=6, generated_tokens=300,
    ...                 generation_s=2.0, elapsed_s=3.0).tokens_per_s
    150.0
    """

    samples: int
    """Samples in the rollout (B)."""
    samples_done: int
    """Samples that take no further turn: ended, truncated or failed."""
    turns: int
    """Turns taken so far, summed over samples."""
    generated_tokens: int
    """Tokens the policy generated so far, summed over samples."""
    generation_s: float
    """Wall-clock seconds spent in the policy's ``generate`` so far."""
    elapsed_s: float
    """Wall-clock seconds since the rollout started."""

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of generation (0 before any generation)."""
        return self.generated_tokens / self.generation_s if self.generation_s > 0 else 0.0


def rollout_progress(state: RolloutState, timer: PhaseTimer) -> RolloutProgress:
    """The progress of the rollout whose state is ``state`` and timer ``timer``."""
    return RolloutProgress(
        samples=state.size,
        samples_done=int(state.done.sum()),
        turns=int(state.turns.sum()),
        generated_tokens=int(state.gen_tokens.sum()),
        generation_s=timer.seconds.get("generation", 0.0),
        elapsed_s=time.perf_counter() - timer.started,
    )


def rollout_metrics(
    state: RolloutState, max_turns_reached: torch.Tensor, timer: PhaseTimer
) -> dict[str, float | int]:
    """The metrics of a finished rollout. ``max_turns_reached`` is [B] bool.

    ``generation_tokens_per_s`` is ``total_generated_tokens / timing/generation_s`` (0 when
    nothing was generated): the policy's throughput, environment time excluded.
    """
    turns = state.turns.float()
    generated = int(state.gen_tokens.sum())
    generation_s = timer.seconds.get("generation", 0.0)
    metrics: dict[str, float | int] = {
        "total_turns": int(state.turns.sum()),
        "avg_turns_per_sample": _mean(turns),
        "max_turns_per_sample": int(state.turns.max()) if state.size else 0,
        "natural_termination_rate": _mean(state.terminated),
        "truncation_rate": _mean(state.truncated),
        "max_turns_reached_rate": _mean(max_turns_reached),
        "env_error_rate": _mean(state.failed),
        "generation_error_rate": _mean(state.generation_failed),
        "mean_gen_tokens_per_sample": _mean(state.gen_tokens),
        "mean_env_tokens_per_sample": _mean(state.env_tokens),
        "mean_total_tokens_per_sample": _mean(state.tokens.lengths),
        "total_generated_tokens": generated,
        "generation_tokens_per_s": generated / generation_s if generation_s > 0 else 0.0,
    }
    for name in TIMING_PHASES:
        metrics[f"timing/{name}_s"] = timer.seconds.get(name, 0.0)
    metrics["generation_time_s"] = metrics["timing/generation_s"]
    metrics["env_time_s"] = metrics["timing/env_step_s"]
    return metrics


def _mean(values: torch.Tensor) -> float:
    return float(values.float().mean()) if len(values) else 0.0
