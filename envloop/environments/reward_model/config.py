"""The reward-model environment's options, declared once and validated once.

Every key of a published NeMo-RL reward-model environment block is accepted, in one of
three groups:

(a) **Scoring keys**, honoured: ``enabled``, ``model_name``, ``tokenizer`` (a name or
    ``{name, chat_template, chat_template_kwargs}``), ``precision``, ``batch_size``,
    ``logprob_batch_size``, ``checkpoint_path``, ``max_model_len``, ``resources``,
    ``reward_model_cfg``, ``dynamic_batching`` and ``sequence_packing``; and envloop's own
    ``max_parse_chars`` (the cap every built-in environment has on the text it parses:
    here the conversation's message contents together, before they are templated and
    tokenized).
(b) **Not used for scoring** (they configure NeMo-RL's trainer or data pipeline):
    ``processor`` (a data-processor name such as ``math_hf_data_processor``),
    ``offload_optimizer_for_logprob``, ``max_grad_norm``, ``dtensor_cfg``, ``generation``,
    ``dynamic_batching.train_mb_tokens`` and ``sequence_packing.train_mb_tokens``. They are
    accepted, never rejected, and the environment names those present in one
    :class:`UnusedConfigWarning` when it is constructed. The contents of ``dtensor_cfg`` and
    ``generation`` are not checked: nothing in them is read.
(c) **Anything else** fails in one :class:`~envloop.config.errors.ConfigError` that lists
    every bad key with its dotted path and a close match ("did you mean").

Each key is declared once below: its type, range or allowed values, default and one-line
description, validated by pydantic (:mod:`envloop.config.validation`). :data:`DEFAULTS` is
read from the declarations (group (b) keys and the aliases have none: absent means unset).
What one key's declaration cannot say is checked once the types are right, in
:mod:`envloop.environments.reward_model.checks`: how aliases resolve (``batch_size`` /
``logprob_batch_size``, ``resources.gpus_per_node`` / ``num_gpus``, the deprecated
``dynamic_batching.max_tokens_per_batch``), keys that must agree, and files that must exist.
Ray actor resources are options of the actor, not of the environment: pass
``create_env("reward_model", cfg, **reward_model_ray_options(cfg))``.
"""

from __future__ import annotations

import typing
from collections.abc import Mapping
from typing import Annotated, Any, Literal, cast

from pydantic import Field
from typing_extensions import TypedDict

from envloop.config import validation
from envloop.config.errors import ConfigError, prefixed
from envloop.config.validation import NonEmptyStr
from envloop.environments.reward_model.checks import (
    UnusedConfigWarning,
    resolve_aliases,
    unused_keys,
    value_problems,
)
from envloop.environments.utils import MaxParseChars

__all__ = [
    "DEFAULTS",
    "PRECISIONS",
    "RewardModelEnvironmentConfig",
    "UnusedConfigWarning",
    "config_problems",
    "reward_model_ray_options",
    "unused_keys",
    "validate_config",
]

Precision = Literal["float32", "bfloat16", "float16"]
PRECISIONS: tuple[str, ...] = typing.get_args(Precision)
"""Weight dtypes of the reward model, by their torch names."""
_TRAINER_ONLY = Field(description="trainer-only: not used for scoring")


def _section(spec: type, description: str) -> Any:
    """The declaration of a nested section: absent, it is its own fields' defaults."""
    return Field(
        default_factory=lambda: validation.declared_defaults(spec), description=description
    )


class TokenizerConfig(TypedDict, total=False):
    name: Annotated[NonEmptyStr, Field(description="hub id or folder (absent: model_name)")]
    chat_template: Annotated[
        str | None, Field(description='None: contents joined; "default"; a .jinja file; a template')
    ]
    chat_template_kwargs: Annotated[
        dict[str, Any] | None, Field(description="extra apply_chat_template arguments")
    ]


class ResourcesConfig(TypedDict, total=False):
    num_cpus: Annotated[float, Field(1, ge=0, description="CPUs Ray reserves for the actor")]
    num_gpus: Annotated[float, Field(0, ge=0, description="GPUs for it; with one it runs on cuda")]
    gpus_per_node: Annotated[float, Field(ge=0, description="NeMo-RL's name for num_gpus")]
    num_nodes: Annotated[
        int, Field(description="must be 1: the environment is one actor on one node")
    ]


class RewardModelCfg(TypedDict, total=False):
    enabled: Annotated[bool, Field(True, description="must be true")]
    reward_model_type: Annotated[
        Literal["bradley_terry"],
        Field("bradley_terry", description="a one-label classifier whose logit is the reward"),
    ]


class DynamicBatchingConfig(TypedDict, total=False):
    enabled: Annotated[bool, Field(True, description="length-sorted batches within the budget")]
    logprob_mb_tokens: Annotated[
        int, Field(32768, ge=1, description="padded tokens (rows x padded length) per batch")
    ]
    sequence_length_round: Annotated[
        int, Field(1, ge=1, description="a batch's padded length rounds up to a multiple of it")
    ]
    train_mb_tokens: Annotated[int, _TRAINER_ONLY]
    max_tokens_per_batch: Annotated[
        int, Field(ge=1, description="deprecated name of logprob_mb_tokens")
    ]


class SequencePackingConfig(TypedDict, total=False):
    enabled: Annotated[
        bool, Field(False, description="several conversations per row, each seeing itself")
    ]
    logprob_mb_tokens: Annotated[int, Field(8192, ge=1, description="tokens per packed row")]
    algorithm: Annotated[
        str,
        Field("modified_first_fit_decreasing", description="an algorithm of envloop.data.packing"),
    ]
    sequence_length_round: Annotated[
        int, Field(1, ge=1, description="a row's length rounds up to a multiple of it")
    ]
    microbatch_order: Annotated[
        Literal["packer", "largest_first"],
        Field("packer", description="rows as packed, or the fullest first"),
    ]
    train_mb_tokens: Annotated[int, _TRAINER_ONLY]


