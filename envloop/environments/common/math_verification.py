"""Math answer equivalence with math-verify, in worker processes with hard timeouts.

**What is compared.** A response's final answer is its last ``\\boxed{...}`` (nested braces
balanced), read as one whole expression; a response without a box is read as free text
(math-verify's "answer is ..." and final-expression patterns). Text inside ``<think>``
... ``</think>`` is never the answer (see
:func:`~envloop.environments.common.answer_extraction.after_thinking`): a box drafted while thinking
loses to the answer given after it, and unfinished thinking gives no answer. The ground truth
is read whole as if boxed (its own last ``\\boxed{}`` when it has one).

**How math-verify is configured** (``parse`` with LaTeX and plain-expression extraction,
``verify`` with its defaults: floats rounded to 6 places, variables must match):

- ``extraction_mode="first_match"``: only the highest-priority, last match is read. With
  math-verify's default (``"any_match"``), an answer that does not parse as LaTeX falls back
  to whatever else parses, typically its trailing number, so ``\\boxed{Eq(x**2/16 + y**2/12,
  1)}`` and ``\\boxed{Eq(x**2/4 + y**2/3, 1)}`` were both read as ``1`` and "matched". Now
  an unparsable answer is compared as its whole text.
- An equation in variables is never read as a value: math-verify compares an equation
  answer's right-hand side with a plain-value ground truth (meant for ``x = 3`` vs ``3``,
  which still matches), which made ``x^2 + y^2 = 1`` match the ground truth ``1``.

**Normalisations of ours**, applied to the boxed answer and to the ground truth:

- sympy's printed relations, ``Eq(lhs, rhs)`` with ``**`` powers (as some datasets store
  ground truths), are rewritten as LaTeX ``lhs = rhs`` with ``^``, so they are compared as
  equations (a safe text rewrite: nothing is evaluated);
- a thin space between digit groups (``1\\,000``) is dropped, as math-verify already drops
  ``{,}`` and ``,`` separators.

**Processes and timeouts.** math-verify times itself out with ``signal.alarm``, which fails
off a process's main thread (thread pools, threaded or async Ray actors). :class:`MathVerifier`
runs every check on the main thread of a worker process of a
:class:`~envloop.environments.common.process_pool.HardTimeoutPool`:

- each worker warms up before taking checks (:func:`warm_up`: math-verify's LaTeX parser
  and sympy's first simplifications cost about a second), so a sample's time limit covers
  only its own check;
- each check is interrupted after ``timeout_s`` by ``SIGALRM`` inside its worker, which then
  goes straight on (restarting a worker costs seconds; a pathological answer such as
  ``\\boxed{9^{9^{9^{9}}}}`` is stopped this way);
- a worker stuck where no signal reaches it (a long C call) is killed after ``2 * timeout_s``
  and replaced, as is one that dies. Either way only that sample fails; the rest of the
  batch goes on.
"""

from __future__ import annotations

import logging
import re
import signal
from collections.abc import Sequence
from typing import Any, NamedTuple

# Imported here, not in grade_math: a (re)started worker pays for it while starting,
# never inside an item's time limit.
from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
from math_verify.grader import is_assignment_relation, is_equation, take_first_relation
from sympy import Basic

from envloop.environments.common.answer_extraction import after_thinking, extract_boxed
from envloop.environments.common.process_pool import HardTimeoutPool, Outcome

# math-verify warns once per process that its own timeouts are off: deliberate here.
logging.getLogger("math_verify").setLevel(logging.ERROR)

EXTRACTION = (LatexExtractionConfig(), ExprExtractionConfig())
"""What math-verify looks for: LaTeX (boxed or in math delimiters), then plain expressions."""


class MathGrade(NamedTuple):
    """One check's result, with what math-verify read from each side (its extracted text,
    empty when it found nothing)."""

    correct: bool
    gold: list[str]
    predicted: list[str]


