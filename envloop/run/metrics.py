"""Metrics of a whole run: per-task tallies, rollout metrics combined over batches, and the
summary table ``envloop run`` prints.

>>> stats = {}
>>> tally([{"task": "math", "total_reward": 1.0, "num_turns": 1},
...        {"task": "math", "total_reward": 0.0, "num_turns": 2},
...        {"task": "code", "total_reward": 0.5, "num_turns": 3}], stats)
>>> print(summary_table(stats))
task   samples  mean reward  mean turns
math         2        0.500        1.50
code         1        0.500        3.00
total        3        0.500        2.00
>>> tally([{"task": "rm", "total_reward": 8.0, "num_turns": 1}], stats)
>>> print(summary_table(stats))
task  samples  mean reward  mean turns
math        2        0.500        1.50
code        1        0.500        3.00
rm          1        8.000        1.00
no total: rm has rewards outside [0, 1], a scale of its own
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class TaskStats:
    """Running totals of one task's finished samples."""

    samples: int = 0
    reward_sum: float = 0.0
    turns_sum: int = 0
    off_unit_scale: bool = False  # some reward lies outside [0, 1] (see on_unit_scale)

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
        task.off_unit_scale |= not on_unit_scale([record["total_reward"]])


def on_unit_scale(rewards: Iterable[float]) -> bool:
    """Whether every reward lies in [0, 1] (NaN, a missing reward, is left out).

    Rewards in [0, 1] are success-like (pass or fail, solve rates, graded fractions), so a
    mean over several tasks of them is a success rate. A task with a reward outside [0, 1]
    (a reward model's raw scores, penalties, bonuses) has a scale of its own: averaging it
    with other tasks gives a number neither scale can read.

    >>> on_unit_scale([0.0, 0.25, 1.0, math.nan]), on_unit_scale([1.0, -0.1])
    (True, False)
    """
    return all(math.isnan(x) or 0.0 <= x <= 1.0 for x in rewards)


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
    """Per task: samples, mean reward and mean turns, as aligned text; then a total over
    several tasks when every reward lies in [0, 1] (:func:`on_unit_scale`), or a line naming
    the tasks whose rewards have a scale of their own."""
    off_scale = [task for task, s in stats.items() if s.off_unit_scale]
    with_total = len(stats) > 1 and not off_scale
    rows = [*stats.items(), *([("total", total_stats(stats))] if with_total else [])]
    width = max(len("task"), *(len(task) for task, _ in rows))
    lines = [f"{'task':<{width}}  samples  mean reward  mean turns"]
    for task, s in rows:
        lines.append(
            f"{task:<{width}}  {s.samples:>7}  {s.mean_reward:>11.3f}  {s.mean_turns:>10.2f}"
        )
    if len(stats) > 1 and off_scale:
        whose = (
            "has rewards outside [0, 1], a scale"
            if len(off_scale) == 1
            else ("have rewards outside [0, 1], scales")
        )
        own = "of its own" if len(off_scale) == 1 else "of their own"
        lines.append(f"no total: {', '.join(off_scale)} {whose} {own}")
    return "\n".join(lines)
