"""``math`` and ``math_multi_reward``: check the final answer of each response against
``metadata["ground_truth"]``.

**How answers are checked** (``verifier_type``, NeMo-RL's names):

- ``math`` (default): with ``math_verify_impl: hf_math_verify`` (default), math-verify
  decides mathematical equivalence of the response's last ``\\boxed{}`` (or final expression)
  and the ground truth, in ``num_workers`` worker processes (see
  :mod:`~envloop.environments.math_verification` for what is compared and how);
  ``math_verify_impl: dapo_math_verify`` selects the DAPO check below.
- ``dapo``: the last ``Answer: ...`` line, Minerva-normalised, equal as text to the
  normalised ground truth (:mod:`~envloop.environments.dapo_answers`); the same check as
  ``verifier_type: math`` with ``math_verify_impl: dapo_math_verify``.
- ``english_multichoice`` / ``multilingual_multichoice``: the letter after the last
  ``Answer:`` (or its translation) equals the ground-truth letter
  (:mod:`~envloop.environments.multichoice_answers`).

The DAPO and multiple-choice checks are plain string work, done in-process (no workers).

**What a step returns.** Every sample gets reward 1.0 (correct) or 0.0 and the observation
``"Environment: correct"`` or ``"Environment: incorrect"``, nothing else: the policy never
sees diagnostics. A sample that could not be checked (no ground truth, or its check timed
out, raised, or killed its worker) is incorrect, and its metadata comes back with a
``verification_error`` key saying why; otherwise metadata comes back unchanged (a stale
``verification_error`` from an earlier attempt is removed). ``answers`` holds each sample's
extracted answer (the text math-verify read, the chosen letter, or the normalised DAPO
answer; None when nothing was found), with or without ``return_extracted_answer``. The
episode ends on a correct answer or after ``max_attempts`` answers (default 1). With more
attempts, an incorrect answer is a turn of reward 0 and the policy answers again after the
verdict, so an episode's total reward is 1.0 exactly when one of its attempts was right.

``reward_mode="multi"`` returns two components instead: ``reward/correctness`` (as above) and
``reward/format``, 1.0 when the response holds exactly one well-formed ``\\boxed{...}``.
:class:`MathMultiRewardEnvironment` (``math_multi_reward``) scores ``<answer>`` tags instead.

Timeouts are :class:`~envloop.environments.math_verification.MathVerifier`'s: a check is
interrupted after ``verify_timeout_s`` inside its worker process (the sample scores 0, the
worker goes on); a worker stuck beyond a signal's reach is killed after twice that and
replaced, as is one that dies; only its own sample fails. ``math_env/timeouts`` counts them.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Mapping
from typing import Any, Literal, NamedTuple, TypedDict

import torch

from envloop.config_errors import ConfigError, typed_dict_problems
from envloop.data.interfaces import LLMMessageLogType
from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.environments.answer_extraction import extract_boxed, extract_tag
from envloop.environments.dapo_answers import grade_dapo
from envloop.environments.interfaces import EnvironmentInterface, EnvironmentReturn
from envloop.environments.math_verification import MathGrade, MathVerifier, timed_out
from envloop.environments.multichoice_answers import grade_choice
from envloop.environments.process_pool import HardTimeoutPool, Outcome

VERIFIER_TYPES = ("math", "english_multichoice", "multilingual_multichoice", "dapo")
MATH_VERIFY_IMPLS = ("hf_math_verify", "dapo_math_verify")
REWARD_MODES = ("correctness", "multi")
CORRECT, INCORRECT = "Environment: correct", "Environment: incorrect"
NO_GROUND_TRUTH = "no ground_truth in this sample's metadata"


class MathEnvConfig(TypedDict, total=False):
    num_workers: int  # worker processes checking answers with math-verify (default 2)
    verify_timeout_s: float  # a sample's check is stopped after this long and scores 0 (10)
    stop_strings: list[str] | None  # stop strings for a next turn (default None: EOS only)
    reward_mode: Literal["correctness", "multi"]  # one reward, or correctness + format
    max_attempts: int  # answers per episode; after a wrong one the policy tries again (1)
    observation_role: str  # role of the verdicts; "user" for Qwen templates ("environment")
    verifier_type: str | None  # math, english_multichoice, multilingual_multichoice, dapo
    math_verify_impl: str | None  # for math: hf_math_verify (math-verify) or dapo_math_verify


DEFAULTS: MathEnvConfig = {
    "num_workers": 2,
    "verify_timeout_s": 10.0,
    "stop_strings": None,
    "reward_mode": "correctness",
    "max_attempts": 1,
    "observation_role": "environment",
    "verifier_type": "math",
    "math_verify_impl": "hf_math_verify",
}


class Verdict(NamedTuple):
    """One sample's check: whether it is correct, the answer read from it (None when none),
    and why it could not be checked (None when it was)."""

    correct: bool
    answer: str | None = None
    error: str | None = None


_STRING_CHECKS: dict[str, Callable[[str, str], tuple[bool, str | None]]] = {
    "dapo_math_verify": grade_dapo,
    "english_multichoice": grade_choice,
    "multilingual_multichoice": lambda truth, response: grade_choice(truth, response, True),
}
"""The in-process checks, by :func:`checker_name`: ``(ground_truth, response) -> (correct,
answer)``."""


def checker_name(config: Mapping[str, Any]) -> str:
    """Which check a (valid) config selects: ``hf_math_verify``, ``dapo_math_verify``,
    ``english_multichoice`` or ``multilingual_multichoice``.

    >>> checker_name({}), checker_name({"verifier_type": "dapo"})
    ('hf_math_verify', 'dapo_math_verify')
    >>> checker_name({"verifier_type": "math", "math_verify_impl": "dapo_math_verify"})
    'dapo_math_verify'
    """
    verifier_type = config.get("verifier_type") or "math"
    if verifier_type == "dapo":
        return "dapo_math_verify"
    if verifier_type == "math":
        return config.get("math_verify_impl") or "hf_math_verify"
    return str(verifier_type)


class MathEnvironment(EnvironmentInterface):
    """Scores math answers; see the module docstring. ``config=None`` means :data:`DEFAULTS`."""

    def __init__(self, config: MathEnvConfig | None = None) -> None:
        problems = self._config_problems(config if config is not None else {})
        if problems:
            raise ConfigError("MathEnvConfig", problems)
        self.config: MathEnvConfig = {**DEFAULTS, **(config or {})}
        self.checker = checker_name(self.config)
        self.verifier: MathVerifier | None = None
        if self.checker == "hf_math_verify":
            self.verifier = MathVerifier(
                self.config["num_workers"], self.config["verify_timeout_s"]
            )

    @property
    def pool(self) -> HardTimeoutPool:
        """The verifier's worker processes (math-verify checks only)."""
        if self.verifier is None:
            raise AttributeError(f"The {self.checker} check runs in-process: it has no pool.")
        return self.verifier.pool

    def step(
        self,
        message_log_batch: list[LLMMessageLogType],
        metadata: list[Any],
        return_extracted_answer: bool = False,
        *args: Any,
        **kwargs: Any,
    ) -> EnvironmentReturn:
        """Check every sample's last assistant message. Rewards [B] float32 (or a dict of
        [B] float32 components), terminateds [B] bool (correct, or out of attempts),
        answers one per sample whatever ``return_extracted_answer`` says (NeMo-RL's flag)."""
        responses = [_last_assistant_text(log) for log in message_log_batch]
        verdicts = self.judge(responses, [_ground_truth(md) for md in metadata])
        correct = torch.tensor([v.correct for v in verdicts], dtype=torch.float32)
        attempts = torch.tensor([_count_assistant(log) for log in message_log_batch])
        role, n = self.config["observation_role"], len(responses)
        return EnvironmentReturn(
            observations=[{"role": role, "content": _verdict_text(v)} for v in verdicts],
            metadata=[_with_error(md, v.error) for md, v in zip(metadata, verdicts)],
            next_stop_strings=[self.config["stop_strings"]] * n,
            rewards=self._rewards(correct, responses),
            terminateds=correct.bool() | (attempts >= self.config["max_attempts"]),
            answers=[v.answer for v in verdicts],
        )

    def judge(self, responses: list[str], truths: list[str | None]) -> list[Verdict]:
        """One :class:`Verdict` per response; a None ground truth is an error, and so is a
        check that timed out, raised, or lost its worker."""
        texts = [self._checked_text(r) for r in responses]
        todo = [i for i, (t, x) in enumerate(zip(truths, texts)) if t is not None and x is not None]
        checked = iter(self._check_texts([(str(truths[i]), str(texts[i])) for i in todo]))
        verdicts = [_unchecked(truth) for truth in truths]
        for i in todo:
            verdicts[i] = next(checked)
        return verdicts

    def check(self, pairs: list[tuple[str, str]]) -> list[Outcome]:
        """One :class:`Outcome` per ``(ground_truth, response)``: ``value`` True/False, or
        ``error`` when the check timed out, raised, or its worker died."""
        return [
            Outcome(value=v.correct) if v.error is None else Outcome(error=v.error)
            for v in self._check_texts(pairs)
        ]

    def _check_texts(self, pairs: list[tuple[str, str]]) -> list[Verdict]:
        if self.verifier is None:
            check = _STRING_CHECKS[self.checker]
            return [_string_verdict(check, truth, text) for truth, text in pairs]
        return [_math_verdict(outcome) for outcome in self.verifier.grade(pairs)]

    def _checked_text(self, response: str) -> str | None:
        """The text a check reads from a response (None: no answer to check)."""
        return response

    def _rewards(self, correct: torch.Tensor, responses: list[str]) -> Any:
        if self.config["reward_mode"] == "correctness":
            return correct
        well_formed = [has_one_boxed_answer(r) for r in responses]
        return {
            "reward/correctness": correct,
            "reward/format": torch.tensor(well_formed, dtype=torch.float32),
        }

    def global_post_process_and_metrics(
        self, batch: BatchedDataDict[Any]
    ) -> tuple[BatchedDataDict[Any], dict[str, float | int]]:
        """Metrics ``math_env/accuracy`` (from ``reward/correctness`` when present, else
        ``total_reward`` > 0), ``math_env/num_samples``, ``math_env/fraction_boxed`` (of
        final answers), ``math_env/mean_attempts`` (answers per episode), and, from the
        ``verification_error`` in each sample's final metadata (``extra_env_info``),
        ``math_env/timeouts`` and ``math_env/verification_errors`` (all failed checks)."""
        correctness = batch.get("reward/correctness", batch["total_reward"])
        responses = [_last_assistant_text(log) for log in batch["message_log"]]
        n = max(len(responses), 1)
        correct = int((torch.as_tensor(correctness) > 0).sum())
        boxed = sum(extract_boxed(r) is not None for r in responses)
        attempts = sum(_count_assistant(log) for log in batch["message_log"])
        errors = [_error_of(md) for md in batch.get("extra_env_info", [])]
        return batch, {
            "math_env/accuracy": correct / n,
            "math_env/num_samples": len(responses),
            "math_env/fraction_boxed": boxed / n,
            "math_env/mean_attempts": attempts / n,
            "math_env/timeouts": sum(timed_out(e) for e in errors),
            "math_env/verification_errors": sum(e is not None for e in errors),
        }

    def shutdown(self) -> None:
        """Stop the worker processes."""
        verifier = getattr(self, "verifier", None)  # absent when __init__ raised
        if verifier is not None:
            verifier.close()

    def __del__(self) -> None:
        self.shutdown()

    @classmethod
    def _config_problems(cls, config: Any) -> list[str]:
        return _config_problems(config)


