"""Math verification: a table of (ground truth, response) pairs with the verdicts mathematics
gives them, checked through a real MathVerifier (real math-verify in real worker processes),
plus the answer selection rules (last box, thinking) and our normalisations.

The verdicts were written from the mathematics, not from what the code returns: an answer is
correct exactly when it denotes the same object as the ground truth (the same number, set,
interval, tuple, matrix, expression, or the same equation: same solution set). Conventions
decided here: the LAST ``\\boxed{}`` is the answer; a box inside ``<think>...</think>`` is
drafting, not the answer; unfinished thinking gives no answer; units, ``$`` and degree signs
do not change a number; an assignment ``x = 3`` and the value ``3`` answer each other.
"""

from __future__ import annotations

import pytest

from envloop.environments.common.math_verification import (
    MathGrade,
    MathVerifier,
    final_answer_text,
    gold_text,
    normalize_answer,
    timed_out,
    warm_up,
)
from envloop.environments.rewards import close_math_verifiers, math_expr

MATRIX = r"\begin{pmatrix}1&2\\3&4\end{pmatrix}"

# category -> [(ground truth, response, correct?)]
TABLE: dict[str, list[tuple[str, str, bool]]] = {
    "equations": [
        # Different ellipses (x^2/16 + y^2/12 = 1 is x^2/4 + y^2/3 = 4), written as sympy.
        ("Eq(x**2/4 + y**2/3, 1)", r"\boxed{Eq(x**2/16 + y**2/12, 1)}", False),
        ("Eq(x**2/4 + y**2/3, 1)", r"\boxed{Eq(x**2/4 + y**2/3, 1)}", True),
        ("Eq(x**2/4 + y**2/3, 1)", r"\boxed{\frac{x^2}{4}+\frac{y^2}{3}=1}", True),
        (r"\frac{x^2}{4}+\frac{y^2}{3}=1", r"\boxed{\frac{x^2}{16}+\frac{y^2}{12}=1}", False),
        (r"\frac{x^2}{4}+\frac{y^2}{3}=1", r"\boxed{\frac{x^2}{4}+\frac{y^2}{3}=1}", True),
        ("y = 2x + 1", r"\boxed{y = 2x + 3}", False),
        ("y = 2x + 1", r"\boxed{y = 2x + 1}", True),
        ("y = 2x + 1", r"\boxed{2x - y + 1 = 0}", True),  # the same line rearranged
        ("y = 2x + 1", r"\boxed{x = 2y + 1}", False),  # the variables swapped
        ("x^2 + y^2 = 1", r"\boxed{y^2 + x^2 = 1}", True),
        ("x^2+y^2=4", r"\boxed{x^2+y^2=2}", False),
        ("x = 3", r"\boxed{3}", True),  # the value of an assignment
        ("3", r"\boxed{x = 3}", True),
        ("x = 3", r"\boxed{x = -3}", False),
        ("x = 1", r"\boxed{y = 1}", False),  # a different variable
        ("k = 2", r"\boxed{k = 3}", False),
        ("1", r"\boxed{x^2 + y^2 = 1}", False),  # an equation is not its right-hand side
        ("2", r"\boxed{y = 2x}", False),
        ("1", r"\boxed{f: x \mapsto 1}", False),  # unparsable: compared whole, not as its "1"
    ],
    "inequalities": [
        ("x > 3", r"\boxed{x > 3}", True),
        ("x > 3", r"\boxed{3 < x}", True),
        ("x > 3", r"\boxed{x \geq 3}", False),
        ("x > 3", r"\boxed{x < 3}", False),
        (r"x \le 5", r"\boxed{x > 5}", False),
        ("x=3", r"\boxed{x \geq 3}", False),
    ],
    "intervals": [
        ("(1,2]", r"\boxed{(1,2]}", True),
        ("(1,2]", r"\boxed{[1,2]}", False),
        ("[1,2]", r"\boxed{[1,2)}", False),
        (r"(-\infty, 3)", r"\boxed{(-\infty, 3)}", True),
        (r"(-\infty, 3)", r"\boxed{(-\infty, 3]}", False),
        (r"(0, \infty)", r"\boxed{(1, \infty)}", False),
        (r"[1,2] \cup [3,4]", r"\boxed{[3,4] \cup [1,2]}", True),
        (r"[1,2] \cup [3,4]", r"\boxed{[1,2] \cup (3,4]}", False),
    ],
    "sets": [
        (r"\{1,2,3\}", r"\boxed{\{3,1,2\}}", True),
        (r"\{-1, 1\}", r"\boxed{\{1, -1\}}", True),
        (r"\{1,2,3\}", r"\boxed{\{1,2\}}", False),
        (r"\{1,2,3\}", r"\boxed{\{1,2,4\}}", False),
    ],
    "tuples": [
        ("(1, 2)", r"\boxed{(1, 2)}", True),
        ("(1, 2, 3)", r"\boxed{(1, 3, 2)}", False),  # ordered
        ("(3, -4)", r"\boxed{(3, 4)}", False),
    ],
    "matrices": [
        (MATRIX, rf"\boxed{{{MATRIX}}}", True),
        (MATRIX, r"\boxed{\begin{pmatrix}1&3\\2&4\end{pmatrix}}", False),  # the transpose
        (r"\begin{pmatrix}1\\2\end{pmatrix}", r"\boxed{\begin{pmatrix}1\\2\end{pmatrix}}", True),
        (r"\begin{pmatrix}1\\2\end{pmatrix}", r"\boxed{\begin{pmatrix}2\\1\end{pmatrix}}", False),
    ],
    "fractions and decimals": [
        (r"\frac{1}{2}", r"\boxed{0.5}", True),
        (r"\frac{3}{4}", r"\boxed{0.75}", True),
        ("0.75", r"\boxed{\tfrac{3}{4}}", True),
        (r"\frac{1}{3}", r"\boxed{\frac{2}{6}}", True),
        (r"\dfrac{3}{4}", r"\boxed{\frac{3}{4}}", True),
        (r"\frac{5}{2}", r"\boxed{2\frac{1}{2}}", True),  # a mixed number
        (r"-\frac{1}{2}", r"\boxed{\frac{-1}{2}}", True),
        (r"\frac{1}{3}", r"\boxed{0.33}", False),  # an approximation
        (r"\frac{3}{4}", r"\boxed{\dfrac{4}{3}}", False),
        (r"\frac{1}{2}", r"\boxed{\frac{1}{3}}", False),
        (r"-\frac{1}{2}", r"\boxed{\frac{1}{2}}", False),
        ("0.5", r"\boxed{0.05}", False),
        (r"\frac{1}{2}", r"\boxed{\frac{1}{2}x}", False),
    ],
    "percent": [
        (r"25\%", r"\boxed{25\%}", True),
        (r"25\%", r"\boxed{0.25}", True),
        ("0.25", r"\boxed{25\%}", True),
        (r"25\%", r"\boxed{20\%}", False),
    ],
    "units": [
        ("10", r"\boxed{10 \text{ cm}}", True),
        ("10", r"\boxed{10\text{ meters}}", True),
        (r"\$12", r"\boxed{12}", True),
        ("10", r"\boxed{100 \text{ cm}}", False),
        (r"\$12", r"\boxed{\$13}", False),
    ],
    "thousands separators": [
        ("1000", r"\boxed{1,000}", True),
        ("1234567", r"\boxed{1,234,567}", True),
        ("1000", r"\boxed{1{,}000}", True),
        ("1000", r"\boxed{1\,000}", True),  # needs our thin-space normalisation
        ("1000", r"\boxed{1,001}", False),
    ],
    "negative numbers": [
        ("-5", r"\boxed{-5}", True),
        ("-2", r"\boxed{- 2}", True),
        ("-3.5", r"\boxed{-\frac{7}{2}}", True),
        ("-5", r"\boxed{5}", False),
        ("5", r"\boxed{-5}", False),
        (r"\infty", r"\boxed{-\infty}", False),
    ],
    "degrees": [
        ("30", r"\boxed{30^\circ}", True),
        (r"30^\circ", r"\boxed{30}", True),
        (r"45^\circ", r"\boxed{45^{\circ}}", True),
        ("30", r"\boxed{60^{\circ}}", False),
    ],
    "scientific notation": [
        ("1500", r"\boxed{1.5 \times 10^{3}}", True),
        ("0.00012", r"\boxed{1.2 \times 10^{-4}}", True),
        (r"3 \times 10^8", r"\boxed{3\cdot 10^{8}}", True),
        ("1500", r"\boxed{1.5 \times 10^{4}}", False),
        (r"6.02 \times 10^{23}", r"\boxed{6.02 \times 10^{22}}", False),
        ("10", r"\boxed{10^{2}}", False),
    ],
    "plain text": [
        (r"\text{Monday}", r"\boxed{\text{Monday}}", True),
        (r"\text{odd}", r"The number is \boxed{\text{odd}}.", True),
        ("C", r"\boxed{C}", True),
        (r"\text{Monday}", r"\boxed{\text{Tuesday}}", False),
        (r"\text{yes}", r"\boxed{\text{no}}", False),
        ("C", r"\boxed{D}", False),
    ],
    "several boxes: the last counts": [
        ("4", r"First \boxed{3}, but on checking, \boxed{4}", True),
        ("3", r"First \boxed{3}, but on checking, \boxed{4}", False),
        ("4", r"\boxed{3} or \boxed{4}", True),
        ("3", r"\boxed{3} or \boxed{4}", False),
    ],
    "thinking": [
        ("4", r"<think>maybe \boxed{3}</think> The answer is \boxed{4}", True),
        ("3", r"<think>maybe \boxed{3}</think> The answer is \boxed{4}", False),
        ("4", r"<think>it is \boxed{3}</think>The answer is 4.", True),
        ("3", r"<think>it is \boxed{3}</think>The answer is 4.", False),
        ("3", r"<think>so it is \boxed{3}", False),  # unfinished thinking: no answer
        # Thinking opened by the chat template: only "</think>" is in the response.
        ("4", r"it is \boxed{3}, hmm</think> so \boxed{4}", True),
        ("3", r"it is \boxed{3}, hmm</think> so \boxed{4}", False),
        ("5", "<think>2+3</think>\n\\boxed{5}", True),
    ],
    "expressions": [
        ("x^2+2x+1", r"\boxed{(x+1)^2}", True),
        (r"\frac{\sqrt{2}}{2}", r"\boxed{\frac{1}{\sqrt{2}}}", True),
        (r"2\sqrt{3}", r"\boxed{\sqrt{12}}", True),
        ("a+b", r"\boxed{b+a}", True),
        ("x^2+2x+1", r"\boxed{(x-1)^2}", False),
        (r"2\sqrt{3}", r"\boxed{3\sqrt{2}}", False),
        (r"\pi", r"\boxed{3.14}", False),
        (r"\sqrt{2}", r"\boxed{2}", False),
        ("a-b", r"\boxed{b-a}", False),
        ("5", r"\boxed{5x}", False),
    ],
    "plain numbers": [
        ("42", "The answer is 42.", True),
        ("42", r"\boxed{42.0}", True),
        ("12", r"The answer is $\frac{24}{2}$.", True),
        ("42", "The answer is 24.", False),
        ("3", r"\boxed{33}", False),
        ("7", "", False),
        ("7", "I cannot solve this.", False),
        ("12", "3 * 4 = 13", False),
    ],
}
PAIRS = [pair for rows in TABLE.values() for pair in rows]


