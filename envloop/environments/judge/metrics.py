"""The ``judge_env/`` metrics: what the judge did and what its judgements gave."""

from __future__ import annotations

from typing import Any

from envloop.environments.judge.calls import JudgeCounts
from envloop.environments.judge.outcomes import Judged, agreement

PREFIX = "judge_env/"


class JudgeMetrics:
    """Counts of the samples judged since the metrics were last taken."""

    def __init__(self) -> None:
        self.samples = 0
        self.failed = 0
        self.parse_failures = 0
        self.scores: list[float] = []
        self.agreements: list[float] = []

    def count(self, judged: Judged) -> Judged:
        """Count one sample's judgement; returns it."""
        self.samples += 1
        self.failed += judged.score is None
        self.parse_failures += judged.parse_failures
        if judged.score is not None:
            self.scores.append(judged.score)
        agreed = agreement(judged.scores)
        if agreed is not None:
            self.agreements.append(agreed)
        return judged

    def take(self, counts: JudgeCounts) -> dict[str, Any]:
        """The metrics (these counts and the judge's ``counts``), then start afresh."""
        latencies = counts.latencies_s or [0.0]
        stats = {
            "num_samples": self.samples,
            "failed_samples": self.failed,
            "mean_score": _mean(self.scores),
            "agreement": _mean(self.agreements),
            "parse_failures": self.parse_failures,
            "judge_calls": counts.calls,
            "judgements": counts.judgements,
            "failed_judgements": counts.failed,
            "truncated_judgements": counts.truncated,
            "judge_prompt_tokens": counts.prompt_tokens,
            "judge_generated_tokens": counts.generated_tokens,
            "mean_latency_s": sum(latencies) / len(latencies),
            "max_latency_s": max(latencies),
        }
        self.__init__()  # type: ignore[misc]
        return {PREFIX + key: value for key, value in stats.items()}


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