class MathMultiRewardEnvironment(MathEnvironment):
    """``math_multi_reward``: three reward components for ``<think>...</think>\\n<answer>...
    </answer>`` responses, each a float32 [B] tensor of 0.0/1.0:

    - ``reward/correctness``: the content of the last ``<answer>...</answer>`` equals the
      ground truth by math-verify (read whole, as if boxed). A deliberate difference from
      NeMo-RL, which compares the two strings exactly (there ``0.5`` is wrong for ``1/2``),
      and which reads the whole response when it has no answer tags (here: no answer, 0.0).
      The tags are looked for in the whole response, thinking included, as in NeMo-RL.
    - ``reward/integer``: that answer is a non-negative integer literal (ASCII digits).
    - ``reward/format``: the whole response (trailing whitespace aside) is
      ``<think>...</think>\\n<answer>...</answer>`` with exactly one answer tag pair.

    The observation and ``max_attempts`` follow ``reward/correctness``. Configured like
    ``math`` (:class:`MathEnvConfig`), with math-verify checks only and no ``reward_mode``.
    """

    def _checked_text(self, response: str) -> str | None:
        answer = extract_tag(response, "answer")
        if answer is None:
            return None
        return answer if "\\boxed{" in answer else f"\\boxed{{{answer}}}"

    def _rewards(self, correct: torch.Tensor, responses: list[str]) -> dict[str, torch.Tensor]:
        answers = [extract_tag(r, "answer") for r in responses]
        integer = [a is not None and re.fullmatch("[0-9]+", a) is not None for a in answers]
        well_formed = [has_think_answer_format(r) for r in responses]
        return {
            "reward/correctness": correct,
            "reward/integer": torch.tensor(integer, dtype=torch.float32),
            "reward/format": torch.tensor(well_formed, dtype=torch.float32),
        }

    @classmethod
    def _config_problems(cls, config: Any) -> list[str]:
        problems = _config_problems(config)
        if not isinstance(config, Mapping):
            return problems
        if "reward_mode" in config:
            problems.append("reward_mode: not an option of math_multi_reward (it has 3 rewards)")
        if checker_name(config) != "hf_math_verify" and not problems:
            problems.append(
                "verifier_type: math_multi_reward checks <answer> tags with math-verify only;"
                " drop verifier_type and math_verify_impl"
            )
        return problems