@pytest.fixture(scope="module")
def verifier():
    verifier = MathVerifier(num_workers=2, timeout_s=10.0)
    yield verifier
    verifier.close()


def test_the_table_covers_each_category_both_ways():
    assert len(PAIRS) >= 80
    assert [name for name, rows in TABLE.items() if {c for *_, c in rows} != {True, False}] == []


def test_every_pair_gets_its_mathematical_verdict(verifier):
    outcomes = verifier.check([(truth, response) for truth, response, _ in PAIRS])
    assert [o.error for o in outcomes] == [None] * len(PAIRS)
    wrong = [
        (truth, response, expected)
        for (truth, response, expected), o in zip(PAIRS, outcomes)
        if o.value is not expected
    ]
    assert wrong == []


def test_grade_reports_what_was_read_from_each_side(verifier):
    grades = [
        o.value
        for o in verifier.grade(
            [
                ("1,000", r"<think>\boxed{7}</think>So \boxed{1\,000}."),
                ("3", "nothing to read here"),
                ("Eq(x**2, 1)", r"\boxed{Eq(x**2, 4)}"),
            ]
        )
    ]
    assert grades == [
        MathGrade(True, ["1,000"], ["1000"]),
        MathGrade(False, ["3"], []),
        MathGrade(False, ["x^2 = 1"], ["x^2 = 4"]),
    ]


