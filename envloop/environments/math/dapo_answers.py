"""DAPO-style answers: the last ``Answer: ...`` line, normalised Minerva-style, compared as text.

Used by the ``math`` environment's ``verifier_type: dapo`` (equivalently ``math_verify_impl:
dapo_math_verify``), the checker DAPO trains with: the model ends with a line ``Answer:
<final answer>``; that answer and the ground truth are normalised (:func:`normalize_final_answer`,
after the normalisation of Minerva, Lewkowycz et al. 2022, appendix D) and must then be
equal strings. No symbolic algebra: ``\\frac{1}{2}`` and ``0.5`` differ. Plain string work,
run in-process; every pattern is linear-time.

Deliberate differences from NeMo-RL's copy of the DAPO verifier: thinking is dropped before
looking for the answer line (a draft ``Answer:`` while thinking is not the answer) instead of
keeping only the last 300 characters; units are removed as whole words only (NeMo-RL removes
``"cm"`` or ``"sue"`` inside any word), nested ``\\text{}``/``\\boxed{}`` are unwrapped whole, a
trailing full stop is dropped (``Answer: 42.`` is ``42``); a response without an answer line
has no answer (``None``) rather than the string ``[INVALID]``.
"""

from __future__ import annotations

import re

from envloop.environments.common.answer_extraction import (
    after_thinking,
    closing_braces,
    last_match,
)

UNITS: tuple[str, ...] = (
    *("square", "ways", "integers", "dollars", "mph", "inches", "inch", "hours", "hour"),
    *("km", "units", "unit", "points", "feet", "foot", "minutes", "minute", "seconds"),
    *("digits", "cents", "degrees", "degree", "cm", "gm", "pounds", "meters", "meter"),
    *("meals", "edges", "students", "multiples"),
)
"""Unit words dropped from answers (as whole words), as in Minerva's normalisation."""

_ANSWER_LINE = re.compile(r"(?i:answer)\s*:\s*([^\n]+)")
_WRAPPER_COMMAND = re.compile(r"\\(?:boxed|textbf|text|mathrm|mbox|overline)\{")
_UNIT_WORDS = re.compile(r"(?<![A-Za-z\\])(?:" + "|".join(UNITS) + r")(?![A-Za-z])")
_DROPPED = ("\\$", "$", "^{\\circ}", "^\\circ", "\\circ", "\\,", "\\;", "\\!", "\\ ", "~", "{,}")
_FRAC_SHORTHAND = re.compile(r"\\frac([^{\s])([^{\s])")  # \frac12 -> \frac{1}{2}
_SQRT_SHORTHAND = re.compile(r"\\sqrt([^{\s])")  # \sqrt3 -> \sqrt{3}
_NUMBER_WITH_COMMAS = re.compile(r"\d{1,3}(?:,\d{3})+")


def extract_dapo_answer(response: str) -> str | None:
    """The text after the last ``Answer:`` (any case) of the response after its thinking,
    to the end of that line; None when there is no (non-empty) answer line.

    >>> extract_dapo_answer("Answer: 3\\nWait, no.\\nAnswer: $\\\\frac{1}{2}$")
    '$\\\\frac{1}{2}$'
    >>> extract_dapo_answer("<think>Answer: 1</think>I give up."), extract_dapo_answer("")
    (None, None)
    """
    last = last_match(_ANSWER_LINE, after_thinking(response))
    return (last.group(1).strip() or None) if last is not None else None


def normalize_final_answer(answer: str) -> str:
    """``answer`` normalised for comparison as text: wrappers (``\\boxed{}``, ``\\text{}``,
    ``$``) dropped, then the part after the last ``=`` kept, units dropped, ``\\dfrac`` and
    ``\\tfrac`` and TeX shorthand (``\\frac12``, ``\\sqrt3``) written out, spaces and thousands
    separators removed.

    >>> normalize_final_answer(r"x = \\boxed{\\dfrac12}"), normalize_final_answer("1,000 dollars.")
    ('\\\\frac{1}{2}', '1000')
    >>> normalize_final_answer(r"\\text{(B)}"), normalize_final_answer(r"45^\\circ")
    ('(B)', '45')
    >>> normalize_final_answer(r"3\\sqrt2 \\text{ cm}"), normalize_final_answer("(1, 2)")
    ('3\\\\sqrt{2}', '(1,2)')
    """
    answer = _unwrap(answer).split("=")[-1]
    for dropped in _DROPPED:
        answer = answer.replace(dropped, "")
    answer = _UNIT_WORDS.sub("", answer.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac"))
    answer = _SQRT_SHORTHAND.sub(r"\\sqrt{\1}", _FRAC_SHORTHAND.sub(r"\\frac{\1}{\2}", answer))
    answer = "".join(answer.split()).rstrip(".")
    if _NUMBER_WITH_COMMAS.fullmatch(answer):
        answer = answer.replace(",", "")
    return answer


def grade_dapo(ground_truth: str, response: str) -> tuple[bool, str | None]:
    """``(correct, normalised answer or None)`` for one response.

    >>> grade_dapo("1000", "So...\\nAnswer: 1,000 dollars"), grade_dapo("0.5", "Answer: 1/2")
    ((True, '1000'), (False, '1/2'))
    """
    answer = extract_dapo_answer(response)
    if answer is None:
        return False, None
    predicted, truth = normalize_final_answer(answer), normalize_final_answer(ground_truth)
    return bool(truth) and predicted == truth, predicted


def _unwrap(text: str) -> str:
    """``text`` with every wrapper command (``\\text{...}``, ``\\boxed{...}``, ...; nested braces
    balanced) replaced by its content, in one pass; an unclosed one is left as it is."""
    closing = closing_braces(text)
    dropped: set[int] = set()
    for command in _WRAPPER_COMMAND.finditer(text):
        brace = command.end() - 1
        if brace in closing:
            dropped.update(range(command.start(), command.end()))
            dropped.add(closing[brace])
    return "".join(ch for i, ch in enumerate(text) if i not in dropped)
