"""Reward functions that score a batch of responses against ground truths, and their mix.

A reward function is called as ``fn(responses, ground_truths, **kwargs)`` with B responses
(str) and B ground truths, and returns B pairs ``(score, correct)``: ``score`` in [0, 1];
``correct`` a bool, or None when the function does not judge correctness (``format``).
Whole batches let ``math_expr`` check every answer at once in worker processes; math-verify
(and sympy) load when ``math_expr`` first runs, so checking a config that names it stays cheap.

Built-ins: ``format``, ``exact_alnum``, ``math_expr``, ``bbox_giou``; any other function is
named by import path, ``"mypkg.rewards:my_reward"``. :func:`combine_rewards` mixes several
by weights normalized to sum 1.

The answer is the content of the last ``<answer>...</answer>`` (tag configurable), or the
whole response when it has no such tag: a model that skips the tags can still be right, and
``format`` is the function that rewards using them. A malformed response scores 0; a function
that raises, or returns something other than B valid pairs, scores 0 on the samples it fails
on, and the error is reported in :attr:`RewardOutcome.errors`.
"""

from __future__ import annotations

import inspect
import math
import numbers
import re
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Annotated, Any, NamedTuple

from pydantic import Field, PydanticSchemaGenerationError
from typing_extensions import NotRequired, TypedDict

from envloop.config import validation
from envloop.config.errors import ConfigError, prefixed
from envloop.config.import_paths import import_from_path
from envloop.environments.common.answer_extraction import extract_tag, has_tag_pair
from envloop.environments.registry import unknown_name_message

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


RewardFn = Callable[..., Sequence[Score]]
"""``fn(responses: list[str], ground_truths: list[Any], **kwargs) -> B Score pairs``."""


class RewardFunctionConfig(TypedDict):
    """One entry of a reward mix."""

    name: Annotated[
        str, Field(description='a built-in name, or an import path "package.module:function"')
    ]
    weight: Annotated[
        float,
        Field(gt=0, allow_inf_nan=False, description="the weights of a mix are normalized"),
    ]
    kwargs: NotRequired[
        Annotated[dict[str, Any], Field(description="keyword options passed to the function")]
    ]


class RewardOutcome(NamedTuple):
    """One response's mixed reward."""

    score: float  # weighted score in [0, 1]
    correct: bool | None  # all functions that judge correctness say correct; None: none judges
    errors: list[str]  # "name: error" for each function that failed on it (and scored it 0)


REWARD_FUNCTIONS: dict[str, RewardFn] = {
    "format": format_reward,
    "exact_alnum": exact_alnum,
    "math_expr": math_expr,
    "bbox_giou": bbox_giou,
}
"""The built-in reward functions by name."""


def get_reward_function(name_or_path: str) -> RewardFn:
    """A built-in reward function by name, or a function by import path ``"module:function"``.

    >>> get_reward_function("exact_alnum") is exact_alnum
    True
    >>> get_reward_function("fromat")
    Traceback (most recent call last):
    ...
    ValueError: No reward function named 'fromat'. Known: bbox_giou, exact_alnum, format, \
math_expr. Did you mean 'format'? Custom functions go by import path 'package.module:function'.
    """
    if name_or_path in REWARD_FUNCTIONS:
        return REWARD_FUNCTIONS[name_or_path]
    if ":" not in name_or_path:
        hint = "Custom functions go by import path 'package.module:function'."
        if "." in name_or_path:
            raise ValueError(f"Reward function {name_or_path!r} lacks ':'. {hint}")
        known = sorted(REWARD_FUNCTIONS)
        raise ValueError(f"{unknown_name_message('reward function', name_or_path, known)} {hint}")
    what = f"Reward function {name_or_path!r}"
    return import_from_path(name_or_path, what, "function", callable)


def reward_config_problems(configs: Any, what: str = "reward_functions") -> list[str]:
    """Every problem of a list of :class:`RewardFunctionConfig`: missing or unknown keys, bad
    types, non-positive weights, unknown functions, keyword options they do not take."""
    if not isinstance(configs, list) or not configs:
        return [f"{what}: expected a non-empty list of {{'name', 'weight', 'kwargs'?}} dicts"]
    problems = []
    for i, entry in enumerate(configs):
        where = f"{what}[{i}]"
        problems += prefixed(validation.config_problems(RewardFunctionConfig, entry), where)
        if not isinstance(entry, Mapping) or not isinstance(entry.get("name"), str):
            continue
        try:
            fn = get_reward_function(entry["name"])
        except (ValueError, ImportError) as exc:
            problems.append(f"{where}.name: {exc}")
            continue
        if isinstance(entry.get("kwargs", {}), Mapping):
            problems += _kwargs_problems(fn, dict(entry.get("kwargs", {})), f"{where}.kwargs")
    return problems


