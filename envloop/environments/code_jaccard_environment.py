"""``code_jaccard``: scores a response by its overlap with a reference solution.

With ``similarity: words`` (the default) it scores as NeMo-RL's environment does
(:func:`~envloop.environments.code.similarity.word_jaccard`): the sample's assistant replies
joined, compared with ``metadata["ground_truth"]`` after stripping and lower-casing; 1.0 for
an exact match, else the Jaccard similarity of their whitespace-separated words times the
ratio of their lengths. ``similarity: code_tokens`` is envloop's own, a deliberate
difference (:func:`~envloop.environments.code.similarity.code_jaccard`): the last reply's
code (fenced blocks if any, else the whole text) and the reference's, compared as sets of
code tokens (identifiers, numbers, string literals, operators), so layout and prose around
the code do not count. Either measures resemblance, not correctness: nothing runs (the
``code`` environment executes code against tests). The observation is ``"Environment:
jaccard aligned (score: 0.83)"`` when the score is above ``alignment_threshold``, else
``"... misaligned (score: 0.17)"``. Every episode ends after one answer.

A sample whose ground truth is missing or not a string (or, with ``code_tokens``, holds no
code tokens) scores 0 and says why in its observation and in ``metadata["jaccard_error"]``;
the rest of the batch is scored as usual. So does a sample whose response or ground truth is
longer than ``max_parse_chars`` (``"response has 1,200,000 characters, over
max_parse_chars=1,000,000; raise max_parse_chars to score it"``), which is not parsed at all
(its answer is None) and is counted in ``code_jaccard_env/over_max_parse_chars``. Metadata
also gains ``jaccard_score``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypedDict

import torch
from typing_extensions import NotRequired

from envloop.config.errors import ConfigError
from envloop.data.interfaces import LLMMessageLogType
from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.environments.code.jaccard_config import (
    DEFAULTS,
    CodeJaccardEnvConfig,
    config_problems,
)
from envloop.environments.code.similarity import (
    code_jaccard,
    code_tokens,
    extract_code,
    word_jaccard,
)
from envloop.environments.interfaces import EnvironmentReturn
from envloop.environments.sample_environment import SampleEnvironment, SampleStep
from envloop.environments.utils import content_text, last_assistant_text, parse_cap_reason

__all__ = [
    "DEFAULTS",
    "CodeJaccardEnvConfig",
    "CodeJaccardEnvironment",
    "CodeJaccardEnvironmentMetadata",
]


class CodeJaccardEnvironmentMetadata(TypedDict):
    """A sample's metadata: its reference solution in; the score (and why it is 0) out."""

    ground_truth: str
    jaccard_score: NotRequired[float]
    jaccard_error: NotRequired[str]


