"""``math``: checks the final answer of each response against ``metadata["ground_truth"]``.

Each sample's last assistant message is compared with its ground truth by math-verify
(:func:`~envloop.environments.math_verification.math_equivalent`: the last ``\\boxed{}`` or,
failing that, the last expression of the response), in ``num_workers`` worker processes.
Every sample gets reward 1.0 (correct) or 0.0; the observation is ``"Environment: correct"``
or ``"Environment: incorrect"``, with the reason appended when the sample could not be checked
(no ground truth, check timed out or failed). The episode ends on a correct answer or after
``max_attempts`` answers (default 1: one answer per episode). With more attempts, an
incorrect answer is a turn of reward 0 and the policy answers again after the verdict, so
an episode's total reward is 1.0 exactly when one of its attempts was right.

``reward_mode="multi"`` returns two components instead: ``reward/correctness`` (as above) and
``reward/format``, 1.0 when the response holds exactly one well-formed ``\\boxed{...}``.

Timeouts are :class:`~envloop.environments.math_verification.MathVerifier`'s: a check is
interrupted after ``verify_timeout_s`` inside its worker process (the sample scores 0, the
worker goes on); a worker stuck beyond a signal's reach is killed after twice that and
replaced, as is one that dies; only its own sample fails.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, TypedDict

import torch

from envloop.config_errors import ConfigError, typed_dict_problems
from envloop.data.interfaces import LLMMessageLogType
from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.environments.answer_extraction import extract_boxed
from envloop.environments.interfaces import EnvironmentInterface, EnvironmentReturn
from envloop.environments.math_verification import MathVerifier
from envloop.environments.process_pool import HardTimeoutPool, Outcome


class MathEnvConfig(TypedDict, total=False):
    num_workers: int  # worker processes checking answers (default 2)
    verify_timeout_s: float  # a sample's check is stopped after this long and scores 0 (10)
    stop_strings: list[str] | None  # stop strings for a next turn (default None: EOS only)
    reward_mode: Literal["correctness", "multi"]  # one reward, or correctness + format
    max_attempts: int  # answers per episode; after a wrong one the policy tries again (1)
    observation_role: str  # role of the verdicts; "user" for Qwen templates ("environment")


DEFAULTS: MathEnvConfig = {
    "num_workers": 2,
    "verify_timeout_s": 10.0,
    "stop_strings": None,
    "reward_mode": "correctness",
    "max_attempts": 1,
    "observation_role": "environment",
}


class MathEnvironment(EnvironmentInterface):
    """Scores math answers; see the module docstring. ``config=None`` means :data:`DEFAULTS`."""

    def __init__(self, config: MathEnvConfig | None = None) -> None:
        problems = _config_problems(config if config is not None else {})
        if problems:
            raise ConfigError("MathEnvConfig", problems)
        self.config: MathEnvConfig = {**DEFAULTS, **(config or {})}
        self.verifier = MathVerifier(self.config["num_workers"], self.config["verify_timeout_s"])

    @property
    def pool(self) -> HardTimeoutPool:
        """The verifier's worker processes."""
        return self.verifier.pool

    def step(
        self,
        message_log_batch: list[LLMMessageLogType],
        metadata: list[Any],
        *args: Any,
        **kwargs: Any,
    ) -> EnvironmentReturn:
        """Check every sample's last assistant message; rewards [B] float32 (or a dict of
        ``reward/correctness`` and ``reward/format``, each [B]); a sample terminates when
        it is correct or has used its ``max_attempts`` answers."""
        responses = [_last_assistant_text(log) for log in message_log_batch]
        truths = [_ground_truth(md) for md in metadata]
        outcomes = self.check([(t, r) for t, r in zip(truths, responses) if t is not None])
        verdicts = iter(outcomes)
        results = [next(verdicts) if t is not None else None for t in truths]
        correct = torch.tensor([r is not None and r.value is True for r in results])
        n = len(responses)
        attempts = torch.tensor([_count_assistant(log) for log in message_log_batch])
        role = self.config["observation_role"]
        return EnvironmentReturn(
            observations=[{"role": role, "content": _verdict(r)} for r in results],
            metadata=list(metadata),
            next_stop_strings=[self.config["stop_strings"]] * n,
            rewards=self._rewards(correct.float(), responses),
            terminateds=correct | (attempts >= self.config["max_attempts"]),
            answers=[extract_boxed(r) for r in responses],
        )

    def check(self, pairs: list[tuple[str, str]]) -> list[Outcome]:
        """One :class:`Outcome` per ``(ground_truth, response)``: ``value`` True/False, or
        ``error`` when the check timed out, raised, or its worker died."""
        return self.verifier.check(pairs)

    def _rewards(self, correct: torch.Tensor, responses: list[str]) -> Any:
        if self.config["reward_mode"] == "correctness":
            return correct
        well_formed = torch.tensor([has_one_boxed_answer(r) for r in responses])
        return {"reward/correctness": correct, "reward/format": well_formed.float()}

    def global_post_process_and_metrics(
        self, batch: BatchedDataDict[Any]
    ) -> tuple[BatchedDataDict[Any], dict[str, float | int]]:
        """Metrics ``math_env/accuracy`` (from ``reward/correctness`` when present, else
        ``total_reward`` > 0), ``math_env/num_samples``, ``math_env/fraction_boxed`` (of
        final answers) and ``math_env/mean_attempts`` (answers per episode)."""
        correctness = batch.get("reward/correctness", batch["total_reward"])
        responses = [_last_assistant_text(log) for log in batch["message_log"]]
        n = max(len(responses), 1)
        correct = int((torch.as_tensor(correctness) > 0).sum())
        boxed = sum(extract_boxed(r) is not None for r in responses)
        attempts = sum(_count_assistant(log) for log in batch["message_log"])
        return batch, {
            "math_env/accuracy": correct / n,
            "math_env/num_samples": len(responses),
            "math_env/fraction_boxed": boxed / n,
            "math_env/mean_attempts": attempts / n,
        }

    def shutdown(self) -> None:
        """Stop the worker processes."""
        if hasattr(self, "verifier"):
            self.verifier.close()

    def __del__(self) -> None:
        self.shutdown()