def grade_math(pair: tuple[str, str]) -> MathGrade:
    """Whether the response's final answer equals ``ground_truth`` mathematically (see the
    module docstring), for ``pair = (ground_truth, response)``. Runs inside a worker process.

    >>> grade_math(("1/2", r"so the answer is \\boxed{\\frac{2}{4}}"))
    MathGrade(correct=True, gold=['\\\\frac{1}{2}'], predicted=['\\\\frac{2}{4}'])
    >>> grade_math(("Eq(x**2/4 + y**2/3, 1)", r"\\boxed{Eq(x**2/16 + y**2/12, 1)}")).correct
    False
    """
    ground_truth, response = pair
    gold = _parse(gold_text(ground_truth))
    predicted = _parse(final_answer_text(response))
    correct = any(_equivalent(g, p) for g in gold for p in predicted)
    return MathGrade(correct, _texts(gold), _texts(predicted))


def math_equivalent(pair: tuple[str, str]) -> bool:
    """:func:`grade_math`'s verdict alone, for ``pair = (ground_truth, response)``.

    >>> math_equivalent(("1/2", "so the answer is \\\\boxed{0.5}"))
    True
    >>> math_equivalent(("3", "\\\\boxed{4}")), math_equivalent(("1", "\\\\boxed{x^2 + y^2 = 1}"))
    (False, False)
    """
    return grade_math(pair).correct


def final_answer_text(response: str) -> str:
    """The text math-verify reads from ``response``: its last ``\\boxed{...}`` after any
    thinking (normalised), else that text whole.

    >>> final_answer_text(r"<think>\\boxed{3}</think> First \\boxed{4}, then \\boxed{5}.")
    '\\\\boxed{5}'
    >>> final_answer_text(r"\\boxed{Eq(x**2, 1)}"), final_answer_text("It is 7.")
    ('\\\\boxed{x^2 = 1}', 'It is 7.')
    """
    text = after_thinking(response)
    boxed = extract_boxed(text)
    return text if boxed is None else f"\\boxed{{{normalize_answer(boxed)}}}"


def gold_text(ground_truth: str) -> str:
    """The ground truth as math-verify reads it: boxed whole (its own last box when it has one).

    >>> gold_text("1,000"), gold_text(r"\\boxed{12}")
    ('\\\\boxed{1,000}', '\\\\boxed{12}')
    """
    boxed = extract_boxed(ground_truth)
    return f"\\boxed{{{normalize_answer(ground_truth if boxed is None else boxed)}}}"


def normalize_answer(content: str) -> str:
    """Our two rewrites before math-verify (see the module docstring): sympy's ``Eq(a, b)``
    and ``**`` as LaTeX, and thin spaces between digit groups dropped.

    >>> normalize_answer("Eq(x**2/4 + y**2/3, 1)"), normalize_answer(r"1\\,234\\,567")
    ('x^2/4 + y^2/3 = 1', '1234567')
    >>> normalize_answer("Eq(a, b) + Eq(c, d)")  # not one relation: only the powers change
    'Eq(a, b) + Eq(c, d)'
    """
    content = _THIN_SPACE_IN_NUMBER.sub("", content.replace("**", "^"))
    stripped = content.strip()
    if not (stripped.startswith("Eq(") and stripped.endswith(")")):
        return content
    inner = stripped[len("Eq(") : -1]
    comma = _only_top_level_comma(inner)
    return content if comma is None else f"{inner[:comma].strip()} = {inner[comma + 1 :].strip()}"


class MathVerifier:
    """Checks ``(ground_truth, response)`` pairs in ``num_workers`` processes.

    Each pair gets an :class:`Outcome`: ``value`` (a bool from :meth:`check`, a
    :class:`MathGrade` from :meth:`grade`), or ``error`` when the check timed out, raised, or
    crashed its worker (which is then replaced).
    """

    def __init__(self, num_workers: int = 2, timeout_s: float = 10.0) -> None:
        self.timeout_s = float(timeout_s)
        self.pool = HardTimeoutPool(verify_within, num_workers, 2 * self.timeout_s, warm_up)

    def grade(self, pairs: Sequence[tuple[str, str]]) -> list[Outcome]:
        """One :class:`Outcome` per ``(ground_truth, response)``, in order; values are
        :class:`MathGrade`."""
        return self.pool.map([(pair, self.timeout_s) for pair in pairs])

    def check(self, pairs: Sequence[tuple[str, str]]) -> list[Outcome]:
        """One :class:`Outcome` per ``(ground_truth, response)``, in order; values are bools."""
        return [
            o if o.error is not None else Outcome(value=o.value.correct) for o in self.grade(pairs)
        ]

    def close(self) -> None:
        self.pool.close()


