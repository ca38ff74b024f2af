"""What judging one sample gives (:class:`Judged`), how several judgements become its score,
and the ``EnvironmentReturn`` of judged samples."""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from envloop.environments.interfaces import EnvironmentReturn
from envloop.environments.judge.calls import Reply
from envloop.environments.judge.verdicts import VerdictError, aggregate, parse_verdict

__all__ = ["Judged", "judged_return", "score_replies"]


@dataclass
class Judged:
    """One sample's judgement: its score in [0, 1] (None when it could not be judged), the
    reward (the score, or its rank in its group), why it failed, and each judgement's text
    and score (None: unusable) for the metadata and the metrics."""

    score: float | None
    error: str | None = None
    replies: list[str] = field(default_factory=list)
    scores: list[float | None] = field(default_factory=list)
    parse_failures: int = 0
    reward: float | None = None


def score_replies(
    replies: list[Reply], verdict: Mapping[str, Any], how: str, max_chars: int
) -> Judged:
    """A sample's :class:`Judged` from its judgements: scored from those that are usable
    (not failed, not cut at the token budget, readable), failed when none is."""
    scores: list[float | None] = []
    reasons: list[str] = []
    parse_failures = 0
    for reply in replies:
        try:
            if reply.error is not None:
                raise VerdictError(reply.error)
            if reply.truncated:
                raise VerdictError("judge reply cut at its token budget (max_new_tokens)")
            scores.append(parse_verdict(reply.text, verdict, max_chars))
        except VerdictError as exc:
            parse_failures += reply.error is None and not reply.truncated
            scores.append(None)
            reasons.append(str(exc))
    usable = [s for s in scores if s is not None]
    texts = [r.text for r in replies]
    if not usable:
        error = "; ".join(dict.fromkeys(reasons))
        return Judged(None, f"judge: {error}", texts, scores, parse_failures)
    return Judged(aggregate(usable, how), None, texts, scores, parse_failures)


def agreement(scores: list[float | None]) -> float | None:
    """The share of pairs of a sample's usable judgements that gave the same score (None
    with fewer than two).

    >>> agreement([1.0, 1.0, 0.0]), agreement([1.0, None])
    (0.3333333333333333, None)
    """
    usable = [s for s in scores if s is not None]
    pairs = list(itertools.combinations(usable, 2))
    return sum(a == b for a, b in pairs) / len(pairs) if pairs else None


def judged_return(
    judged: list[Judged],
    metadata: list[Any],
    attempts: list[int],
    config: Mapping[str, Any],
) -> EnvironmentReturn:
    """The ``EnvironmentReturn`` of judged samples: reward the score (or group reward);
    a failed sample is an error (``on_failure: error``) or scores 0 with its reason in
    ``metadata["judge"]["error"]`` (``zero``). An episode ends at ``pass_score``, after
    ``max_attempts`` answers, or when its sample could not be judged."""
    role, zero = config["observation_role"], config["on_failure"] == "zero"
    rewards, ended, observations, metas, errors = [], [], [], [], []
    for j, md, n in zip(judged, metadata, attempts):
        reward = j.reward if j.reward is not None else (j.score or 0.0)
        failed = j.score is None
        rewards.append(reward)
        ended.append(failed or j.score >= config["pass_score"] or n >= config["max_attempts"])
        errors.append(j.error if failed and not zero else None)
        keep = failed and not zero
        metas.append(md if keep else _with_judgement(md, j))
        text = f"Environment: judge score {reward:.4g}" if not failed else ""
        if failed and zero:
            text = f"Environment: judge score 0 (not judged: {j.error})"
        observations.append({"role": role, "content": text})
    return EnvironmentReturn(
        observations=observations,
        metadata=metas,
        next_stop_strings=[None] * len(judged),
        rewards=torch.tensor(rewards, dtype=torch.float32),
        terminateds=torch.tensor(ended, dtype=torch.bool),
        answers=[None] * len(judged),
        errors=errors if any(e is not None for e in errors) else None,
    )


def _with_judgement(metadata: Any, judged: Judged) -> dict[str, Any]:
    md = dict(metadata) if isinstance(metadata, Mapping) else {}
    md["judge"] = {
        "score": judged.score,
        "reward": judged.reward,
        "replies": judged.replies,
        "scores": judged.scores,
        "error": judged.error,
    }
    return md
