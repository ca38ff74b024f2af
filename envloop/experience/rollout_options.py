"""Options of the rollout engine, declared once and validated once with every problem
reported. :class:`RolloutSettings` (and :class:`AsyncRolloutSettings` for the async engine)
are the ones a config file can set (the run config's ``rollout`` section composes them);
:class:`RolloutOptions` and :class:`AsyncRolloutOptions` add the progress callback."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from pydantic import Field

from envloop.config.validation import Config

ObservationFormat = Literal["raw", "chat_template"]
OnEnvError = Literal["record", "raise"]


class RolloutSettings(Config, title="rollout options"):
    """The options of ``run_multi_turn_rollout`` that are plain values."""

    observation_format: ObservationFormat = "raw"
    """``raw``: observation text tokenized as is. ``chat_template``: rendered by the
    tokenizer's template as a new message plus the next assistant prefix (closing the
    assistant turn first if the response did not end with EOS), so the whole sequence
    equals ``apply_chat_template(conversation, add_generation_prompt=True)``."""
    env_step_timeout_s: Annotated[float | None, Field(gt=0, allow_inf_nan=False)] = None
    """Seconds one environment step may take (actor start-up does not count); a step that
    takes longer fails its samples, and an actor that ran it is restarted before its next
    step (Ray cannot stop a running step). None: no limit."""
    env_startup_timeout_s: Annotated[float | None, Field(gt=0, allow_inf_nan=False)] = 600.0
    """Seconds an environment actor's constructor may take (counted from the rollout's first
    wait for it, and again after a restart); the samples of an environment that has not
    started by then fail with an error naming it. None: no limit."""
    on_env_error: OnEnvError = "record"
    """``record``: a failing step ends only its samples, with ``loss_multiplier`` 0, the
    error text in ``env_error``, and ``env_error_rate``; ``raise``:
    ``EnvironmentStepError`` with the environment's traceback."""
    env_max_retries: Annotated[int, Field(ge=0)] = 1
    """Retries of a step whose Ray actor died, each once Ray has restarted the actor (actors
    from ``create_env`` restart however often they die)."""


class RolloutOptions(RolloutSettings, title="rollout options"):
    """Keyword options of ``run_multi_turn_rollout``.

    >>> RolloutOptions.from_mapping({"observation_format": "chat_template"}).on_env_error
    'record'
    >>> RolloutOptions.from_mapping({"env_step_timeout_s": 0, "env_max_retries": True})
    Traceback (most recent call last):
    ...
    envloop.config.errors.ConfigError: Invalid rollout options:
      - env_step_timeout_s: must be > 0, got 0
      - env_max_retries: expected int, got bool (True)
    """

    deduplicate_multimodal_data: bool = False
    """Hand the policy one representation of each sample's images, the one it reads
    (``GenerationInterface.reads_images``: ``images`` and ``image_grid_thw`` for a server
    backend, the vision input columns for ``HfGeneration``), instead of both; a sample's
    unread inputs are then never joined for the call. The final batch is the same either
    way (NeMo-RL's keyword: only native media for a vLLM backend)."""
    on_turn: Callable[[Any], None] | None = None  # no torch import here: run configs use it
    """Called after every turn with a :class:`~envloop.experience.rollout_metrics.RolloutProgress`
    (``samples``, ``samples_done``, ``turns``, ``generated_tokens``, ``generation_s``,
    ``elapsed_s``, ``tokens_per_s``); ``envloop run`` draws its progress line with it. None:
    nothing."""


class AsyncRolloutSettings(RolloutSettings, title="async rollout options"):
    """The options of ``run_async_multi_turn_rollout`` that are plain values: those of
    :class:`RolloutSettings` and how samples are bounded and coalesced.

    >>> AsyncRolloutSettings.from_mapping({}).coalesce_window_s
    0.002
    """

    max_concurrent_samples: Annotated[int, Field(ge=1)] | None = None
    """Samples in flight at once (admitted in input order as others finish); None: all."""
    coalesce_window_s: Annotated[float, Field(ge=0, allow_inf_nan=False)] = 0.002
    """How long an idle stage waits for more samples before it calls the policy or an
    environment, so that samples arriving close together share one batched call."""
    max_coalesced_samples: Annotated[int, Field(ge=1)] = 256
    """Most samples in one coalesced generation or environment call."""


ASYNC_ONLY_SETTINGS = tuple(
    name for name in AsyncRolloutSettings.model_fields if name not in RolloutSettings.model_fields
)
"""The settings only the async engine reads (``max_concurrent_samples``,
``coalesce_window_s``, ``max_coalesced_samples``)."""


class AsyncRolloutOptions(AsyncRolloutSettings, RolloutOptions, title="async rollout options"):
    """Keyword options of ``run_async_multi_turn_rollout``: those of
    ``run_multi_turn_rollout`` and how samples are bounded and coalesced.

    >>> AsyncRolloutOptions.from_mapping({"max_concurrent_samples": 0})
    Traceback (most recent call last):
    ...
    envloop.config.errors.ConfigError: Invalid async rollout options:
      - max_concurrent_samples: must be >= 1, got 0
    """


DEFAULTS = AsyncRolloutSettings()
"""Every option's declared default (the engines' keyword-only parameters take their
defaults from here, so each is declared once).

>>> DEFAULTS.coalesce_window_s
0.002
"""


def options_from_arguments(
    options: type[RolloutOptions], arguments: dict[str, Any], unknown: dict[str, Any]
) -> Any:
    """``options`` (:class:`RolloutOptions` or :class:`AsyncRolloutOptions`) validated from
    a call's ``arguments`` (its ``locals()``: the values of the options it declares) and
    the ``unknown`` keywords it was given besides, which fail with "did you mean"."""
    values = {name: arguments[name] for name in options.model_fields if name in arguments}
    return options.from_mapping({**values, **unknown})