def timed_out(error: str | None) -> bool:
    """Whether an :class:`Outcome` error is a timeout: the alarm inside the worker and the
    pool's hard kill both report ``timed out after N s``.

    >>> timed_out("TimeoutError: timed out after 1.0 s"), timed_out("timed out after 2.0 s")
    (True, True)
    >>> timed_out("worker process died (exit code -9)"), timed_out(None)
    (False, False)
    """
    return error is not None and "timed out after" in error


_WARM_UP_PAIRS = (
    ("1/2", r"\boxed{\frac{2}{4}}"),
    (r"\frac{\sqrt{3}}{2}", r"\boxed{\sin(\pi/3)}"),
    ("[1, 2)", r"\boxed{[1,2)}"),
    ("x^2+2x+1", r"\boxed{(x+1)^2}"),
    ("Eq(x**2, 1)", r"\boxed{x^2 = 1}"),
    ("3", "The answer is 3"),
)


def warm_up() -> None:
    """Runs once in each worker at start: pays math-verify's and sympy's one-time costs
    (the LaTeX parser's tables, lazy imports, first simplifications) with a few checks of
    each kind, outside any sample's time limit."""
    for pair in _WARM_UP_PAIRS:
        grade_math(pair)


def verify_within(task: tuple[tuple[str, str], float]) -> MathGrade:
    """Runs in a worker process: ``grade_math(pair)``, interrupted after ``timeout_s``."""
    pair, timeout_s = task
    signal.signal(signal.SIGALRM, _raise_timeout)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        return grade_math(pair)
    except _CheckTimedOut:
        raise TimeoutError(f"timed out after {timeout_s} s") from None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)


_THIN_SPACE_IN_NUMBER = re.compile(r"(?<=\d)\\[,;:! ](?=\d{3}(?!\d))")
_BRACKETS = {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}


def _parse(text: str) -> list[Any]:
    """math-verify's reading of ``text``: ``[sympy object, extracted text]``, ``[extracted
    text]`` when it does not parse, or ``[]`` when nothing was found."""
    return parse(text, EXTRACTION, extraction_mode="first_match", parsing_timeout=None)


def _equivalent(gold: Any, predicted: Any) -> bool:
    if _equation_in_variables(predicted) and not is_equation(gold):
        return False
    return bool(verify(gold, predicted, timeout_seconds=None))


def _equation_in_variables(expr: Any) -> bool:
    """An equation such as ``x^2 + y^2 = 1``: one whose left side is neither a variable
    (``x = 3``, an assignment) nor free of variables (``2 + 3 = 5``)."""
    if not isinstance(expr, Basic) or not is_equation(expr) or is_assignment_relation(expr):
        return False
    return bool(take_first_relation(expr).lhs.free_symbols)


def _texts(parsed: list[Any]) -> list[str]:
    return [item for item in parsed if isinstance(item, str)]


def _only_top_level_comma(text: str) -> int | None:
    """The index of the one comma outside brackets in ``text``, whose brackets balance;
    None otherwise."""
    depth, commas = 0, []
    for i, ch in enumerate(text):
        depth += _BRACKETS.get(ch, 0)
        if depth < 0:
            return None
        if ch == "," and depth == 0:
            commas.append(i)
    return commas[0] if depth == 0 and len(commas) == 1 else None


class _CheckTimedOut(BaseException):
    """Raised by the alarm; a BaseException so that library ``except Exception`` lets it by."""


def _raise_timeout(signum: int, frame: Any) -> None:
    raise _CheckTimedOut
