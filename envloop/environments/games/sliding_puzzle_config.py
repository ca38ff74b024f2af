"""The ``sliding_puzzle`` environment's options (:class:`SlidingPuzzleConfig`), their
defaults and their check (:func:`config_problems`). Imports nothing heavy: ``envloop run``
checks configs with it before starting Ray."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypedDict

from envloop.config.errors import typed_dict_problems


class SlidingPuzzleConfig(TypedDict, total=False):
    """Options of :class:`SlidingPuzzleEnv`; every field is optional."""

    default_size: int  # N of episodes from SlidingPuzzleEnv.new_episode_metadata (3)
    default_shuffle_moves: int  # scramble length of those episodes, >= 1 (10)
    default_max_moves: int  # move limit of those episodes, >= 1 (40)
    reward_on_solve: float  # reward of the move that solves the puzzle (1.0)
    move_penalty: float  # subtracted from every move's reward, >= 0 (0.0)


DEFAULT_CONFIG = SlidingPuzzleConfig(
    default_size=3, default_shuffle_moves=10, default_max_moves=40, reward_on_solve=1.0,
    move_penalty=0.0,
)  # fmt: skip
_MINIMUM = {
    "default_size": 2,
    "default_shuffle_moves": 1,
    "default_max_moves": 1,
    "move_penalty": 0,
}


def config_problems(config: Any) -> list[str]:
    """Every problem of a ``sliding_puzzle`` config (None: the defaults), one line each.

    >>> config_problems({"default_size": 1, "move_penalty": -0.5})
    ['default_size: must be >= 2, got 1', 'move_penalty: must be >= 0, got -0.5']
    """
    if config is None:
        return []
    problems = typed_dict_problems(config, SlidingPuzzleConfig, "sliding_puzzle config")
    values = config if isinstance(config, Mapping) else {}
    return problems + [
        f"{key}: must be >= {low}, got {values[key]!r}"
        for key, low in _MINIMUM.items()
        if isinstance(values.get(key), (int, float)) and values[key] < low
    ]