def has_one_boxed_answer(text: str) -> bool:
    """The format rule: exactly one ``\\boxed{`` in ``text``, with balanced braces.

    >>> has_one_boxed_answer(r"so \\boxed{\\frac{1}{2}}")
    True
    >>> has_one_boxed_answer(r"\\boxed{1} or \\boxed{2}"), has_one_boxed_answer(r"\\boxed{1")
    (False, False)
    """
    return text.count("\\boxed{") == 1 and extract_boxed(text) is not None


def _verdict(result: Outcome | None) -> str:
    if result is None:
        return "Environment: incorrect (no ground_truth in this sample's metadata)"
    if result.error is not None:
        return f"Environment: incorrect (could not verify: {result.error})"
    return "Environment: correct" if result.value else "Environment: incorrect"


def _last_assistant_text(log: LLMMessageLogType) -> str:
    """The last assistant message's text; "" when there is none (or it is not text)."""
    texts = [m.get("content") for m in log if m.get("role") == "assistant"]
    return texts[-1] if texts and isinstance(texts[-1], str) else ""


def _count_assistant(log: LLMMessageLogType) -> int:
    """Answers given so far (at least 1: a step follows a response)."""
    return max(sum(m.get("role") == "assistant" for m in log), 1)


def _ground_truth(metadata: Any) -> str | None:
    truth = metadata.get("ground_truth") if isinstance(metadata, Mapping) else None
    ok = isinstance(truth, (str, int, float)) and not isinstance(truth, bool)
    return str(truth) if ok else None


def _config_problems(config: Any) -> list[str]:
    problems = typed_dict_problems(config, MathEnvConfig)
    if not isinstance(config, Mapping):
        return problems
    workers, timeout = config.get("num_workers", 2), config.get("verify_timeout_s", 10.0)
    if isinstance(workers, int) and workers < 1:
        problems.append(f"num_workers: must be at least 1, got {workers}")
    if isinstance(timeout, (int, float)) and timeout <= 0:
        problems.append(f"verify_timeout_s: must be > 0 seconds, got {timeout}")
    attempts = config.get("max_attempts", 1)
    if isinstance(attempts, int) and attempts < 1:
        problems.append(f"max_attempts: must be at least 1, got {attempts}")
    if config.get("observation_role", "environment") == "":
        problems.append("observation_role: must be a role name such as 'environment' or 'user'")
    if config.get("reward_mode", "correctness") not in ("correctness", "multi"):
        problems.append(f"reward_mode: {config['reward_mode']!r} is not one of correctness, multi")
    stops = config.get("stop_strings")
    if isinstance(stops, list) and not all(isinstance(s, str) for s in stops):
        problems.append("stop_strings: every entry must be a string")
    return problems