def test_workers_warm_up_before_their_first_check(verifier):
    # the LaTeX parser's loading and sympy's first simplifications (about a second) are
    # paid at worker start, never inside the first sample's time limit
    assert verifier.pool.warm_up is warm_up
    assert [w.process.is_alive() for w in verifier.pool._workers] == [True, True]


def test_a_pathological_answer_times_out_with_a_timeout_error():
    # a short limit only where a timeout is the expected outcome: no limit fits this answer,
    # and the warmed-up worker checks "\boxed{1}" in about a millisecond
    verifier = MathVerifier(num_workers=1, timeout_s=2.0)
    try:
        slow, fast = verifier.check([("1", r"\boxed{9^{9^{9^{9}}}}"), ("1", r"\boxed{1}")])
    finally:
        verifier.close()
    assert slow.value is None and slow.error == "TimeoutError: timed out after 2.0 s"
    assert timed_out(slow.error)
    assert (fast.value, fast.error) == (True, None)


@pytest.mark.parametrize(
    "response, text",
    [
        (r"\boxed{1} then \boxed{\frac{1}{2}}", r"\boxed{\frac{1}{2}}"),
        (r"<think>\boxed{1}</think>The answer is 2.", "The answer is 2."),
        (r"<think>\boxed{1}", ""),
        (r"\boxed{2", r"\boxed{2"),  # unbalanced: no box, so free text
        (r"\boxed{Eq(y, 2*x**2)}", r"\boxed{y = 2*x^2}"),
    ],
)
def test_final_answer_text(response, text):
    assert final_answer_text(response) == text


