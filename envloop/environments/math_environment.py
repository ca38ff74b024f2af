"""``math`` and ``math_multi_reward``: check the final answer of each response against
``metadata["ground_truth"]``.

**How answers are checked** (``verifier_type``, NeMo-RL's names):

- ``math`` (default): with ``math_verify_impl: hf_math_verify`` (default), math-verify
  decides mathematical equivalence of the response's last ``\\boxed{}`` (or final expression)
  and the ground truth, in ``num_workers`` worker processes (see
  :mod:`~envloop.environments.common.math_verification` for what is compared and how);
  ``math_verify_impl: dapo_math_verify`` selects the DAPO check below.
- ``dapo``: the last ``Answer: ...`` line, Minerva-normalised, equal as text to the
  normalised ground truth (:mod:`~envloop.environments.math.dapo_answers`); the same check as
  ``verifier_type: math`` with ``math_verify_impl: dapo_math_verify``.
- ``english_multichoice`` / ``multilingual_multichoice``: the letter after the last
  ``Answer:`` (or its translation) equals the ground-truth letter
  (:mod:`~envloop.environments.math.multichoice_answers`).

The DAPO and multiple-choice checks are plain string work, done in-process (no workers).

**What is not checked** (the sample is incorrect, and its metadata says why in
``verification_error``; the rest of the batch is checked as usual): a ground truth that is
missing or None, not a string or a number, or a number that cannot be written out (an int
past Python's 4,300-digit limit for ``str``); and a response or a string ground truth longer
than ``max_parse_chars`` (default 1,000,000 characters), which no parser reads: ``"response
has 1,200,000 characters, over max_parse_chars=1,000,000; raise max_parse_chars to score
it"`` (a response over the cap scores 0 on the format components too). Such a sample's
episode ends whatever ``max_attempts`` says (another attempt could not be checked either);
``math_env/over_max_parse_chars`` counts the samples over the cap.

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

Timeouts are :class:`~envloop.environments.common.math_verification.MathVerifier`'s: a check is
interrupted after ``verify_timeout_s`` inside its worker process (the sample scores 0, the
worker goes on); a worker stuck beyond a signal's reach is killed after twice that and
replaced, as is one that dies; only its own sample fails. ``math_env/timeouts`` counts them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from envloop.config.errors import ConfigError
from envloop.data.interfaces import LLMMessageLogType
from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.environments.common.answer_extraction import extract_boxed, extract_tag
from envloop.environments.common.math_verification import MathVerifier, timed_out
from envloop.environments.common.process_pool import HardTimeoutPool, Outcome
from envloop.environments.interfaces import EnvironmentInterface, EnvironmentReturn
from envloop.environments.math.checks import (
    NO_GROUND_TRUTH,
    STRING_CHECKS,
    Verdict,
    has_one_boxed_answer,
    has_think_answer_format,
    math_verdict,
    select_extracted_answer,
    string_verdict,
    verdict_text,
)
from envloop.environments.math.config import (
    DEFAULTS,
    MathEnvConfig,
    checker_name,
    config_problems,
    multi_reward_config_problems,
)
from envloop.environments.utils import last_assistant_text, parse_cap_reason

__all__ = ["DEFAULTS", "MathEnvConfig", "MathEnvironment", "MathMultiRewardEnvironment"]

_select_extracted_answer = select_extracted_answer
"""NeMo-RL's private name for :func:`~envloop.environments.math.checks.select_extracted_answer`
(its published tests import it from here)."""


class MathEnvironment(EnvironmentInterface):
    """Scores math answers; see the module docstring. ``config=None`` means :data:`DEFAULTS`."""

    def __init__(self, config: MathEnvConfig | None = None) -> None:
        problems = self.config_problems(config)
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
        [B] float32 components), terminateds [B] bool (correct, out of attempts, or not
        checkable: see the module docstring), answers one per sample whatever
        ``return_extracted_answer`` says (NeMo-RL's flag)."""
        responses = [last_assistant_text(log) for log in message_log_batch]
        truths = [_ground_truth(md) for md in metadata]
        refusals = [self._refusal(r, t) for r, t in zip(responses, truths)]
        verdicts = self._verdicts(responses, truths, refusals)
        correct = torch.tensor([v.correct for v in verdicts], dtype=torch.float32)
        attempts = torch.tensor([_count_assistant(log) for log in message_log_batch])
        refused = torch.tensor([why is not None for why in refusals], dtype=torch.bool)
        role, n = self.config["observation_role"], len(responses)
        return EnvironmentReturn(
            observations=[{"role": role, "content": verdict_text(v)} for v in verdicts],
            metadata=[_with_error(md, v.error) for md, v in zip(metadata, verdicts)],
            next_stop_strings=[self.config["stop_strings"]] * n,
            rewards=self._rewards(correct, [self._readable(r) for r in responses]),
            terminateds=correct.bool() | (attempts >= self.config["max_attempts"]) | refused,
            answers=[v.answer for v in verdicts],
        )

    def judge(self, responses: list[str], truths: list[Any]) -> list[Verdict]:
        """One :class:`Verdict` per response against its ground truth (a string or a
        number). Not checked, with the reason as the verdict's error: a missing or unusable
        ground truth, or a response or ground truth over ``max_parse_chars``; an error too:
        a check that timed out, raised, or lost its worker."""
        refusals = [self._refusal(r, t) for r, t in zip(responses, truths)]
        return self._verdicts(responses, truths, refusals)

    def _verdicts(
        self, responses: list[str], truths: list[Any], refusals: list[str | None]
    ) -> list[Verdict]:
        texts = [None if why else self._checked_text(r) for r, why in zip(responses, refusals)]
        todo = [i for i, text in enumerate(texts) if text is not None]
        checked = iter(self._check_texts([(str(truths[i]), str(texts[i])) for i in todo]))
        verdicts = [Verdict(False, None, why) for why in refusals]
        for i in todo:
            verdicts[i] = next(checked)
        return verdicts

    def _refusal(self, response: str, truth: Any) -> str | None:
        """Why a sample is not checked at all (its ground truth is unusable, or it or the
        response is over ``max_parse_chars``); None when it is checked."""
        return _truth_problem(truth) or self._cap_reason(response, truth)

    def _cap_reason(self, response: str, truth: Any) -> str | None:
        cap = self.config["max_parse_chars"]
        text = truth if isinstance(truth, str) else ""  # a number is at most 4,300 digits
        return parse_cap_reason("ground_truth", len(text), cap) or parse_cap_reason(
            "response", len(response), cap
        )

    def _readable(self, response: str) -> str:
        """The response the format rewards read: "" (no format) when over the cap."""
        return "" if len(response) > self.config["max_parse_chars"] else response

    def check(self, pairs: list[tuple[str, str]]) -> list[Outcome]:
        """One :class:`Outcome` per ``(ground_truth, response)``: ``value`` True/False, or
        ``error`` when the check timed out, raised, or its worker died."""
        return [
            Outcome(value=v.correct) if v.error is None else Outcome(error=v.error)
            for v in self._check_texts(pairs)
        ]

    def _check_texts(self, pairs: list[tuple[str, str]]) -> list[Verdict]:
        if self.verifier is None:
            check = STRING_CHECKS[self.checker]
            return [string_verdict(check, truth, text) for truth, text in pairs]
        return [math_verdict(outcome) for outcome in self.verifier.grade(pairs)]

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
        ``math_env/timeouts`` and ``math_env/verification_errors`` (all samples not
        checked), and ``math_env/over_max_parse_chars`` (final responses or ground truths
        over the cap, not parsed)."""
        correctness = batch.get("reward/correctness", batch["total_reward"])
        responses = [last_assistant_text(log) for log in batch["message_log"]]
        n = max(len(responses), 1)
        correct = int((torch.as_tensor(correctness) > 0).sum())
        boxed = sum(extract_boxed(self._readable(r)) is not None for r in responses)
        attempts = sum(_count_assistant(log) for log in batch["message_log"])
        infos = batch.get("extra_env_info") or [None] * len(responses)
        errors = [_error_of(md) for md in infos]
        over_cap = [self._cap_reason(r, _ground_truth(md)) for r, md in zip(responses, infos)]
        return batch, {
            "math_env/accuracy": correct / n,
            "math_env/num_samples": len(responses),
            "math_env/fraction_boxed": boxed / n,
            "math_env/mean_attempts": attempts / n,
            "math_env/timeouts": sum(timed_out(e) for e in errors),
            "math_env/verification_errors": sum(e is not None for e in errors),
            "math_env/over_max_parse_chars": sum(why is not None for why in over_cap),
        }

    def shutdown(self) -> None:
        """Stop the worker processes."""
        verifier = getattr(self, "verifier", None)  # absent when __init__ raised
        if verifier is not None:
            verifier.close()

    def __del__(self) -> None:
        self.shutdown()

    @classmethod
    def config_problems(cls, config: Any) -> list[str]:
        """Every problem of ``config`` (see
        :func:`envloop.environments.math.config.config_problems`)."""
        return config_problems(config)


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
    def config_problems(cls, config: Any) -> list[str]:
        """Every problem of ``config`` (see
        :func:`envloop.environments.math.config.multi_reward_config_problems`)."""
        return multi_reward_config_problems(config)


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


def _count_assistant(log: LLMMessageLogType) -> int:
    """Answers given so far (at least 1: a step follows a response)."""
    messages = log if isinstance(log, (list, tuple)) else []
    return max(sum(isinstance(m, Mapping) and m.get("role") == "assistant" for m in messages), 1)


def _ground_truth(metadata: Any) -> Any:
    """The sample's ground truth as given (None when its metadata has none)."""
    return metadata.get("ground_truth") if isinstance(metadata, Mapping) else None


def _truth_problem(truth: Any) -> str | None:
    """Why ``truth`` cannot be checked against, or None: it must be a string or a number
    that can be written out as text.

    >>> _truth_problem("7"), _truth_problem(7), _truth_problem(None)
    (None, None, "no ground_truth in this sample's metadata")
    >>> _truth_problem([7])
    'ground_truth must be a string or a number, got list'
    >>> _truth_problem(10**5000)
    'ground_truth cannot be written as text: ValueError: Exceeds the limit (4300 digits) \
for integer string conversion; use sys.set_int_max_str_digits() to increase the limit'
    """
    if truth is None:
        return NO_GROUND_TRUTH
    if isinstance(truth, bool) or not isinstance(truth, (str, int, float)):
        return f"ground_truth must be a string or a number, got {type(truth).__name__}"
    try:
        str(truth)
    except Exception as exc:  # an int past Python's digit limit, a subclass's own __str__
        return f"ground_truth cannot be written as text: {type(exc).__name__}: {exc}"
    return None