def has_one_boxed_answer(text: str) -> bool:
    """The format rule: exactly one ``\\boxed{`` in ``text``, with balanced braces.

    >>> has_one_boxed_answer(r"so \\boxed{\\frac{1}{2}}")
    True
    >>> has_one_boxed_answer(r"\\boxed{1} or \\boxed{2}"), has_one_boxed_answer(r"\\boxed{1")
    (False, False)
    """
    return text.count("\\boxed{") == 1 and extract_boxed(text) is not None


_THINK_ANSWER = re.compile(r"<think>.*?</think>\n<answer>.*?</answer>", re.S)


def has_think_answer_format(text: str) -> bool:
    """The ``math_multi_reward`` format rule: ``<think>...</think>\\n<answer>...</answer>``
    and nothing else (trailing whitespace aside), with one ``<answer>`` and one ``</answer>``.

    >>> has_think_answer_format("<think>2+2</think>\\n<answer>4</answer>\\n")
    True
    >>> has_think_answer_format("<think>2+2\\n<answer>4</answer>")
    False
    """
    if text.count("<answer>") != 1 or text.count("</answer>") != 1:
        return False
    return _THINK_ANSWER.fullmatch(text.rstrip()) is not None


def _select_extracted_answer(extracted_answer: Any, math_verify_impl: str) -> str | None:
    """NeMo-RL's rule for the answer recorded for a sample (``answers``); never raises.

    ``hf_math_verify``: ``extracted_answer`` is ``(gold texts, predicted texts)``; the first
    prediction equal to a gold text, else the first prediction, else None (also for any other
    shape). Other implementations hand back the answer string itself, or anything else for none.

    >>> _select_extracted_answer((["42"], ["7", "42"]), "hf_math_verify")
    '42'
    >>> _select_extracted_answer(None, "hf_math_verify"), _select_extracted_answer("B", "dapo")
    (None, 'B')
    """
    if math_verify_impl != "hf_math_verify":
        return extracted_answer if isinstance(extracted_answer, str) else None
    if not isinstance(extracted_answer, (tuple, list)) or len(extracted_answer) != 2:
        return None
    golds, predictions = (
        [x.strip() for x in part if isinstance(x, str)] if isinstance(part, (list, tuple)) else []
        for part in extracted_answer
    )
    matching = [p for p in predictions if p and p in golds]
    return matching[0] if matching else (predictions[0] if predictions else None)