@pytest.mark.parametrize(
    "content, normalized",
    [
        ("Eq(x**2/4 + y**2/3, 1)", "x^2/4 + y^2/3 = 1"),
        ("Eq(f(x, y), (1, 2))", "f(x, y) = (1, 2)"),  # only the top-level comma splits
        ("Eq(x, 1, 2)", "Eq(x, 1, 2)"),  # not one relation: unchanged
        ("Eq(x, 1) + Eq(y, 2)", "Eq(x, 1) + Eq(y, 2)"),
        (r"12\,345\,678", "12345678"),
        (r"1\,5", r"1\,5"),  # not a digit group of three
        (r"a\,b", r"a\,b"),
    ],
)
def test_normalize_answer(content, normalized):
    assert normalize_answer(content) == normalized


def test_gold_text_uses_the_ground_truths_own_box():
    assert gold_text(r"\boxed{12}") == r"\boxed{12}"
    assert gold_text(r"x \in \boxed{(1,2]}") == r"\boxed{(1,2]}"
    assert gold_text("Eq(x, 1)") == r"\boxed{x = 1}"


def test_the_vlm_math_expr_reward_gets_the_same_verdicts():
    responses = [
        "<answer>Eq(x**2/16 + y**2/12, 1)</answer>",
        r"<answer>\frac{x^2}{4}+\frac{y^2}{3}=1</answer>",
        r"<think>\boxed{1}</think> so \boxed{x^2 + y^2 = 1}",
    ]
    truths = ["Eq(x**2/4 + y**2/3, 1)", "Eq(x**2/4 + y**2/3, 1)", "1"]
    try:
        scores = math_expr(responses, truths, timeout_s=10.0)
    finally:
        close_math_verifiers()
    assert scores == [(0.0, False), (1.0, True), (0.0, False)]