def combine_rewards(
    reward_configs: list[RewardFunctionConfig], responses: list[str], ground_truths: list[Any]
) -> list[RewardOutcome]:
    """Score each response with every configured function and mix by normalized weights.

    >>> mix = [{"name": "format", "weight": 1}, {"name": "exact_alnum", "weight": 3}]
    >>> responses = ["<answer>b</answer>", "<think>.</think><answer>c</answer>"]
    >>> for outcome in combine_rewards(mix, responses, ["B", "B"]):
    ...     print(outcome)
    RewardOutcome(score=0.875, correct=True, errors=[])
    RewardOutcome(score=0.25, correct=False, errors=[])
    """
    problems = reward_config_problems(reward_configs)
    if problems:
        raise ConfigError("reward_functions", problems)
    total_weight = math.fsum(c["weight"] for c in reward_configs)
    columns = [
        (c["weight"] / total_weight, _score_batch(c, list(responses), list(ground_truths)))
        for c in reward_configs
    ]
    return [_mix([(w, column[i]) for w, column in columns]) for i in range(len(responses))]


_Scored = tuple[float, bool | None, str | None]  # (score, correct, error)


def _score_batch(
    config: RewardFunctionConfig, responses: list[str], truths: list[Any]
) -> list[_Scored]:
    """The function's scores on the batch; if the batch call fails, one call per sample, so
    only the samples it fails on score 0 (with the error)."""
    fn, kwargs = get_reward_function(config["name"]), config.get("kwargs", {})
    try:
        return [(s, c, None) for s, c in _checked(fn(responses, truths, **kwargs), len(responses))]
    except Exception:
        return [_score_one(config["name"], fn, kwargs, r, t) for r, t in zip(responses, truths)]


def _score_one(
    name: str, fn: RewardFn, kwargs: dict[str, Any], response: str, truth: Any
) -> _Scored:
    try:
        ((score, correct),) = _checked(fn([response], [truth], **kwargs), 1)
    except Exception as exc:
        return 0.0, False, f"{name}: {type(exc).__name__}: {exc}"[:300]
    return score, correct, None


def _checked(result: Any, n: int) -> list[Score]:
    """``result`` as ``n`` (score, correct) pairs (a bare number means correct=None)."""
    if not isinstance(result, Sequence):
        raise ValueError(f"returned a {type(result).__name__}, not a list of {n} scores")
    if len(result) != n:
        raise ValueError(f"returned {len(result)} scores for {n} responses")
    pairs = [item if isinstance(item, tuple) else (item, None) for item in result]
    for pair in pairs:
        if len(pair) != 2 or not _is_unit_number(pair[0]):
            raise ValueError(f"returned {pair!r}; expected (score in [0, 1], bool or None)")
        if pair[1] is not None and not isinstance(pair[1], bool):
            raise ValueError(f"returned correctness {pair[1]!r}; expected True, False or None")
    return [(float(score), correct) for score, correct in pairs]


def _is_unit_number(value: Any) -> bool:
    real = isinstance(value, numbers.Real) and not isinstance(value, bool)
    return real and 0.0 <= value <= 1.0


def _mix(weighted: list[tuple[float, _Scored]]) -> RewardOutcome:
    score = min(1.0, math.fsum(w * s for w, (s, _, _) in weighted))
    judged = [c for _, (_, c, _) in weighted if c is not None]
    errors = [e for _, (_, _, e) in weighted if e is not None]
    return RewardOutcome(score, all(judged) if judged else None, errors)


def _kwargs_problems(fn: RewardFn, kwargs: dict[str, Any], where: str) -> list[str]:
    """Keyword options ``fn`` does not take (with a close match), or of the wrong type."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return []  # nothing to check against (some builtins)
    params = list(signature.parameters.values())[2:]
    named = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if any(p.kind is p.VAR_KEYWORD for p in params):
        kwargs = {k: v for k, v in kwargs.items() if k in named}  # it takes any other key
    try:
        hints = typing.get_type_hints(fn)
    except Exception:
        hints = {}
    fields = {n: hints.get(n, Any) for n in named}
    spec = TypedDict("RewardKwargs", fields, total=False)  # type: ignore[misc]
    try:
        problems = prefixed(validation.config_problems(spec, kwargs), where)
    except PydanticSchemaGenerationError:  # a parameter type pydantic cannot check
        problems = []
    try:
        signature.bind([], [], **{k: v for k, v in kwargs.items() if k in named})
    except TypeError as exc:
        problems.append(f"{where}: cannot call it as fn(responses, ground_truths, **kwargs): {exc}")
    return problems


__all__ = [
    "REWARD_FUNCTIONS",
    "RewardFn",
    "RewardFunctionConfig",
    "RewardOutcome",
    "Score",
    "bbox_giou",
    "close_math_verifiers",
    "combine_rewards",
    "exact_alnum",
    "extract_answer",
    "format_reward",
    "get_reward_function",
    "iou_and_giou",
    "math_expr",
    "parse_box",
    "reward_config_problems",
]
