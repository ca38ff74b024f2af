"""The built-in reward functions (see :mod:`envloop.environments.rewards` for the API).

Each is called as ``fn(responses, ground_truths, **kwargs)`` and returns one
``(score in [0, 1], correct or None)`` pair per response. math-verify (and sympy) load when
``math_expr`` first runs, so that checking a config that names these functions stays cheap.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from envloop.environments.common.answer_extraction import extract_tag, has_tag_pair

if TYPE_CHECKING:
    from envloop.environments.common.math_verification import MathVerifier

Score = tuple[float, bool | None]
"""One response's ``(score in [0, 1], correct or None)``."""


def extract_answer(response: str, tag: str = "answer") -> str:
    """The stripped content of the last ``<tag>...</tag>``, or the whole stripped response.

    >>> extract_answer("<think>hm</think><answer> B </answer>"), extract_answer(" B ")
    ('B', 'B')
    """
    tagged = extract_tag(response, tag)
    return tagged if tagged is not None else response.strip()


def format_reward(
    responses: list[str],
    ground_truths: list[Any],
    think_tag: str = "think",
    answer_tag: str = "answer",
) -> list[Score]:
    """0.5 for a ``<think>...</think>`` pair plus 0.5 for an ``<answer>...</answer>`` pair.

    >>> format_reward(["<think>a</think><answer>b</answer>", "<answer>b</answer>", "b"], [0] * 3)
    [(1.0, None), (0.5, None), (0.0, None)]
    """
    return [
        (0.5 * has_tag_pair(r, think_tag) + 0.5 * has_tag_pair(r, answer_tag), None)
        for r in responses
    ]


def exact_alnum(
    responses: list[str], ground_truths: list[Any], answer_tag: str = "answer"
) -> list[Score]:
    """1 when the answer equals the ground truth once both keep only letters and digits,
    lower-cased; an answer with no letters or digits is never correct.

    >>> exact_alnum(["<answer>(B).</answer>", "The answer: b", "<answer>C</answer>"], ["b"] * 3)
    [(1.0, True), (0.0, False), (0.0, False)]
    """
    scores: list[Score] = []
    for response, truth in zip(responses, ground_truths):
        answer = _alnum(extract_answer(response, answer_tag))
        correct = bool(answer) and answer == _alnum(str(truth))
        scores.append((float(correct), correct))
    return scores


def math_expr(
    responses: list[str],
    ground_truths: list[Any],
    answer_tag: str = "answer",
    timeout_s: float = 10.0,
    processes: int = 1,
) -> list[Score]:
    """1 when math-verify finds the answer equal to the ground truth. A tagged answer is
    read as one expression (``\\boxed{}`` added when missing); an untagged response as free
    text (its last ``\\boxed{}`` or final expression). Checks run in ``processes`` worker
    processes of this process; one that takes over ``timeout_s`` scores 0.
    """
    pairs = [
        (str(truth), _math_answer(r, answer_tag)) for r, truth in zip(responses, ground_truths)
    ]
    if not pairs:
        return []
    outcomes = _math_verifier(float(timeout_s), int(processes)).check(pairs)
    return [(1.0, True) if outcome.value is True else (0.0, False) for outcome in outcomes]


def bbox_giou(
    responses: list[str],
    ground_truths: list[Any],
    answer_tag: str = "answer",
    iou_threshold: float = 0.5,
) -> list[Score]:
    """Generalized IoU of the answer's last ``[x1, y1, x2, y2]`` box with the ground truth box
    (a 4-number list, or text holding one), mapped from [-1, 1] to [0, 1] as
    ``(giou + 1) / 2`` rather than clipped, so apart boxes still score more the closer
    they are; correct when IoU >= ``iou_threshold``. No valid box (x1 < x2, y1 < y2): 0.

    >>> bbox_giou(["<answer>[0, 0, 2, 2]</answer>", "[0, 0, 1, 1]", "none"], [[0, 0, 2, 2]] * 3)
    [(1.0, True), (0.625, False), (0.0, False)]
    """
    scores: list[Score] = []
    for response, truth in zip(responses, ground_truths):
        box, true_box = parse_box(extract_answer(response, answer_tag)), _truth_box(truth)
        if box is None:
            scores.append((0.0, False))
            continue
        iou, giou = iou_and_giou(box, true_box)
        scores.append(((giou + 1.0) / 2.0, iou >= iou_threshold))
    return scores


def _alnum(text: str) -> str:
    return "".join(ch for ch in text if ch.isalnum()).lower()


def _math_answer(response: str, tag: str) -> str:
    tagged = extract_tag(response, tag)
    if tagged is None:
        return response
    return tagged if "\\boxed{" in tagged else f"\\boxed{{{tagged}}}"


_VERIFIERS: dict[tuple[float, int], MathVerifier] = {}


def _math_verifier(timeout_s: float, processes: int) -> MathVerifier:
    """This process's verifier for these settings, started on first use."""
    from envloop.environments.common.math_verification import MathVerifier

    if (timeout_s, processes) not in _VERIFIERS:
        _VERIFIERS[(timeout_s, processes)] = MathVerifier(processes, timeout_s)
    return _VERIFIERS[(timeout_s, processes)]


def close_math_verifiers() -> None:
    """Stop this process's ``math_expr`` worker processes (they restart on the next use)."""
    while _VERIFIERS:
        _VERIFIERS.popitem()[1].close()


# Atomic groups and possessive spaces: a number or a run of spaces is read once, the longest
# way (no shorter reading could be followed by what the box needs next), so "[" followed by
# a megabyte of digits costs one scan, not one per way of splitting the digits.
_NUMBER = r"[-+]?(?>\d+\.?\d*|\.\d+)(?>[eE][-+]?\d+)?"
_BOX = re.compile(r"\[\s*+" + r"\s*+,\s*+".join([f"({_NUMBER})"] * 4) + r"\s*+\]")


def parse_box(text: str) -> tuple[float, float, float, float] | None:
    """The last ``[x1, y1, x2, y2]`` in ``text`` with x1 < x2 and y1 < y2; None otherwise.

    >>> parse_box("at [10, 20.5, 30, 40] or [1, 2, 3, 4]"), parse_box("[3, 0, 1, 1]")
    ((1.0, 2.0, 3.0, 4.0), None)
    """
    matches = _BOX.findall(text)
    if not matches:
        return None
    x1, y1, x2, y2 = (float(v) for v in matches[-1])
    return (x1, y1, x2, y2) if x1 < x2 and y1 < y2 else None


def iou_and_giou(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    """IoU in [0, 1] and generalized IoU in [-1, 1] of two valid ``[x1, y1, x2, y2]`` boxes.

    >>> iou_and_giou([0, 0, 1, 1], [2, 0, 3, 1])
    (0.0, -0.3333333333333333)
    """
    inter = _span(max(a[0], b[0]), min(a[2], b[2])) * _span(max(a[1], b[1]), min(a[3], b[3]))
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    hull = (max(a[2], b[2]) - min(a[0], b[0])) * (max(a[3], b[3]) - min(a[1], b[1]))
    iou = inter / union
    return iou, iou - (hull - union) / hull


def _span(low: float, high: float) -> float:
    return max(0.0, high - low)


def _truth_box(truth: Any) -> tuple[float, float, float, float]:
    box = parse_box(str(list(truth)) if isinstance(truth, (list, tuple)) else str(truth))
    if box is None:
        raise ValueError(f"ground truth {truth!r} is not a box [x1, y1, x2, y2] with x1<x2, y1<y2")
    return box
