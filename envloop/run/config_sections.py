"""The sections of the ``envloop run`` config (see :mod:`envloop.run.config`).

The ``policy`` section is the generation backend's own config and the ``rollout`` section
extends the rollout engine's options: each field is declared once, in the component that
reads it. Each field's docstring is what the config reference (README) shows.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from envloop.config.validation import Config, NonEmptyStr
from envloop.experience.rollout_options import RolloutSettings
from envloop.models.generation.hf_config import HfGenerationConfig

GROUND_TRUTH_ENVS = ("math", "vlm")
"""Registered environments that score against each sample's ground truth."""
_GROUND_TRUTH = ", ".join(GROUND_TRUTH_ENVS)


class PolicyConfig(HfGenerationConfig, title="policy"):
    """The policy that generates responses: the backend's config plus its name."""

    backend: Literal["hf"] = "hf"
    """Generation backend: ``hf`` (transformers, CPU or GPU)."""


class EnvConfig(Config, title="environment"):
    """One task's environment, started as a Ray actor."""

    name: NonEmptyStr
    """Registered environment name (``envloop envs``) or ``module:Class`` path."""
    config: dict[str, Any] | None = None
    """The environment's config; None: its defaults."""
    num_cpus: Annotated[float, Field(ge=0)] | None = None
    """CPUs Ray reserves for the actor; None: 0."""
    stop_strings: list[NonEmptyStr] | None = None
    """Stop strings of the first turn; later turns use the environment's."""
    requires_ground_truth: bool | None = Field(
        None, description=f"Every row needs a ground truth; None: true for {_GROUND_TRUTH}."
    )

    def needs_ground_truth(self) -> bool:
        """Whether this task's rows must carry a ground truth."""
        if self.requires_ground_truth is not None:
            return self.requires_ground_truth
        return self.name in GROUND_TRUTH_ENVS


class RolloutConfig(RolloutSettings, title="rollout"):
    """The rollout loop: ``run_multi_turn_rollout``'s arguments and options."""

    max_seq_len: Annotated[int, Field(ge=1)] = 512
    """No sample exceeds this many tokens."""
    max_turns: Annotated[int, Field(ge=1)] = 4
    """Turns (generation + environment step) per sample."""
    generations_per_prompt: Annotated[int, Field(ge=1)] = 1
    """Samples per prompt (GRPO groups)."""
    batch_size: Annotated[int, Field(ge=1)] = 64
    """Samples rolled out together."""
    mode: Literal["sync", "async"] = "sync"
    """``sync``: batch by batch; ``async``: not yet."""
    greedy: bool = False
    """Greedy decoding instead of sampling."""

    def engine_options(self) -> dict[str, Any]:
        """The engine's options this section sets (every :class:`RolloutSettings` field), as
        ``run_multi_turn_rollout`` keywords.

        >>> RolloutConfig(env_max_retries=3, max_turns=2).engine_options()
        {'observation_format': 'raw', 'env_step_timeout_s': None, 'on_env_error': 'record', \
'env_max_retries': 3}
        """
        return {name: getattr(self, name) for name in RolloutSettings.model_fields}

    @field_validator("mode")
    @classmethod
    def _mode_is_available(cls, mode: str) -> str:
        if mode == "async":
            raise ValueError("'async' is not available yet; use sync")
        return mode


class RayConfig(Config, title="ray"):
    """The Ray session environments (and policy workers) run in."""

    address: str | None = None
    """Cluster to join; None: ``$RAY_ADDRESS`` or a local session."""
    num_cpus: Annotated[int, Field(ge=1)] | None = 2
    """CPUs of a local session; None: all."""
    log_to_driver: bool = False
    """Show actors' output on this terminal."""


class OutputConfig(Config, title="output"):
    """Where the run directory goes."""

    dir: NonEmptyStr = "runs/latest"
    """Run directory (created; files in it are replaced)."""
