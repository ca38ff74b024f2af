"""The ``vlm`` environment: one-turn answer verification by a weighted mix of reward functions.

Each sample's last assistant message is scored against ``metadata["ground_truth"]`` by the
reward functions of the config (see :mod:`envloop.environments.rewards`: answer format,
exact answers, math equivalence, box overlap, or your own by import path). Every episode ends
after that turn with reward = the weighted score in [0, 1] and the observation
``"Environment: correct"`` or ``"Environment: incorrect"``. The verdict comes from the
functions that judge correctness (all must say correct); with none (say ``format`` alone) a
full score of 1 counts as correct. Scoring is split across ``num_workers``
:class:`VLMVerifyWorker` objects (Ray actors when Ray runs). A malformed response scores 0.
"""

from collections.abc import Mapping
from typing import Any

import torch
from typing_extensions import NotRequired, TypedDict

from envloop.data.interfaces import LLMMessageLogType
from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.environments.common.worker_pool import WorkerPool
from envloop.environments.interfaces import EnvironmentInterface, EnvironmentReturn
from envloop.environments.rewards import (
    RewardFunctionConfig,
    RewardOutcome,
    close_math_verifiers,
    combine_rewards,
    extract_answer,
)
from envloop.environments.utils import content_text, last_assistant_text
from envloop.environments.vlm.config import (
    DEFAULT_CONFIG,
    VLMEnvConfig,
    config_problems,
    validated_config,
)

__all__ = [
    "DEFAULT_CONFIG",
    "VLMEnvConfig",
    "VLMEnvironment",
    "VLMEnvironmentMetadata",
    "VLMVerifyWorker",
    "validated_config",
]


class VLMEnvironmentMetadata(TypedDict):
    """Per-sample metadata: the dataset gives ``ground_truth``; ``step`` adds the rest."""

    ground_truth: Any  # what the answer is checked against: text, or a [x1, y1, x2, y2] box
    correct: NotRequired[bool]  # the verdict of step
    reward: NotRequired[float]  # the mixed score of step
    reward_errors: NotRequired[list[str]]  # reward functions that failed on the sample


class VLMVerifyWorker:
    """Holds the reward functions and scores a shard of a batch."""

    def __init__(self, cfg: VLMEnvConfig | None = None) -> None:
        self.cfg = validated_config(cfg)

    def score(self, responses: list[str], ground_truths: list[Any]) -> list[RewardOutcome]:
        """Mixed score, verdict and errors of each response."""
        return combine_rewards(self.cfg["reward_functions"], responses, ground_truths)

    def verify(self, pred_responses: list[str], ground_truths: list[Any]) -> list[float]:
        """The mixed score in [0, 1] of each response."""
        return [outcome.score for outcome in self.score(pred_responses, ground_truths)]

    def close(self) -> None:
        close_math_verifiers()


