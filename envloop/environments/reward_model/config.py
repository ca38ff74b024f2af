"""The reward-model environment's options, declared once and validated once.

Every key of a published NeMo-RL reward-model environment block is accepted, in one of
three groups:

(a) **Scoring keys**, honoured: ``enabled``, ``model_name``, ``tokenizer`` (a name or
    ``{name, chat_template, chat_template_kwargs}``), ``precision``, ``batch_size``,
    ``logprob_batch_size``, ``checkpoint_path``, ``max_model_len``, ``resources``,
    ``reward_model_cfg``, ``dynamic_batching`` and ``sequence_packing``.
(b) **Not used for scoring** (they configure NeMo-RL's trainer or data pipeline):
    ``processor`` (a data-processor name such as ``math_hf_data_processor``),
    ``offload_optimizer_for_logprob``, ``max_grad_norm``, ``dtensor_cfg``, ``generation``,
    ``dynamic_batching.train_mb_tokens`` and ``sequence_packing.train_mb_tokens``. They are
    accepted, never rejected, and the environment names those present in one
    :class:`UnusedConfigWarning` when it is constructed. The contents of ``dtensor_cfg`` and
    ``generation`` are not checked: nothing in them is read.
(c) **Anything else** fails in one :class:`~envloop.config.errors.ConfigError` that lists
    every bad key with its dotted path and a close match ("did you mean").

Each key's description is its comment below and its default is in :data:`DEFAULTS`
(group (b) keys and ``logprob_batch_size`` have none: absent means unset). How aliases
resolve (``batch_size`` / ``logprob_batch_size``, ``resources.gpus_per_node`` /
``num_gpus``, the deprecated ``dynamic_batching.max_tokens_per_batch``) is in
:mod:`envloop.environments.reward_model.checks`. Ray actor resources are options of the
actor, not of the environment: pass ``create_env("reward_model", cfg,
**reward_model_ray_options(cfg))``.
"""

from __future__ import annotations

from typing import Any, TypedDict

from envloop.config.errors import ConfigError, typed_dict_problems
from envloop.environments.reward_model.checks import (
    PRECISIONS,
    UnusedConfigWarning,
    resolve_aliases,
    unused_keys,
    value_problems,
)

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


class TokenizerConfig(TypedDict, total=False):
    name: str  # hub id or folder of the tokenizer (absent: model_name)
    chat_template: str | None  # None: contents concatenated; "default"; a .jinja file; a template
    chat_template_kwargs: dict[str, Any] | None  # extra apply_chat_template arguments


class ResourcesConfig(TypedDict, total=False):
    num_cpus: float  # CPUs Ray reserves for the environment actor
    num_gpus: float  # GPUs Ray reserves for it; the model runs on cuda when it gets one
    gpus_per_node: float  # NeMo-RL's name for num_gpus (give one of the two)
    num_nodes: int  # must be 1: the environment is one actor on one node


class RewardModelCfg(TypedDict, total=False):
    enabled: bool  # must be True
    reward_model_type: str  # "bradley_terry": a one-label sequence classifier's score


class DynamicBatchingConfig(TypedDict, total=False):
    enabled: bool  # sort conversations by length, batch them within logprob_mb_tokens
    logprob_mb_tokens: int  # padded tokens (rows x padded length) per scoring batch
    sequence_length_round: int  # a batch's padded length is rounded up to a multiple of this
    train_mb_tokens: int  # trainer-only: not used for scoring
    max_tokens_per_batch: int  # deprecated: envloop's earlier name for logprob_mb_tokens


class SequencePackingConfig(TypedDict, total=False):
    enabled: bool  # several conversations per row, each attending only to itself
    logprob_mb_tokens: int  # tokens per packed row (rounded length included)
    algorithm: str  # packing algorithm, see envloop.data.packing (e.g. first_fit_decreasing)
    sequence_length_round: int  # a packed row's length is rounded up to a multiple of this
    microbatch_order: str  # "packer" (as packed) or "largest_first" (fullest rows first)
    train_mb_tokens: int  # trainer-only: not used for scoring