def _math_verdict(outcome: Outcome) -> Verdict:
    if outcome.error is not None:
        return Verdict(False, None, outcome.error)
    grade: MathGrade = outcome.value
    answer = _select_extracted_answer((grade.gold, grade.predicted), "hf_math_verify")
    return Verdict(grade.correct, answer)


def _string_verdict(
    check: Callable[[str, str], tuple[bool, str | None]], truth: str, text: str
) -> Verdict:
    """An in-process check's verdict; one that raises fails only its own sample."""
    try:
        return Verdict(*check(truth, text))
    except Exception as exc:
        return Verdict(False, None, f"{type(exc).__name__}: {exc}")


def _unchecked(truth: str | None) -> Verdict:
    """The verdict of a sample that is not checked: no ground truth, or no answer."""
    return Verdict(False, None, None if truth is not None else NO_GROUND_TRUTH)


def _verdict_text(verdict: Verdict) -> str:
    return CORRECT if verdict.correct else INCORRECT


def _with_error(metadata: Any, error: str | None) -> Any:
    """``metadata`` with ``verification_error`` set to ``error`` (removed when None); a
    metadata that is not a mapping becomes one when there is an error to report."""
    if not isinstance(metadata, Mapping):
        return metadata if error is None else {"verification_error": error}
    if error is None:
        if "verification_error" not in metadata:
            return metadata
        return {k: v for k, v in metadata.items() if k != "verification_error"}
    return {**metadata, "verification_error": error}


