"""The sections of the ``envloop run`` config (see :mod:`envloop.run.config`).

The ``policy`` section is the generation backend's own config and the ``rollout`` section
extends the rollout engine's options: each field is declared once, in the component that
reads it. Each field's docstring is what the config reference (README) shows.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, ValidationInfo, field_validator

from envloop.config.validation import Config, NonEmptyStr
from envloop.distributed.ray_utils import check_placement
from envloop.experience.rollout_options import (
    ASYNC_ONLY_SETTINGS,
    AsyncRolloutSettings,
    RolloutSettings,
)
from envloop.models.generation.hf_config import HfGenerationConfig
from envloop.models.generation.server_config import ServerGenerationConfig

GROUND_TRUTH_ENVS = ("math", "vlm")
"""Registered environments that score against each sample's ground truth."""
_GROUND_TRUTH = ", ".join(GROUND_TRUTH_ENVS)


class HfPolicyConfig(HfGenerationConfig, title="policy"):
    """A policy generating in-process with transformers: that backend's config plus its
    name."""

    backend: Literal["hf"] = "hf"
    """Generation backend: ``hf`` (transformers, CPU or GPU, in this process or on Ray
    workers) or ``server`` (inference servers over HTTP: the keys marked server)."""

    @field_validator("backend", mode="before")
    @classmethod
    def _known_backend(cls, backend: Any) -> Any:
        if backend not in ("hf", "server"):
            raise ValueError(
                f"{backend!r} is not a backend; use hf (transformers) or server (vLLM, "
                "SGLang or llama.cpp servers)"
            )
        return backend


class ServerPolicyConfig(ServerGenerationConfig, title="policy"):
    """A policy served by inference servers: that backend's config plus its name."""

    backend: Literal["server"]
    """``server``: generate from the servers at ``base_urls``."""


def _backend_of(value: Any) -> str:
    """Which policy class a section is, by its ``backend`` key (default ``hf``)."""
    backend = value.get("backend", "hf") if isinstance(value, Mapping) else value.backend
    return backend if backend in ("hf", "server") else "hf"  # hf reports a bad value


PolicyConfig = Annotated[
    Annotated[HfPolicyConfig, Tag("hf")] | Annotated[ServerPolicyConfig, Tag("server")],
    Discriminator(_backend_of),
]
"""The ``policy`` section: :class:`HfPolicyConfig` or, with ``backend: server``,
:class:`ServerPolicyConfig`."""


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
    placement: str = "default"
    """Nodes of a Ray cluster the actor may go to: ``default`` (Ray's DEFAULT strategy),
    ``spread`` (a soft node affinity to each node in turn) or ``resource:<name>`` (nodes
    holding that custom resource)."""
    requires_ground_truth: bool | None = Field(
        None, description=f"Every row needs a ground truth; None: true for {_GROUND_TRUTH}."
    )

    @field_validator("placement")
    @classmethod
    def _known_placement(cls, placement: str) -> str:
        return check_placement(placement)

    def needs_ground_truth(self) -> bool:
        """Whether this task's rows must carry a ground truth."""
        if self.requires_ground_truth is not None:
            return self.requires_ground_truth
        return self.name in GROUND_TRUTH_ENVS


class RolloutConfig(AsyncRolloutSettings, title="rollout"):
    """The rollout loop: the engine's arguments and options (``run_multi_turn_rollout``'s,
    and with ``mode: async`` those of ``run_async_multi_turn_rollout``).

    >>> RolloutConfig(max_concurrent_samples=8)
    Traceback (most recent call last):
    ...
    envloop.config.errors.ConfigError: Invalid rollout:
      - mode: 'sync' ignores max_concurrent_samples (8), an option of mode async: set mode: \
async, or leave it out
    """

    max_seq_len: Annotated[int, Field(ge=1)] = 512
    """No sample exceeds this many tokens."""
    max_turns: Annotated[int, Field(ge=1)] = 4
    """Turns (generation + environment step) per sample."""
    generations_per_prompt: Annotated[int, Field(ge=1)] = 1
    """Samples per prompt (GRPO groups)."""
    batch_size: Annotated[int, Field(ge=1)] = 64
    """Samples rolled out together."""
    mode: Annotated[Literal["sync", "async"], Field(validate_default=True)] = "sync"
    """``sync``: the samples of a batch take each turn together. ``async``: each sample of a
    batch runs its own turn loop, generating again as soon as its own environment step
    returns (``max_concurrent_samples``, ``coalesce_window_s`` and ``max_coalesced_samples``
    tune it); the same outputs as ``sync`` (with greedy decoding and deterministic
    environments, the same trajectories, up to float rounding), and progress after every
    finished sample."""
    greedy: bool = False
    """Greedy decoding instead of sampling."""

    def engine_options(self) -> dict[str, Any]:
        """The engine's options this section sets, as keywords of ``run_multi_turn_rollout``
        (every :class:`RolloutSettings` field) or, with ``mode: async``, of
        ``run_async_multi_turn_rollout`` (those and :data:`ASYNC_ONLY_SETTINGS`).

        >>> RolloutConfig(env_max_retries=3, max_turns=2).engine_options()
        {'observation_format': 'raw', 'env_step_timeout_s': None, 'env_startup_timeout_s': 600.0, \
'on_env_error': 'record', 'env_max_retries': 3}
        >>> options = RolloutConfig(mode="async", max_concurrent_samples=8).engine_options()
        >>> {name: options[name] for name in ASYNC_ONLY_SETTINGS}
        {'max_concurrent_samples': 8, 'coalesce_window_s': 0.002, 'max_coalesced_samples': 256}
        """
        names = [*RolloutSettings.model_fields]
        if self.mode == "async":
            names += ASYNC_ONLY_SETTINGS
        return {name: getattr(self, name) for name in names}

    @field_validator("mode")
    @classmethod
    def _async_options_need_async_mode(cls, mode: str, info: ValidationInfo) -> str:
        """With ``mode: sync``, an async-only option set to other than its default is an
        error, not silently ignored (its default is accepted: a sync run's ``config.yaml``
        lists every option). The options, declared in a base class, are validated before
        ``mode``: ``info.data`` holds those with valid values."""
        if mode == "async":
            return mode
        changed = [
            f"{name} ({info.data[name]!r})"
            for name in ASYNC_ONLY_SETTINGS
            if name in info.data
            and info.data[name] != AsyncRolloutSettings.model_fields[name].get_default()
        ]
        if changed:
            one = len(changed) == 1
            raise ValueError(
                f"{mode!r} ignores {' and '.join(changed)}, "
                f"{'an option' if one else 'options'} of mode async: set mode: async, or "
                f"leave {'it' if one else 'them'} out"
            )
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
