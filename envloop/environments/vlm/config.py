"""The ``vlm`` environment's options (:class:`VLMEnvConfig`), their defaults and their check
(:func:`config_problems`, :func:`validated_config`). Imports nothing heavy (the built-in
reward functions load math-verify when first used): ``envloop run`` checks configs with it
before starting Ray."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, cast

from pydantic import Field
from typing_extensions import TypedDict

from envloop.config import validation
from envloop.config.errors import ConfigError
from envloop.environments.rewards import reward_config_problems
from envloop.environments.utils import MaxParseChars


class VLMEnvConfig(TypedDict, total=False):
    """Options of the ``vlm`` environment; every key is optional."""

    num_workers: Annotated[
        int, Field(1, ge=1, description="verify workers a batch is split across (Ray actors)")
    ]
    stop_strings: Annotated[
        list[validation.NonEmptyStr] | None,
        Field(None, description="the task's stop strings: ending on one = properly ended"),
    ]
    reward_functions: Annotated[
        list[Any],  # each entry a RewardFunctionConfig, checked by reward_config_problems
        Field(
            default_factory=lambda: [
                {"name": "format", "weight": 0.2},
                {"name": "exact_alnum", "weight": 0.8},
            ],
            description='the reward mix: [{"name", "weight", "kwargs"?}, ...]',
        ),
    ]
    max_parse_chars: MaxParseChars  # of the response, and of a text ground truth


DEFAULT_CONFIG = cast(VLMEnvConfig, validation.declared_defaults(VLMEnvConfig))


def config_problems(config: Any) -> list[str]:
    """Every problem of a ``vlm`` config (None: the defaults), one line each.

    >>> config_problems({"num_workers": 0, "reward_functions": [{"name": "format", "weight": -1}]})
    ['num_workers: must be >= 1, got 0', 'reward_functions[0].weight: must be > 0, got -1']
    """
    return _merged_and_problems(config)[1]


def validated_config(cfg: Mapping[str, Any] | None) -> VLMEnvConfig:
    """``cfg`` over the defaults; one :class:`ConfigError` lists every problem."""
    merged, problems = _merged_and_problems(cfg)
    if problems:
        raise ConfigError("VLMEnvConfig", problems)
    return cast(VLMEnvConfig, merged)


def _merged_and_problems(config: Any) -> tuple[dict[str, Any] | None, list[str]]:
    """``config`` over the defaults (None when its types are wrong) and its problems; the
    reward functions' names and options are checked too, wherever they are a list."""
    try:
        merged = validation.validated(VLMEnvConfig, config)
    except ConfigError as exc:
        functions = config.get("reward_functions") if isinstance(config, Mapping) else None
        extra = reward_config_problems(functions) if isinstance(functions, list) else []
        return None, exc.problems + extra
    return merged, reward_config_problems(merged["reward_functions"])