class RewardModelEnvironmentConfig(TypedDict, total=False):
    enabled: Annotated[bool, Field(True, description="must be true (false: don't create it)")]
    model_name: Annotated[
        NonEmptyStr,
        Field(
            "Skywork/Skywork-Reward-V2-Qwen3-0.6B",
            description="hub id, folder or bundled:<name> of a one-label sequence classifier",
        ),
    ]
    tokenizer: Annotated[
        str | dict[str, Any] | None,
        Field(None, description="None (= model_name), a name, or a TokenizerConfig"),
    ]
    precision: Annotated[Precision, Field("bfloat16", description="weights dtype")]
    batch_size: Annotated[int, Field(32, ge=1, description="most conversations per forward pass")]
    logprob_batch_size: Annotated[
        int, Field(ge=1, description="sets batch_size when that is absent")
    ]
    checkpoint_path: Annotated[
        str | None, Field(None, description="state-dict file (.safetensors or torch) loaded on top")
    ]
    max_model_len: Annotated[
        int, Field(4096, ge=1, description="tokens kept of a conversation (cut from the left)")
    ]
    max_parse_chars: MaxParseChars  # of the conversation's message contents together
    resources: Annotated[ResourcesConfig, _section(ResourcesConfig, "Ray actor resources")]
    reward_model_cfg: Annotated[
        RewardModelCfg, _section(RewardModelCfg, "the kind of reward model")
    ]
    dynamic_batching: Annotated[
        DynamicBatchingConfig,
        _section(DynamicBatchingConfig, "length-sorted batches within a token budget"),
    ]
    sequence_packing: Annotated[
        SequencePackingConfig,
        _section(SequencePackingConfig, "packed rows; replaces dynamic batching"),
    ]
    processor: Annotated[
        str | None, Field(description="not used for scoring: NeMo-RL's data processor")
    ]
    offload_optimizer_for_logprob: Annotated[bool, _TRAINER_ONLY]
    max_grad_norm: Annotated[float | None, _TRAINER_ONLY]
    dtensor_cfg: Annotated[dict[str, Any] | None, _TRAINER_ONLY]
    generation: Annotated[dict[str, Any] | None, _TRAINER_ONLY]


DEFAULTS = cast(
    RewardModelEnvironmentConfig, validation.declared_defaults(RewardModelEnvironmentConfig)
)


def config_problems(config: Any = None) -> list[str]:
    """Every problem of ``config`` (None: the defaults), one line each with its dotted key;
    what :func:`validate_config` raises. Imports nothing heavy: ``envloop run`` checks
    configs with it before starting Ray.

    >>> config_problems({"batch_size": 0, "resources": {"num_cpu": 1}})
    ['batch_size: must be >= 1, got 0', "resources.num_cpu: unknown option. Did you mean \
'num_cpus'?"]
    """
    return _merged_and_problems(config)[1]


def validate_config(config: Any = None) -> RewardModelEnvironmentConfig:
    """``config`` over :data:`DEFAULTS` (None = defaults), aliases resolved; one
    :class:`~envloop.config.errors.ConfigError` lists every problem.

    >>> validate_config({"batch_size": 8})["batch_size"], validate_config()["precision"]
    (8, 'bfloat16')
    >>> validate_config({"resources": {"gpus_per_node": 1, "num_nodes": 1}})["resources"]
    {'num_cpus': 1, 'num_gpus': 1, 'gpus_per_node': 1, 'num_nodes': 1}
    """
    merged, problems = _merged_and_problems(config)
    if problems:
        raise ConfigError("RewardModelEnvironmentConfig", problems)
    return merged


def _merged_and_problems(config: Any) -> tuple[Any, list[str]]:
    """``config`` over :data:`DEFAULTS` with aliases resolved, and its problems: the
    declarations' first, then those of the checks (which skip the keys already wrong)."""
    given = {} if config is None else config
    problems = validation.config_problems(RewardModelEnvironmentConfig, given)
    if not isinstance(given, Mapping):
        return None, problems
    tokenizer = given.get("tokenizer")
    if isinstance(tokenizer, Mapping):
        problems += prefixed(validation.config_problems(TokenizerConfig, tokenizer), "tokenizer")
    merged = _over_defaults(given)
    mistyped = {p.split(":")[0] for p in problems}
    problems += resolve_aliases(given, merged, mistyped)
    problems += value_problems(merged, mistyped)
    return merged, problems


def _over_defaults(config: Mapping[str, Any]) -> Any:
    """``config`` over :data:`DEFAULTS`, each nested section over its own defaults (copies:
    aliases resolve in place)."""
    merged = {**DEFAULTS, **config}
    for key, default in DEFAULTS.items():
        if isinstance(default, dict) and isinstance(merged[key], Mapping):
            merged[key] = {**default, **merged[key]}
    return merged


def reward_model_ray_options(config: Any = None) -> dict[str, float]:
    """The config's ``resources`` as Ray actor options for ``create_env``
    (``gpus_per_node`` counts as ``num_gpus``).

    >>> reward_model_ray_options({"resources": {"num_gpus": 1}})
    {'num_cpus': 1, 'num_gpus': 1}
    >>> reward_model_ray_options({"resources": {"gpus_per_node": 1, "num_nodes": 1}})
    {'num_cpus': 1, 'num_gpus': 1}
    """
    resources = validate_config(config)["resources"]
    return {"num_cpus": resources["num_cpus"], "num_gpus": resources["num_gpus"]}
