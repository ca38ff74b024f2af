"""Reward functions that score a batch of responses against ground truths, and their mix.

(The built-in functions live in :mod:`envloop.environments.vlm.reward_functions`.)

A reward function is called as ``fn(responses, ground_truths, **kwargs)`` with B responses
(str) and B ground truths, and returns B pairs ``(score, correct)``: ``score`` in [0, 1];
``correct`` a bool, or None when the function does not judge correctness (``format``).
Whole batches let ``math_expr`` check every answer at once in worker processes.

Built-ins: ``format``, ``exact_alnum``, ``math_expr``, ``bbox_giou``; any other function is
named by import path, ``"mypkg.rewards:my_reward"``. :func:`combine_rewards` mixes several
by weights normalized to sum 1.

The answer is the content of the last ``<answer>...</answer>`` (tag configurable), or the
whole response when it has no such tag: a model that skips the tags can still be right, and
``format`` is the function that rewards using them. A malformed response scores 0; a function
that raises, or returns something other than B valid pairs, scores 0 on the samples it fails
on, and the error is reported in :attr:`RewardOutcome.errors`.
"""

import inspect
import math
import numbers
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, NamedTuple

from pydantic import Field, PydanticSchemaGenerationError
from typing_extensions import NotRequired, TypedDict

from envloop.config import validation
from envloop.config.errors import ConfigError, prefixed
from envloop.config.import_paths import import_from_path
from envloop.environments.registry import unknown_name_message
from envloop.environments.vlm.reward_functions import (
    Score,
    bbox_giou,
    close_math_verifiers,
    exact_alnum,
    extract_answer,
    format_reward,
    iou_and_giou,
    math_expr,
    parse_box,
)

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
