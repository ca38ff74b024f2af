"""Options of the rollout engine, validated once with every problem reported."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from envloop.config.errors import ConfigError, config_from_mapping

if TYPE_CHECKING:
    from envloop.experience.rollout_metrics import RolloutProgress

ObservationFormat = Literal["raw", "chat_template"]
OnEnvError = Literal["record", "raise"]


@dataclass(frozen=True)
class RolloutOptions:
    """Keyword options of ``run_multi_turn_rollout``.

    >>> RolloutOptions.from_kwargs({"observation_format": "chat_template"}).on_env_error
    'record'
    """

    observation_format: ObservationFormat = "raw"
    """``raw``: observation content tokenized as is. ``chat_template``: rendered as a chat
    message by the tokenizer's template, followed by the next assistant prefix."""
    env_step_timeout_s: float | None = None
    """Seconds one environment step may take before its samples fail; None: no limit."""
    on_env_error: OnEnvError = "record"
    """``record``: a failing environment fails only its samples. ``raise``: fail fast."""
    env_max_retries: int = 1
    """Retries of a step whose Ray actor died (Ray restarts the actor in between)."""
    on_turn: Callable[[RolloutProgress], None] | None = None
    """Called after every turn with a :class:`~envloop.experience.rollout_metrics.RolloutProgress`
    (samples done, turns, generated tokens, seconds), e.g. to draw progress; None: nothing."""

    def __post_init__(self) -> None:
        problems = []
        if self.observation_format not in ("raw", "chat_template"):
            problems.append(
                f"observation_format: {self.observation_format!r} is not one of raw, chat_template"
            )
        if self.on_env_error not in ("record", "raise"):
            problems.append(f"on_env_error: {self.on_env_error!r} is not one of record, raise")
        timeout = self.env_step_timeout_s
        if timeout is not None and (not isinstance(timeout, (int, float)) or timeout <= 0):
            problems.append(f"env_step_timeout_s: {timeout!r} must be a positive number or None")
        if not isinstance(self.env_max_retries, int) or self.env_max_retries < 0:
            problems.append(f"env_max_retries: {self.env_max_retries!r} must be an int >= 0")
        if self.on_turn is not None and not callable(self.on_turn):
            problems.append(
                f"on_turn: {self.on_turn!r} is not callable; pass a function of one "
                "RolloutProgress, or None"
            )
        if problems:
            raise ConfigError("rollout options", problems)

    @classmethod
    def from_kwargs(cls, options: dict[str, Any]) -> RolloutOptions:
        """Build from keyword options, rejecting unknown names together with bad values."""
        return config_from_mapping(cls, options, "rollout options")
