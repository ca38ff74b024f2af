"""The ``sliding_puzzle`` environment's options (:class:`SlidingPuzzleConfig`), their
defaults and their check (:func:`config_problems`). Imports nothing heavy: ``envloop run``
checks configs with it before starting Ray."""

from __future__ import annotations

from typing import Annotated, Any, cast

from pydantic import Field
from typing_extensions import TypedDict

from envloop.config import validation
from envloop.environments.utils import MaxParseChars


class SlidingPuzzleConfig(TypedDict, total=False):
    """Options of :class:`SlidingPuzzleEnv`; every field is optional."""

    default_size: Annotated[
        int, Field(3, ge=2, description="N of episodes from SlidingPuzzleEnv.new_episode_metadata")
    ]
    default_shuffle_moves: Annotated[
        int, Field(10, ge=1, description="scramble length of those episodes")
    ]
    default_max_moves: Annotated[int, Field(40, ge=1, description="move limit of those episodes")]
    reward_on_solve: Annotated[
        float, Field(1.0, description="reward of the move that solves the puzzle")
    ]
    move_penalty: Annotated[
        float, Field(0.0, ge=0, description="subtracted from every move's reward")
    ]
    max_parse_chars: MaxParseChars  # of each reply


DEFAULT_CONFIG = cast(SlidingPuzzleConfig, validation.declared_defaults(SlidingPuzzleConfig))


def config_problems(config: Any) -> list[str]:
    """Every problem of a ``sliding_puzzle`` config (None: the defaults), one line each.

    >>> config_problems({"default_size": 1, "move_penalty": -0.5})
    ['default_size: must be >= 2, got 1', 'move_penalty: must be >= 0, got -0.5']
    """
    return validation.config_problems(SlidingPuzzleConfig, config)