class CodeJaccardEnvironment(SampleEnvironment[CodeJaccardEnvironmentMetadata]):
    """Rewards a response by its overlap with ``metadata["ground_truth"]``; see the module
    docstring. ``config=None`` means :data:`DEFAULTS`.

    Scoring a sample takes microseconds (a regex and two set operations), so it runs in the
    environment's own process: ``num_workers`` is accepted so NeMo-RL configs load, and is
    only validated.
    """

    def __init__(self, config: CodeJaccardEnvConfig | None = None) -> None:
        problems = self.config_problems(config)
        if problems:
            raise ConfigError("CodeJaccardEnvConfig", problems)
        self.config: CodeJaccardEnvConfig = {**DEFAULTS, **(config or {})}

    @classmethod
    def config_problems(cls, config: Any) -> list[str]:
        """Every problem of ``config`` (see
        :func:`envloop.environments.code.jaccard_config.config_problems`)."""
        return config_problems(config)

    def step(
        self,
        message_log_batch: list[LLMMessageLogType],
        metadata: list[Any],
        return_extracted_answer: bool = False,
    ) -> EnvironmentReturn:
        """Rewards [B] float32 in [0, 1], terminateds [B] all True; ``answers`` (when
        ``return_extracted_answer``) what was scored, stripped: the replies (``words``)
        or their code (``code_tokens``)."""
        ret = super().step(message_log_batch, metadata)
        return ret if return_extracted_answer else ret._replace(answers=None)

    def step_sample(self, messages: LLMMessageLogType, metadata: Any) -> SampleStep:
        """Score one response; the episode ends."""
        words = self.config["similarity"] == "words"
        response = _replies(messages) if words else last_assistant_text(messages)
        too_long = self._cap_reason(response, metadata)
        error: str | None
        if too_long:
            score, error = 0.0, too_long
        else:
            score, error = _score(response, metadata, words)
        scored = response if words else extract_code(response)
        return SampleStep(
            self._observation(score, error),
            score,
            terminated=True,
            metadata=_with_result(metadata, score, error),
            next_stop_strings=self.config["stop_strings"],
            answer=None if too_long else scored.strip(),
        )

    def _cap_reason(self, response: str, metadata: Any) -> str | None:
        """Why the sample is not parsed (its response or ground truth is over
        ``max_parse_chars``), or None."""
        cap = self.config["max_parse_chars"]
        truth = metadata.get("ground_truth") if isinstance(metadata, Mapping) else None
        text = truth if isinstance(truth, str) else ""
        return parse_cap_reason("ground_truth", len(text), cap) or parse_cap_reason(
            "response", len(response), cap
        )

    def global_post_process_and_metrics(
        self, batch: BatchedDataDict[Any]
    ) -> tuple[BatchedDataDict[Any], dict[str, float | int]]:
        """Metrics ``code_jaccard_env/...`` over the batch's ``total_reward`` (the scores):
        ``mean_score``, ``aligned_fraction`` (above the threshold), ``exact_fraction``
        (score 1: the same token set), ``error_rate`` (samples that could not be scored, from
        ``extra_env_info``), ``num_samples`` and ``over_max_parse_chars`` (samples whose
        scored response or ground truth was over the cap: a count); and NeMo-RL's
        ``preference_alignment_rate`` (score above 0.5), ``average_preference_score`` and
        ``high_alignment_rate`` (above 0.8)."""
        scores = torch.as_tensor(batch["total_reward"], dtype=torch.float32)
        infos = batch.get("extra_env_info") or [None] * len(scores)
        errors = [isinstance(md, Mapping) and "jaccard_error" in md for md in infos]
        logs = batch.get("message_log") or [[]] * len(infos)
        replies = _replies if self.config["similarity"] == "words" else last_assistant_text
        over_cap = [self._cap_reason(replies(log), md) for log, md in zip(logs, infos)]
        n = max(len(scores), 1)
        return batch, {
            "code_jaccard_env/mean_score": float(scores.sum()) / n,
            "code_jaccard_env/aligned_fraction": int((scores > self._threshold).sum()) / n,
            "code_jaccard_env/exact_fraction": int((scores == 1.0).sum()) / n,
            "code_jaccard_env/error_rate": sum(errors) / n,
            "code_jaccard_env/num_samples": len(scores),
            "code_jaccard_env/over_max_parse_chars": sum(why is not None for why in over_cap),
            # NeMo-RL's names and thresholds, for dashboards ported from it
            "preference_alignment_rate": int((scores > 0.5).sum()) / n,
            "average_preference_score": float(scores.sum()) / n,
            "high_alignment_rate": int((scores > 0.8).sum()) / n,
        }

    @property
    def _threshold(self) -> float:
        return float(self.config["alignment_threshold"])

    def _observation(self, score: float, error: str | None) -> dict[str, str]:
        verdict = "aligned" if score > self._threshold else "misaligned"
        detail = f"score: {score:.2f}" + (f"; {error}" if error else "")
        return {"role": "environment", "content": f"Environment: jaccard {verdict} ({detail})"}


def _replies(messages: LLMMessageLogType) -> str:
    """The text of every assistant message, joined (what NeMo-RL's environment scores)."""
    if not isinstance(messages, (list, tuple)):
        return ""
    return "".join(
        content_text(m.get("content"))
        for m in messages
        if isinstance(m, Mapping) and m.get("role") == "assistant"
    )


def _score(response: str, metadata: Any, words: bool) -> tuple[float, str | None]:
    """``(score, None)``, or ``(0.0, why)`` when the sample's ground truth is unusable."""
    truth = metadata.get("ground_truth") if isinstance(metadata, Mapping) else None
    if not isinstance(truth, str):
        return 0.0, "no ground_truth string in this sample's metadata"
    if words:
        return word_jaccard(response, truth), None
    if not code_tokens(extract_code(truth)):
        return 0.0, "ground_truth holds no code tokens"
    return code_jaccard(response, truth), None


def _with_result(metadata: Any, score: float, error: str | None) -> dict[str, Any]:
    result = {**(metadata if isinstance(metadata, Mapping) else {}), "jaccard_score": score}
    return {**result, "jaccard_error": error} if error else result
