"""What a math check concludes about one response: :class:`Verdict`, the in-process checks
(DAPO answer lines, multiple-choice letters), and the format rules behind the format rewards."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, NamedTuple

from envloop.environments.common.answer_extraction import extract_boxed
from envloop.environments.common.math_verification import MathGrade
from envloop.environments.common.process_pool import Outcome
from envloop.environments.math.dapo_answers import grade_dapo
from envloop.environments.math.multichoice_answers import grade_choice

CORRECT, INCORRECT = "Environment: correct", "Environment: incorrect"
NO_GROUND_TRUTH = "no ground_truth in this sample's metadata"


class Verdict(NamedTuple):
    """One sample's check: whether it is correct, the answer read from it (None when none),
    and why it could not be checked (None when it was)."""

    correct: bool
    answer: str | None = None
    error: str | None = None


STRING_CHECKS: dict[str, Callable[[str, str], tuple[bool, str | None]]] = {
    "dapo_math_verify": grade_dapo,
    "english_multichoice": grade_choice,
    "multilingual_multichoice": lambda truth, response: grade_choice(truth, response, True),
}
"""The in-process checks, by :func:`checker_name`: ``(ground_truth, response) -> (correct,
answer)``."""


def has_one_boxed_answer(text: str) -> bool:
    """The format rule: exactly one ``\\boxed{`` in ``text``, with balanced braces.

    >>> has_one_boxed_answer(r"so \\boxed{\\frac{1}{2}}")
    True
    >>> has_one_boxed_answer(r"\\boxed{1} or \\boxed{2}"), has_one_boxed_answer(r"\\boxed{1")
    (False, False)
    """
    return text.count("\\boxed{") == 1 and extract_boxed(text) is not None


_THINK_ANSWER = re.compile(r"<think>.*?</think>\n<answer>.*?</answer>", re.S)
"""Linear only behind the check for exactly one ``<answer>`` and one ``</answer>``: with several
``</think>\\n<answer>``, the second lazy span would run on to the end from each of them."""


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


def select_extracted_answer(extracted_answer: Any, math_verify_impl: str) -> str | None:
    """NeMo-RL's rule for the answer recorded for a sample (``answers``); never raises.

    ``hf_math_verify``: ``extracted_answer`` is ``(gold texts, predicted texts)``; the first
    prediction equal to a gold text, else the first prediction, else None (also for any other
    shape). Other implementations hand back the answer string itself, or anything else for none.

    >>> select_extracted_answer((["42"], ["7", "42"]), "hf_math_verify")
    '42'
    >>> select_extracted_answer(None, "hf_math_verify"), select_extracted_answer("B", "dapo")
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


def math_verdict(outcome: Outcome) -> Verdict:
    if outcome.error is not None:
        return Verdict(False, None, outcome.error)
    grade: MathGrade = outcome.value
    answer = select_extracted_answer((grade.gold, grade.predicted), "hf_math_verify")
    return Verdict(grade.correct, answer)


def string_verdict(
    check: Callable[[str, str], tuple[bool, str | None]], truth: str, text: str
) -> Verdict:
    """An in-process check's verdict; one that raises fails only its own sample."""
    try:
        return Verdict(*check(truth, text))
    except Exception as exc:
        return Verdict(False, None, f"{type(exc).__name__}: {exc}")


def unchecked(truth: str | None) -> Verdict:
    """The verdict of a sample that is not checked: no ground truth, or no answer."""
    return Verdict(False, None, None if truth is not None else NO_GROUND_TRUTH)


def verdict_text(verdict: Verdict) -> str:
    return CORRECT if verdict.correct else INCORRECT