class RewardModelEnvironmentConfig(TypedDict, total=False):
    enabled: bool  # must be True: a config that disables the environment cannot create one
    model_name: str  # hub id, folder or bundled:<name> of a one-label sequence-classification model
    tokenizer: str | dict[str, Any] | None  # None (= model_name), a name, or a TokenizerConfig
    precision: str  # weights dtype: "float32", "bfloat16" or "float16"
    batch_size: int  # most conversations scored in one forward pass
    logprob_batch_size: int  # the scoring batch size when batch_size is not given
    checkpoint_path: str | None  # state-dict file (.safetensors or torch) loaded on top
    max_model_len: int  # longer conversations are cut from the left to this many tokens
    resources: ResourcesConfig  # Ray actor resources, see reward_model_ray_options
    reward_model_cfg: RewardModelCfg  # the kind of reward model
    dynamic_batching: DynamicBatchingConfig  # length-sorted batches within a token budget
    sequence_packing: SequencePackingConfig  # packed rows; replaces dynamic batching
    processor: str | None  # not used for scoring: NeMo-RL's dataset processor name
    offload_optimizer_for_logprob: bool  # trainer-only: not used for scoring
    max_grad_norm: float | None  # trainer-only: not used for scoring
    dtensor_cfg: dict[str, Any] | None  # trainer-only (parallelism): not used for scoring
    generation: dict[str, Any] | None  # trainer-only (vLLM settings): not used for scoring


DEFAULTS: RewardModelEnvironmentConfig = {
    "enabled": True,
    "model_name": "Skywork/Skywork-Reward-V2-Qwen3-0.6B",
    "tokenizer": None,
    "precision": "bfloat16",
    "batch_size": 32,
    "checkpoint_path": None,
    "max_model_len": 4096,
    "resources": {"num_cpus": 1, "num_gpus": 0},
    "reward_model_cfg": {"enabled": True, "reward_model_type": "bradley_terry"},
    "dynamic_batching": {"enabled": True, "logprob_mb_tokens": 32768, "sequence_length_round": 1},
    "sequence_packing": {
        "enabled": False,
        "logprob_mb_tokens": 8192,
        "algorithm": "modified_first_fit_decreasing",
        "sequence_length_round": 1,
        "microbatch_order": "packer",
    },
}
_NESTED: dict[str, type] = {
    "resources": ResourcesConfig,
    "reward_model_cfg": RewardModelCfg,
    "dynamic_batching": DynamicBatchingConfig,
    "sequence_packing": SequencePackingConfig,
}


def config_problems(config: Any = None) -> list[str]:
    """Every problem of ``config`` (None: the defaults), one line each with its dotted key;
    what :func:`validate_config` raises. Imports nothing heavy: ``envloop run`` checks
    configs with it before starting Ray.

    >>> config_problems({"batch_size": 0, "resources": {"num_cpu": 1}})
    ["resources.num_cpu: unknown option. Did you mean 'num_cpus'?", 'batch_size: 0 is \
invalid; use 1 or more']
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
    """``config`` over :data:`DEFAULTS` with aliases resolved, and its problems."""
    given = {} if config is None else config
    if not isinstance(given, dict):
        return None, typed_dict_problems(given, dict)
    # Nested TypedDicts are checked on their own (typed_dict_problems checks one level).
    flat = {k: v for k, v in given.items() if k not in _NESTED}
    problems = typed_dict_problems(flat, RewardModelEnvironmentConfig, "config")
    merged: Any = {**DEFAULTS, **given}
    for key, spec in _NESTED.items():
        if isinstance(merged[key], dict):
            merged[key] = {**DEFAULTS[key], **merged[key]}  # type: ignore[literal-required]
            problems += [f"{key}.{p}" for p in typed_dict_problems(merged[key], spec, key)]
        else:
            problems.append(f"{key}: expected a dict, got {type(merged[key]).__name__}")
    if isinstance(merged["tokenizer"], dict):
        problems += [
            f"tokenizer.{p}" for p in typed_dict_problems(merged["tokenizer"], TokenizerConfig)
        ]
    mistyped = {p.split(":")[0] for p in problems}
    problems += resolve_aliases(given, merged, mistyped)
    problems += value_problems(merged, mistyped)
    return merged, problems


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
