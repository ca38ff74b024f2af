"""What a valid ``EnvironmentReturn`` looks like, as a list of every violation found."""

from __future__ import annotations

from typing import Any

import torch

from envloop.data.content_parts import is_message_content
from envloop.environments.interfaces import EnvironmentReturn


def coerce_env_return(value: Any) -> EnvironmentReturn:
    """Accept an ``EnvironmentReturn`` or a plain 5/6/7-tuple of its fields."""
    if isinstance(value, EnvironmentReturn):
        return value
    if isinstance(value, tuple) and len(value) in (5, 6, 7):
        return EnvironmentReturn(*value)
    raise TypeError(
        f"step() returned a {type(value).__name__}; it must return an EnvironmentReturn."
    )


def env_return_problems(ret: EnvironmentReturn, batch_size: int) -> list[str]:
    """Every way ``ret`` breaks the contract for a batch of ``batch_size`` samples.

    >>> ok = EnvironmentReturn([{"role": "user", "content": "hi"}], [None], [None],
    ...                        torch.tensor([1.0]), torch.tensor([True]))
    >>> env_return_problems(ok, 1)
    []
    >>> for problem in env_return_problems(ok._replace(terminateds=torch.tensor([1, 0])), 1):
    ...     print(problem)
    terminateds: expected shape [1], got [2]
    terminateds: expected a bool tensor, got torch.int64
    """
    n = batch_size
    problems = _list_problems("observations", ret.observations, n)
    problems += _list_problems("metadata", ret.metadata, n)
    problems += _list_problems("next_stop_strings", ret.next_stop_strings, n)
    if ret.answers is not None:
        problems += _list_problems("answers", ret.answers, n)
    if ret.errors is not None:
        problems += _list_problems("errors", ret.errors, n) or _error_problems(ret.errors)
    if isinstance(ret.observations, list):
        problems += _observation_problems(ret.observations)
    if isinstance(ret.next_stop_strings, list):
        problems += _stop_string_problems(ret.next_stop_strings)
    problems += _reward_problems(ret.rewards, n)
    problems += _tensor_problems("terminateds", ret.terminateds, n, torch.bool)
    return problems


def nonfinite_rewards(ret: EnvironmentReturn) -> dict[int, str]:
    """The samples of a structurally valid ``ret`` whose reward (or a reward component) is
    NaN or infinite, each with what is wrong: a breach of the contract, since one such value
    poisons the normalisation of a whole GRPO group.

    >>> nan, inf = float("nan"), float("inf")
    >>> ret = EnvironmentReturn([None] * 3, [None] * 3, [None] * 3,
    ...                         {"reward/a": torch.tensor([1.0, nan, inf]),
    ...                          "reward/b": torch.tensor([0.0, 0.0, -inf])},
    ...                         torch.ones(3, dtype=torch.bool))
    >>> nonfinite_rewards(ret)
    {1: "rewards['reward/a'] is nan", 2: "rewards['reward/a'] is inf, rewards['reward/b'] is -inf"}
    """
    rewards = ret.rewards if isinstance(ret.rewards, dict) else {None: ret.rewards}
    found: dict[int, list[str]] = {}
    for key, values in rewards.items():
        name = "reward" if key is None else f"rewards[{key!r}]"
        bad = (~torch.isfinite(values.detach())).nonzero().flatten().tolist()
        for i in bad:
            found.setdefault(i, []).append(f"{name} is {values[i].item()}")
    return {i: ", ".join(found[i]) for i in sorted(found)}


NONFINITE_HINT = "rewards must be finite numbers (a NaN or inf would poison its group's advantages)"


def _list_problems(name: str, value: Any, n: int) -> list[str]:
    if not isinstance(value, list):
        return [f"{name}: expected a list of {n}, got {type(value).__name__}"]
    if len(value) != n:
        return [f"{name}: expected {n} entries (one per sample), got {len(value)}"]
    return []


def _observation_problems(observations: list[Any]) -> list[str]:
    for i, obs in enumerate(observations):
        ok = isinstance(obs, dict) and isinstance(obs.get("role"), str)
        if not ok or not is_message_content(obs.get("content")):
            return [
                f"observations[{i}]: expected {{'role': str, 'content': str or a list of "
                f"text/image parts}}, got {obs!r:.80}"
            ]
    return []


def _error_problems(errors: list[Any]) -> list[str]:
    for i, error in enumerate(errors):
        if error is not None and not (isinstance(error, str) and error):
            return [f"errors[{i}]: expected None or a non-empty str, got {error!r:.80}"]
    return []


def _stop_string_problems(stop_strings: list[Any]) -> list[str]:
    for i, item in enumerate(stop_strings):
        if item is None:
            continue
        if not isinstance(item, list) or not all(isinstance(s, str) and s for s in item):
            expected = "None or a list of non-empty str"
            return [f"next_stop_strings[{i}]: expected {expected}, got {item!r:.80}"]
    return []


def _reward_problems(rewards: Any, n: int) -> list[str]:
    if isinstance(rewards, dict):
        problems = []
        for key, value in rewards.items():
            if not (isinstance(key, str) and key.startswith("reward/") and len(key) > 7):
                problems.append(f"rewards: dict key {key!r} must look like 'reward/<name>'")
            problems += _tensor_problems(f"rewards[{key!r}]", value, n, "float")
        return problems or ([] if rewards else ["rewards: the dict is empty"])
    return _tensor_problems("rewards", rewards, n, "float")


def _tensor_problems(name: str, value: Any, n: int, dtype: torch.dtype | str) -> list[str]:
    if not isinstance(value, torch.Tensor):
        return [f"{name}: expected a tensor of shape [{n}], got {type(value).__name__}"]
    problems = []
    if tuple(value.shape) != (n,):
        problems.append(f"{name}: expected shape [{n}], got {list(value.shape)}")
    if dtype == "float" and not value.is_floating_point():
        problems.append(f"{name}: expected a float tensor, got {value.dtype}")
    if isinstance(dtype, torch.dtype) and value.dtype != dtype:
        problems.append(f"{name}: expected a bool tensor, got {value.dtype}")
    return problems