def _error_of(metadata: Any) -> str | None:
    error = metadata.get("verification_error") if isinstance(metadata, Mapping) else None
    return error if isinstance(error, str) else None


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
    problems += _choice_problems(config, "reward_mode", REWARD_MODES)
    stops = config.get("stop_strings")
    if isinstance(stops, list) and not all(isinstance(s, str) for s in stops):
        problems.append("stop_strings: every entry must be a string")
    problems += _choice_problems(config, "verifier_type", VERIFIER_TYPES)
    problems += _choice_problems(config, "math_verify_impl", MATH_VERIFY_IMPLS)
    return problems or _combination_problems(config)


def _choice_problems(config: Mapping[str, Any], key: str, allowed: tuple[str, ...]) -> list[str]:
    """A problem line when ``config[key]`` is set (not None) and not one of ``allowed``."""
    value = config.get(key)
    if value is None or value in allowed:
        return []
    close = difflib.get_close_matches(str(value), allowed, n=1)
    hint = f". Did you mean {close[0]!r}?" if close else ""
    return [f"{key}: {value!r} is not one of {', '.join(allowed)}{hint}"]


def _combination_problems(config: Mapping[str, Any]) -> list[str]:
    """Options that contradict each other (each valid alone)."""
    verifier_type = config.get("verifier_type") or "math"
    impl = config.get("math_verify_impl")
    if verifier_type == "dapo" and impl == "hf_math_verify":
        return ["math_verify_impl: 'hf_math_verify' contradicts verifier_type 'dapo'; drop one"]
    if verifier_type not in ("math", "dapo") and impl == "dapo_math_verify":
        return [
            f"math_verify_impl: 'dapo_math_verify' applies to verifier_type 'math', not "
            f"{verifier_type!r}; drop it, or use verifier_type 'dapo'"
        ]
    if config.get("reward_mode") == "multi" and checker_name(config) != "hf_math_verify":
        return [
            "reward_mode: 'multi' scores one \\boxed{} answer, a math-verify format; it needs "
            "verifier_type 'math' with math_verify_impl 'hf_math_verify'"
        ]
    return []
