"""The ``vlm`` environment's options (:class:`VLMEnvConfig`), their defaults and their check
(:func:`config_problems`, :func:`validated_config`). Imports nothing heavy (the built-in
reward functions load math-verify when first used): ``envloop run`` checks configs with it
before starting Ray."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from typing_extensions import TypedDict

from envloop.config.errors import ConfigError, typed_dict_problems
from envloop.environments.rewards import RewardFunctionConfig, reward_config_problems


class VLMEnvConfig(TypedDict, total=False):
    """Options of the ``vlm`` environment; every key is optional (see ``DEFAULT_CONFIG``)."""

    num_workers: int  # verify workers a batch is split across (Ray actors when Ray runs)
    stop_strings: list[str] | None  # the task's stop strings: ending on one = properly ended
    reward_functions: list[RewardFunctionConfig]  # [{"name", "weight", "kwargs"?}, ...]


DEFAULT_CONFIG: VLMEnvConfig = {
    "num_workers": 1,
    "stop_strings": None,
    "reward_functions": [{"name": "format", "weight": 0.2}, {"name": "exact_alnum", "weight": 0.8}],
}


def config_problems(config: Any) -> list[str]:
    """Every problem of a ``vlm`` config (None: the defaults), one line each.

    >>> config_problems({"num_workers": 0, "reward_functions": [{"name": "format", "weight": -1}]})
    ['num_workers: must be >= 1, got 0', 'reward_functions[0].weight: must be a positive number, \
got -1']
    """
    return _merged_and_problems(config)[1]


def validated_config(cfg: Mapping[str, Any] | None) -> VLMEnvConfig:
    """``cfg`` over the defaults; one :class:`ConfigError` lists every problem."""
    merged, problems = _merged_and_problems(cfg)
    if problems:
        raise ConfigError("VLMEnvConfig", problems)
    return merged


def _merged_and_problems(cfg: Any) -> tuple[Any, list[str]]:
    given = dict(cfg) if isinstance(cfg, Mapping) else cfg
    problems = typed_dict_problems({} if given is None else given, VLMEnvConfig, "VLMEnvConfig")
    merged: Any = copy.deepcopy({**DEFAULT_CONFIG, **(given if isinstance(given, dict) else {})})
    if isinstance(merged["num_workers"], int) and merged["num_workers"] < 1:
        problems.append(f"num_workers: must be >= 1, got {merged['num_workers']}")
    if isinstance(merged["stop_strings"], list) and not all(
        isinstance(s, str) and s for s in merged["stop_strings"]
    ):
        problems.append("stop_strings: every stop string must be a non-empty str")
    if isinstance(merged["reward_functions"], list):
        problems += reward_config_problems(merged["reward_functions"])
    return merged, problems
