"""Metrics of a whole run: per-task tallies, rollout metrics combined over batches, and the
summary table ``envloop run`` prints.

>>> stats = {}
>>> tally([{"task": "math", "total_reward": 1.0, "num_turns": 1},
...        {"task": "math", "total_reward": 0.0, "num_turns": 2}], stats)
>>> print(summary_table(stats))
task   samples  mean reward  mean turns
math         2        0.500        1.50
total        2        0.500        1.50
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class TaskStats:
    """Running totals of one task's finished samples."""

    samples: int = 0
    reward_sum: float = 0.0
    turns_sum: int = 0

    @property
    def mean_reward(self) -> float:
        return self.reward_sum / self.samples if self.samples else 0.0

    @property
    def mean_turns(self) -> float:
        return self.turns_sum / self.samples if self.samples else 0.0


def tally(records: Iterable[Mapping[str, Any]], stats: dict[str, TaskStats]) -> None:
    """Add finished sample records to ``stats`` (task -> totals), in place."""
    for record in records:
        task = stats.setdefault(record["task"], TaskStats())
        task.samples += 1
        task.reward_sum += record["total_reward"]
        task.turns_sum += record["num_turns"]


def total_stats(stats: Mapping[str, TaskStats]) -> TaskStats:
    """All tasks together."""
    return TaskStats(
        sum(s.samples for s in stats.values()),
        sum(s.reward_sum for s in stats.values()),
        sum(s.turns_sum for s in stats.values()),
    )


def per_task_metrics(stats: Mapping[str, TaskStats]) -> dict[str, dict[str, float | int]]:
    """``metrics.json``'s ``per_task`` section."""
    return {
        task: {"num_samples": s.samples, "mean_reward": s.mean_reward, "mean_turns": s.mean_turns}
        for task, s in stats.items()
    }


def combine_rollout_metrics(parts: Sequence[tuple[Mapping[str, Any], int]]) -> dict[str, Any]:
    """One rollout-metrics dict from per-batch ``(metrics, batch size)`` pairs: totals and
    times (``total_*``, ``*_s``) are summed, maxima (``max_*``) maxed, the rest (rates and
    means) averaged weighted by batch size; values that are not numbers are left out.
    ``generation_tokens_per_s`` is recomputed from the summed tokens and generation time."""
    combined: dict[str, Any] = {}
    size = sum(n for _, n in parts) or 1
    for key in dict.fromkeys(k for metrics, _ in parts for k in metrics):
        values = [(m[key], n) for m, n in parts if isinstance(m.get(key), (int, float))]
        if not values:
            continue
        if key.startswith("total_") or key.endswith("_s"):
            combined[key] = sum(v for v, _ in values)
        elif key.startswith("max_"):
            combined[key] = max((v for v, _ in values), default=0)
        else:
            combined[key] = sum(v * n for v, n in values) / size
    if "generation_tokens_per_s" in combined:
        seconds = combined.get("timing/generation_s", 0.0)
        tokens = combined.get("total_generated_tokens", 0)
        combined["generation_tokens_per_s"] = tokens / seconds if seconds > 0 else 0.0
    return combined


STARTUP_PHASES = ("ray", "envs_launch", "policy_load", "prompt_tokenization", "envs_wait")
"""Start-up phases of ``envloop run``, in order: join or start Ray, launch the environment
actors, load the policy (while the actors start), tokenize the prompts, wait for the actors."""


def startup_metrics(timer: Any) -> dict[str, float]:
    """``metrics.json``'s ``startup`` section from a ``PhaseTimer`` of
    :data:`STARTUP_PHASES`: seconds per phase (``<phase>_s``) and their sum (``total_s``).

    >>> class Timer:
    ...     seconds = {"ray": 1.5, "policy_load": 2.0}
    >>> startup_metrics(Timer())["total_s"], startup_metrics(Timer())["envs_wait_s"]
    (3.5, 0.0)
    """
    seconds = {f"{name}_s": timer.seconds.get(name, 0.0) for name in STARTUP_PHASES}
    return {**seconds, "total_s": sum(seconds.values())}


def summary_table(stats: Mapping[str, TaskStats]) -> str:
    """Per task and in total: samples, mean reward and mean turns, as aligned text."""
    rows = [*stats.items(), ("total", total_stats(stats))]
    width = max(len("task"), *(len(task) for task, _ in rows))
    lines = [f"{'task':<{width}}  samples  mean reward  mean turns"]
    for task, s in rows:
        lines.append(
            f"{task:<{width}}  {s.samples:>7}  {s.mean_reward:>11.3f}  {s.mean_turns:>10.2f}"
        )
    return "\n".join(lines)
