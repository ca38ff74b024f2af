"""DAPO answers: the last "Answer:" line, Minerva-style normalisation, exact text comparison."""

from __future__ import annotations

import pytest

from envloop.environments.math.dapo_answers import (
    extract_dapo_answer,
    grade_dapo,
    normalize_final_answer,
)


@pytest.mark.parametrize(
    "response, answer",
    [
        ("Let me compute.\nAnswer: 42", "42"),
        ("answer: 7 \nThat is all.", "7"),  # any case; the rest of its line only
        ("Answer: 3\nNo, wait.\nANSWER: 4", "4"),  # the last one counts
        ("Answer:\n12", "12"),
        ("<think>Answer: 1</think>Answer: 2", "2"),
        ("<think>Answer: 1</think>So it is 2.", None),  # only a draft while thinking
        ("Answer: ", None),  # an empty answer line
        ("The answer is 5.", None),
        ("", None),
    ],
)
def test_extract_dapo_answer(response, answer):
    assert extract_dapo_answer(response) == answer


@pytest.mark.parametrize(
    "raw, normalized",
    [
        (r"\boxed{\dfrac{1}{2}}", r"\frac{1}{2}"),
        (r"\tfrac{3}{4}", r"\frac{3}{4}"),
        (r"\frac12", r"\frac{1}{2}"),
        (r"3\sqrt2", r"3\sqrt{2}"),
        ("1,000", "1000"),
        ("1,234,567", "1234567"),
        ("1,2", "1,2"),  # not a thousands separator
        ("(1, 2)", "(1,2)"),
        ("$5$", "5"),
        (r"\$5", "5"),
        (r"10 \text{ cm}", "10"),
        ("12 inches", "12"),
        ("5 students", "5"),
        ("1,000 dollars.", "1000"),
        (r"45^\circ", "45"),
        (r"45^{\circ}", "45"),
        ("x = 3", "3"),
        (r"\boxed{x = 5}", "5"),
        (r"\text{(B)}", "(B)"),
        (r"\textbf{\text{Monday}}", "Monday"),
        ("42.", "42"),
        (r"1\,000", "1000"),
        ("acme", "acme"),  # a unit inside a word stays
        (r"\text{unclosed", r"\text{unclosed"),  # an unclosed \text{ is left as it is
    ],
)
def test_normalize_final_answer(raw, normalized):
    assert normalize_final_answer(raw) == normalized


@pytest.mark.parametrize(
    "truth, response, expected",
    [
        ("1000", "So the total is...\nAnswer: 1,000 dollars", (True, "1000")),
        (r"\frac{1}{2}", r"Answer: $\dfrac12$", (True, r"\frac{1}{2}")),
        (r"\boxed{3\sqrt{2}}", r"Answer: 3\sqrt2", (True, r"3\sqrt{2}")),
        ("45", r"Answer: 45^\circ", (True, "45")),
        ("5", "Answer: x = 5", (True, "5")),
        ("B", r"Answer: \text{B}", (True, "B")),
        # Text comparison, no algebra: equal values written differently are wrong.
        (r"\frac{1}{2}", "Answer: 0.5", (False, "0.5")),
        ("4", "Answer: 3", (False, "3")),
        ("4", "Answer: 4\nAnswer: 5", (False, "5")),
        ("4", r"The answer is \boxed{4}.", (False, None)),  # no answer line
        ("", "Answer: ", (False, None)),  # an empty answer line is no line
        ("", "Answer: dollars", (False, "")),  # an empty truth matches nothing
    ],
)
def test_grade_dapo(truth, response, expected):
    assert grade_dapo(truth, response) == expected


def test_dapo_on_megabyte_adversarial_text():
    """Half-megabyte texts that make a backtracking pass quadratic (hours); the single-pass
    normalisation answers in well under a second. The result is asserted, not the time."""
    newlines = "answer:" + "\n" * 500_000
    braces = "\\text{" * 100_000 + "}" * 100_000
    words = "Answer" * 100_000
    assert [grade_dapo("1", t) for t in (newlines, braces, words)] == [(False, None)] * 3
    assert normalize_final_answer(newlines) == "answer:"
    assert normalize_final_answer(braces) == ""
    assert normalize_final_answer(words) == words