class VLMEnvironment(EnvironmentInterface):
    """Scores the last assistant message of each sample; every episode ends in one turn."""

    def __init__(self, cfg: VLMEnvConfig | None = None) -> None:
        self.cfg = validated_config(cfg)
        self.answer_tag = _answer_tag(self.cfg["reward_functions"])
        self.workers = WorkerPool(VLMVerifyWorker, self.cfg["num_workers"], self.cfg)

    @classmethod
    def config_problems(cls, config: Any) -> list[str]:
        """Every problem of ``config`` (:func:`.vlm_config.config_problems`)."""
        return config_problems(config)

    def step(
        self,
        message_log_batch: list[LLMMessageLogType],
        metadata: list[Any],
        *args: Any,
        **kwargs: Any,
    ) -> EnvironmentReturn:
        """Rewards [B] float32 (the mixed scores), terminateds [B] all True, answers the
        extracted answers; metadata gains ``correct``, ``reward`` and ``reward_errors``."""
        responses = [last_assistant_text(log) for log in message_log_batch]
        outcomes = self._score(responses, metadata)
        verdicts = [o.correct if o.correct is not None else o.score >= 1.0 for o in outcomes]
        n = len(responses)
        return EnvironmentReturn(
            observations=[
                self._observation(*sample) for sample in zip(responses, verdicts, outcomes)
            ],
            metadata=[
                {
                    **(md if isinstance(md, Mapping) else {}),
                    "correct": v,
                    "reward": o.score,
                    "reward_errors": o.errors,
                }
                for md, v, o in zip(metadata, verdicts, outcomes)
            ],
            next_stop_strings=[None] * n,
            rewards=torch.tensor([o.score for o in outcomes], dtype=torch.float32),
            terminateds=torch.ones(n, dtype=torch.bool),
            answers=[extract_answer(r, self.answer_tag) for r in responses],
        )

    def _score(self, responses: list[str], metadata: list[Any]) -> list[RewardOutcome]:
        """Outcomes on the workers; a sample without ``ground_truth`` scores 0, with the error."""
        has_truth = [isinstance(md, Mapping) and "ground_truth" in md for md in metadata]
        kept = [r for r, ok in zip(responses, has_truth) if ok]
        truths = [md["ground_truth"] for md, ok in zip(metadata, has_truth) if ok]
        scored = iter(self.workers.map("score", kept, truths))
        missing = RewardOutcome(0.0, False, ["metadata: no 'ground_truth' for this sample"])
        return [next(scored) if ok else missing for ok in has_truth]

    def global_post_process_and_metrics(
        self, batch: BatchedDataDict[Any]
    ) -> tuple[BatchedDataDict[Any], dict[str, float]]:
        """Metrics ``vlm_env/...``: accuracy, mean_reward, reward_error_rate,
        fraction_properly_ended (the last response ends with ``</answer>`` or a stop string,
        or the rollout did not truncate the sample: it stopped on EOS), and
        mean_generation_tokens (when every assistant message carries ``token_ids``) or else
        mean_generation_chars, summed over a sample's assistant messages."""
        infos = [md if isinstance(md, Mapping) else {} for md in batch["extra_env_info"]]
        logs = batch["message_log"]
        truncated = batch.get("truncated")
        stopped = (
            [not t for t in truncated.tolist()] if truncated is not None else [False] * len(logs)
        )
        ended = [
            self._ends_properly(last_assistant_text(log)) or s for log, s in zip(logs, stopped)
        ]
        unit, lengths = _generation_lengths(logs)
        return batch, {
            "vlm_env/accuracy": _mean([float(md.get("correct", False)) for md in infos]),
            "vlm_env/mean_reward": _mean([float(md.get("reward", 0.0)) for md in infos]),
            "vlm_env/reward_error_rate": _mean(
                [float(bool(md.get("reward_errors"))) for md in infos]
            ),
            "vlm_env/fraction_properly_ended": _mean([float(e) for e in ended]),
            f"vlm_env/mean_generation_{unit}": _mean(lengths),
            "vlm_env/num_samples": float(len(logs)),
        }

    def shutdown(self) -> None:
        """Stop the verify workers (and their math-verify processes)."""
        if not self.workers.remote:
            for worker in self.workers.workers:
                worker.close()
        self.workers.shutdown()

    def _observation(self, response: str, correct: bool, outcome: RewardOutcome) -> dict[str, str]:
        notes = list(outcome.errors)
        if not correct and f"</{self.answer_tag}>" not in response:
            notes.insert(0, f"no <{self.answer_tag}>...</{self.answer_tag}> in the response")
        verdict = "correct" if correct else "incorrect"
        text = f"Environment: {verdict}" + (f" ({'; '.join(notes)})" if notes else "")
        return {"role": "environment", "content": text}

    def _ends_properly(self, response: str) -> bool:
        endings = [f"</{self.answer_tag}>", *(self.cfg["stop_strings"] or [])]
        return any(response.rstrip().endswith(e) for e in endings)


def _generation_lengths(logs: list[LLMMessageLogType]) -> tuple[str, list[float]]:
    """("tokens" or "chars", per-sample total length of the assistant messages)."""
    replies = [[m for m in log if m["role"] == "assistant"] for log in logs]
    if all("token_ids" in m for reply in replies for m in reply):
        return "tokens", [float(sum(len(m["token_ids"]) for m in reply)) for reply in replies]
    return "chars", [
        float(sum(len(content_text(m["content"])) for m in reply)) for reply in replies
    ]


def _answer_tag(reward_functions: list[RewardFunctionConfig]) -> str:
    """The ``answer_tag`` the first reward function that sets one uses; else "answer"."""
    tags = [rf.get("kwargs", {}).get("answer_tag") for rf in reward_functions]
    return next((t for t in tags if isinstance(t, str)), "answer")


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
