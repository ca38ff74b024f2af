"""Options of the rollout engine, declared once and validated once with every problem
reported (:func:`envloop.config.validation.built`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import Field

from envloop.config import validation

ObservationFormat = Literal["raw", "chat_template"]
OnEnvError = Literal["record", "raise"]


@validation.config_dataclass("rollout options")
class RolloutOptions:
    """Keyword options of ``run_multi_turn_rollout``.

    >>> RolloutOptions.from_kwargs({"observation_format": "chat_template"}).on_env_error
    'record'
    >>> RolloutOptions.from_kwargs({"env_step_timeout_s": 0, "env_max_retries": True})
    Traceback (most recent call last):
    ...
    envloop.config.errors.ConfigError: Invalid rollout options:
      - env_step_timeout_s: must be > 0, got 0
      - env_max_retries: expected int, got bool (True)
    """

    observation_format: ObservationFormat = "raw"
    """``raw``: observation content tokenized as is. ``chat_template``: rendered as a chat
    message by the tokenizer's template, followed by the next assistant prefix."""
    env_step_timeout_s: Annotated[float | None, Field(gt=0, allow_inf_nan=False)] = None
    """Seconds one environment step may take before its samples fail; None: no limit."""
    on_env_error: OnEnvError = "record"
    """``record``: a failing environment fails only its samples. ``raise``: fail fast."""
    env_max_retries: Annotated[int, Field(ge=0)] = 1
    """Retries of a step whose Ray actor died (Ray restarts the actor in between)."""
    on_turn: Callable[[Any], None] | None = None  # no torch import here: run configs use it
    """Called after every turn with a :class:`~envloop.experience.rollout_metrics.RolloutProgress`
    (samples done, turns, generated tokens, seconds), e.g. to draw progress; None: nothing."""

    @classmethod
    def from_kwargs(cls, options: dict[str, Any]) -> RolloutOptions:
        """Build from keyword options, rejecting unknown names together with bad values."""
        return validation.built(cls, options)
