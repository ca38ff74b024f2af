"""The ``vlm`` environment: one-turn answer verification by a weighted mix of reward functions.

Each sample's last assistant message is scored against ``metadata["ground_truth"]`` by the
reward functions of the config (see :mod:`envloop.environments.rewards`: answer format,
exact answers, math equivalence, box overlap, or your own by import path). Every episode ends
after that turn with reward = the weighted score in [0, 1] and the observation
``"Environment: correct"`` or ``"Environment: incorrect"``. The verdict comes from the
functions that judge correctness (all must say correct); with none (say ``format`` alone) a
full score of 1 counts as correct. Scoring is split across ``num_workers``
:class:`VLMVerifyWorker` objects (Ray actors when Ray runs). A malformed response scores 0.

A sample is scored 0 without being parsed, the reason in its ``metadata["reward_errors"]``
and its observation, when its metadata has no ``ground_truth`` (or None), or when its
response or a string ground truth is longer than ``max_parse_chars`` (``"response has
1,200,000 characters, over max_parse_chars=1,000,000; raise max_parse_chars to score it"``;
counted in ``vlm_env/over_max_parse_chars``). What a ground truth may be is up to the reward
functions (text, a box, ...): one that a function cannot use (a huge int, say) fails that
function on that sample alone, which scores 0 for it, with its error in ``reward_errors``
(:func:`~envloop.environments.rewards.combine_rewards`); the other functions, and the other
samples, are scored as usual.
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
from envloop.environments.utils import content_text, last_assistant_text, parse_cap_reason
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
        """Every problem of ``config`` (:func:`.vlm.config.config_problems`)."""
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
        refusals = [self._refusal(r, md) for r, md in zip(responses, metadata)]
        outcomes = self._score(responses, metadata, refusals)
        verdicts = [o.correct if o.correct is not None else o.score >= 1.0 for o in outcomes]
        read = [len(r) <= self.cfg["max_parse_chars"] for r in responses]
        n = len(responses)
        return EnvironmentReturn(
            observations=[
                self._observation(*sample) for sample in zip(responses, verdicts, outcomes, read)
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
            answers=[
                extract_answer(r, self.answer_tag) if ok else None for r, ok in zip(responses, read)
            ],
        )

    def _score(
        self, responses: list[str], metadata: list[Any], refusals: list[str | None]
    ) -> list[RewardOutcome]:
        """Outcomes on the workers; a refused sample scores 0, with the reason as its error."""
        kept = [i for i, why in enumerate(refusals) if why is None]
        truths = [metadata[i]["ground_truth"] for i in kept]
        scored = iter(self.workers.map("score", [responses[i] for i in kept], truths))
        return [
            next(scored) if why is None else RewardOutcome(0.0, False, [why]) for why in refusals
        ]

    def _refusal(self, response: str, metadata: Any) -> str | None:
        """Why a sample is not scored at all (no ground truth, or its response or ground
        truth is over ``max_parse_chars``); None when it is scored."""
        if not isinstance(metadata, Mapping) or metadata.get("ground_truth") is None:
            return "metadata: no 'ground_truth' for this sample"
        return self._cap_reason(response, metadata["ground_truth"])

    def _cap_reason(self, response: str, truth: Any) -> str | None:
        cap = self.cfg["max_parse_chars"]
        text = truth if isinstance(truth, str) else ""  # a box or a number: a few characters
        return parse_cap_reason("ground_truth", len(text), cap) or parse_cap_reason(
            "response", len(response), cap
        )

    def global_post_process_and_metrics(
        self, batch: BatchedDataDict[Any]
    ) -> tuple[BatchedDataDict[Any], dict[str, float]]:
        """Metrics ``vlm_env/...``: accuracy, mean_reward, reward_error_rate,
        fraction_properly_ended (the last response ends with ``</answer>`` or a stop string,
        or the rollout did not truncate the sample: it stopped on EOS), and
        mean_generation_tokens (when every assistant message carries ``token_ids``) or else
        mean_generation_chars, summed over a sample's assistant messages, and
        over_max_parse_chars (samples whose final response or ground truth was over the cap:
        a count)."""
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
        responses = [last_assistant_text(log) for log in logs]
        over_cap = [self._cap_reason(r, md.get("ground_truth")) for r, md in zip(responses, infos)]
        return batch, {
            "vlm_env/accuracy": _mean([float(md.get("correct", False)) for md in infos]),
            "vlm_env/mean_reward": _mean([float(md.get("reward", 0.0)) for md in infos]),
            "vlm_env/reward_error_rate": _mean(
                [float(bool(md.get("reward_errors"))) for md in infos]
            ),
            "vlm_env/fraction_properly_ended": _mean([float(e) for e in ended]),
            f"vlm_env/mean_generation_{unit}": _mean(lengths),
            "vlm_env/num_samples": float(len(logs)),
            "vlm_env/over_max_parse_chars": float(sum(why is not None for why in over_cap)),
        }

    def shutdown(self) -> None:
        """Stop the verify workers (and their math-verify processes)."""
        if not self.workers.remote:
            for worker in self.workers.workers:
                worker.close()
        self.workers.shutdown()

    def _observation(
        self, response: str, correct: bool, outcome: RewardOutcome, read: bool = True
    ) -> dict[str, str]:
        notes = list(outcome.errors)
        if read and not correct and f"</{self.answer_tag}>" not in response:
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
