"""The reward-model environment's options, validated once, and the model they load.

Ray actor resources are options of the actor, not of the environment: ``create_env`` applies
them, so pass ``create_env("reward_model", cfg, **reward_model_ray_options(cfg))``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, TypedDict, cast

import torch

from envloop.config_errors import ConfigError, typed_dict_problems

PRECISIONS = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class DynamicBatchingConfig(TypedDict):
    enabled: bool  # sort conversations by length and pack batches within the token budget
    max_tokens_per_batch: int  # padded tokens (rows x longest row) per batch, >= max_model_len


class ResourcesConfig(TypedDict, total=False):
    num_cpus: float  # CPUs Ray reserves for the environment actor
    num_gpus: float  # GPUs Ray reserves for it; the model runs on cuda when it gets one


class RewardModelEnvironmentConfig(TypedDict, total=False):
    enabled: bool  # must be True: a config that disables the environment cannot create one
    model_name: str  # hub id or local folder of a one-label sequence-classification model
    tokenizer: str | dict[str, str] | None  # None (= model_name), a name, or {"name": ...}
    precision: str  # weights dtype: "float32", "bfloat16" or "float16"
    batch_size: int  # most conversations scored in one forward pass
    checkpoint_path: str | None  # state-dict file (.safetensors or torch) loaded on top
    max_model_len: int  # longer conversations are cut from the left to this many tokens
    resources: ResourcesConfig  # Ray actor resources, see reward_model_ray_options
    dynamic_batching: DynamicBatchingConfig  # length-sorted batches within a token budget


DEFAULTS: RewardModelEnvironmentConfig = {
    "enabled": True,
    "model_name": "Skywork/Skywork-Reward-V2-Qwen3-0.6B",
    "tokenizer": None,
    "precision": "bfloat16",
    "batch_size": 32,
    "checkpoint_path": None,
    "max_model_len": 4096,
    "resources": {"num_cpus": 1, "num_gpus": 0},
    "dynamic_batching": {"enabled": True, "max_tokens_per_batch": 32768},
}
_NESTED: dict[str, type] = {"resources": ResourcesConfig, "dynamic_batching": DynamicBatchingConfig}
_Check = tuple[str, Callable[[Any], bool], str]
_VALUE_CHECKS: list[_Check] = [
    ("enabled", lambda c: c["enabled"], "this config disables the environment; don't create it"),
    ("model_name", lambda c: c["model_name"] != "", "give a hub id or a local folder"),
    ("tokenizer", lambda c: _tokenizer_ok(c["tokenizer"]), 'use None, a name or {"name": ...}'),
    ("precision", lambda c: c["precision"] in PRECISIONS, f"use one of {', '.join(PRECISIONS)}"),
    ("batch_size", lambda c: c["batch_size"] >= 1, "use 1 or more"),
    ("max_model_len", lambda c: c["max_model_len"] >= 1, "use 1 or more"),
    ("checkpoint_path", lambda c: _is_file_or_none(c["checkpoint_path"]), "no such file"),
    ("resources", lambda c: all(v >= 0 for v in _numbers(c["resources"])), "use counts >= 0"),
    (
        "dynamic_batching.max_tokens_per_batch",
        lambda c: c["dynamic_batching"]["max_tokens_per_batch"] >= c["max_model_len"],
        "raise it to at least max_model_len, so every conversation fits in a batch",
    ),
]


def validate_config(config: Any = None) -> RewardModelEnvironmentConfig:
    """``config`` over :data:`DEFAULTS` (None = defaults); one ConfigError lists every problem.

    >>> validate_config({"batch_size": 8})["batch_size"], validate_config()["precision"]
    (8, 'bfloat16')
    """
    given = {} if config is None else config
    if not isinstance(given, dict):
        raise ConfigError("RewardModelEnvironmentConfig", typed_dict_problems(given, dict))
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
    problems += _value_problems(merged, {p.split(":")[0] for p in problems})
    if problems:
        raise ConfigError("RewardModelEnvironmentConfig", problems)
    return merged


def reward_model_ray_options(config: Any = None) -> dict[str, float]:
    """The config's ``resources`` as Ray actor options for ``create_env``.

    >>> reward_model_ray_options({"resources": {"num_gpus": 1}})
    {'num_cpus': 1, 'num_gpus': 1}
    """
    return dict(cast(dict[str, float], validate_config(config)["resources"]))


def _value_problems(cfg: Any, mistyped: set[str]) -> list[str]:
    """Range and consistency problems, for the keys whose types are right."""
    problems = []
    for key, ok, fix in _VALUE_CHECKS:
        needs = {key, key.split(".")[0]} | ({"max_model_len"} if "." in key else set())
        if not needs & mistyped and not ok(cfg):
            value = cfg
            for part in key.split("."):
                value = value[part]
            problems.append(f"{key}: {value!r} is invalid; {fix}")
    return problems


def _tokenizer_ok(tokenizer: Any) -> bool:
    if isinstance(tokenizer, dict):
        tokenizer = tokenizer.get("name") if set(tokenizer) == {"name"} else None
        return isinstance(tokenizer, str) and tokenizer != ""
    return tokenizer != ""


def _numbers(mapping: dict[str, Any]) -> list[float]:
    return [v for v in mapping.values() if isinstance(v, (int, float))]


def _is_file_or_none(path: str | None) -> bool:
    return path is None or os.path.isfile(path)


def load_reward_model(config: RewardModelEnvironmentConfig, device: str) -> tuple[Any, Any]:
    """``(tokenizer, model)`` via ``from_pretrained`` (hub id or folder), checkpoint applied,
    ``config.pad_token_id`` set (the model uses it to find each row's last real token)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = config["tokenizer"]
    tokenizer_name = tok["name"] if isinstance(tok, dict) else tok or config["model_name"]
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_name)
    if tokenizer.chat_template is None:
        raise ValueError(
            f"reward_model: tokenizer {tokenizer_name!r} has no chat template; set the config's "
            "'tokenizer' to one that has the reward model's template."
        )
    model: Any = AutoModelForSequenceClassification.from_pretrained(
        config["model_name"], num_labels=1, dtype=PRECISIONS[config["precision"]]
    )
    if config["checkpoint_path"]:
        model.load_state_dict(_load_state_dict(config["checkpoint_path"]))
    text_config = model.config.get_text_config()
    if getattr(text_config, "pad_token_id", None) is None:
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        text_config.pad_token_id = model.config.pad_token_id = tokenizer.pad_token_id
    if text_config.pad_token_id is None:
        raise ValueError(f"reward_model: {tokenizer_name!r} has neither a pad nor an EOS token.")
    return tokenizer, model.to(device).eval()


def _load_state_dict(path: str) -> dict[str, torch.Tensor]:
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    return torch.load(path, map_location="cpu", weights_only=True)
