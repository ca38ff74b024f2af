"""Checks of a reward-model environment config that no single key's declaration makes:
aliases, keys that must agree, files that must exist, unused keys. They run once the types
are right (:mod:`envloop.environments.reward_model.config`), on the config merged over its
defaults, and skip the keys already reported.

Aliases resolve on the merged config, and a conflict is a problem, never a silent choice:

- ``batch_size`` is the scoring batch size (NeMo-RL's ``score`` reads it too);
  ``logprob_batch_size`` sets it when ``batch_size`` is not given. Both given: equal or
  an error.
- ``resources.gpus_per_node`` (NeMo-RL's name) sets ``resources.num_gpus`` (Ray's name).
  Both given: equal or an error. ``resources.num_nodes`` must be 1.
- ``dynamic_batching.max_tokens_per_batch`` (envloop's earlier name) sets
  ``dynamic_batching.logprob_mb_tokens``, with a ``FutureWarning``; both given: equal or
  an error.
- ``sequence_packing.enabled`` turns dynamic batching off; enabling both explicitly is an
  error (NeMo-RL treats them as exclusive too).
"""

from __future__ import annotations

import difflib
import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from envloop.data.packing import ALGORITHMS

NOT_FOR_SCORING = (
    "processor",
    "offload_optimizer_for_logprob",
    "max_grad_norm",
    "dtensor_cfg",
    "generation",
    "dynamic_batching.train_mb_tokens",
    "sequence_packing.train_mb_tokens",
)
"""Published keys that configure NeMo-RL's trainer or data pipeline, not scoring."""


class UnusedConfigWarning(UserWarning):
    """Config keys that are accepted (published configs have them) but do not affect scoring."""


def unused_keys(config: Mapping[str, Any]) -> list[str]:
    """The :data:`NOT_FOR_SCORING` keys present in ``config``, dotted.

    >>> unused_keys({"max_grad_norm": None, "dynamic_batching": {"train_mb_tokens": 8}})
    ['max_grad_norm', 'dynamic_batching.train_mb_tokens']
    """
    return [key for key in NOT_FOR_SCORING if _lookup(config, key) is not _MISSING]


def warn_unused(config: Mapping[str, Any]) -> None:
    """One :class:`UnusedConfigWarning` naming every :func:`unused_keys` key (none: silent)."""
    keys = unused_keys(config)
    if keys:
        warnings.warn(
            f"reward_model: {', '.join(keys)} configure NeMo-RL's trainer or data pipeline and "
            "do not affect scoring; the environment does not use them.",
            UnusedConfigWarning,
            stacklevel=3,
        )


def resolve_aliases(given: Mapping[str, Any], merged: Any, mistyped: set[str]) -> list[str]:
    """Fill ``merged``'s canonical keys from their aliases (in place, see the module
    docstring); a problem line per conflict. Keys in ``mistyped`` are left alone."""
    problems = _same_or_alias(given, merged, "batch_size", "logprob_batch_size", mistyped)
    problems += _same_or_alias(
        given, merged, "resources.num_gpus", "resources.gpus_per_node", mistyped
    )
    old = "dynamic_batching.max_tokens_per_batch"
    if _lookup(given, old) is not _MISSING and old not in mistyped:
        warnings.warn(
            f"reward_model: {old} is deprecated; rename it to logprob_mb_tokens (NeMo-RL's name).",
            FutureWarning,
            stacklevel=5,
        )
        problems += _same_or_alias(
            given, merged, "dynamic_batching.logprob_mb_tokens", old, mistyped
        )
        if isinstance(merged["dynamic_batching"], dict):
            merged["dynamic_batching"].pop("max_tokens_per_batch", None)
    return problems + _packing_or_dynamic(given, merged, mistyped)


def _same_or_alias(
    given: Mapping[str, Any], merged: Any, key: str, alias: str, mistyped: set[str]
) -> list[str]:
    value, alias_value = _lookup(given, key), _lookup(given, alias)
    if alias_value is _MISSING or _is_mistyped(mistyped, key, alias):
        return []
    if value is _MISSING:
        *parents, last = key.split(".")
        target = merged
        for part in parents:
            target = target[part]
        target[last] = alias_value
        return []
    if value != alias_value:
        return [f"{alias}: {alias_value!r} conflicts with {key} {value!r}; they name one "
                "setting here, give only one of them"]  # fmt: skip
    return []


def _packing_or_dynamic(given: Mapping[str, Any], merged: Any, mistyped: set[str]) -> list[str]:
    packing, dynamic = "sequence_packing.enabled", "dynamic_batching.enabled"
    if _is_mistyped(mistyped, packing, dynamic) or not merged["sequence_packing"]["enabled"]:
        return []
    if _lookup(given, dynamic) is True:
        return [f"{packing}: True conflicts with {dynamic}: True; enable one of them"]
    merged["dynamic_batching"]["enabled"] = False
    return []


_Fix = str | Callable[[Any], str]  # a fixed hint, or one made from the config
_Check = tuple[str, tuple[str, ...], Callable[[Any], bool], _Fix]
_VALUE_CHECKS: list[_Check] = [
    ("enabled", (), lambda c: c["enabled"], "this config disables the environment; "
     "don't create it"),
    ("tokenizer", (), lambda c: c["tokenizer"] != "", 'use None, a name or {"name": ...}'),
    ("tokenizer.chat_template", ("tokenizer",), lambda c: _template_ok(c["tokenizer"]),
     "no such .jinja file"),
    ("checkpoint_path", (), lambda c: _is_file_or_none(c["checkpoint_path"]), "no such file"),
    ("resources.num_nodes", (), lambda c: c["resources"].get("num_nodes", 1) == 1,
     "the environment is one Ray actor on one node: use 1 (start several environments to use "
     "more nodes)"),
    ("reward_model_cfg.enabled", (), lambda c: c["reward_model_cfg"]["enabled"],
     "a reward-model environment needs its reward model: use true"),
    ("dynamic_batching.logprob_mb_tokens", ("max_model_len", "dynamic_batching.enabled",
     "dynamic_batching.sequence_length_round"), lambda c: _fits(c, "dynamic_batching"),
     lambda c: _fits_hint(c, "dynamic_batching")),
    ("sequence_packing.logprob_mb_tokens", ("max_model_len", "sequence_packing.enabled",
     "sequence_packing.sequence_length_round"), lambda c: _fits(c, "sequence_packing"),
     lambda c: _fits_hint(c, "sequence_packing")),
    ("sequence_packing.algorithm", (),
     lambda c: c["sequence_packing"]["algorithm"].lower() in ALGORITHMS,
     lambda c: _one_of(c["sequence_packing"]["algorithm"], ALGORITHMS)),
]  # fmt: skip


def value_problems(cfg: Any, mistyped: set[str]) -> list[str]:
    """Problems of the values that no declaration checks, for the keys not yet reported."""
    problems = []
    for key, needs, ok, fix in _VALUE_CHECKS:
        if not _is_mistyped(mistyped, key, *needs) and not ok(cfg):
            value = _lookup(cfg, key)
            hint = fix(cfg) if callable(fix) else fix
            problems.append(f"{key}: {value!r} is invalid; {hint}")
    return problems


def round_up(length: int, multiple: int) -> int:
    """``length`` rounded up to a multiple of ``multiple`` (1 or more).

    >>> round_up(100, 64), round_up(128, 64), round_up(7, 1)
    (128, 128, 7)
    """
    return -(-length // multiple) * multiple


def _fits(cfg: Any, section: str) -> bool:
    options = cfg[section]
    need = round_up(cfg["max_model_len"], options["sequence_length_round"])
    return not options["enabled"] or options["logprob_mb_tokens"] >= need


def _fits_hint(cfg: Any, section: str) -> str:
    multiple = cfg[section]["sequence_length_round"]
    need = round_up(cfg["max_model_len"], multiple)
    return (
        f"raise it to at least {need} (max_model_len {cfg['max_model_len']} rounded up to "
        f"sequence_length_round {multiple}), so every conversation fits"
    )


def _one_of(value: Any, known: Any) -> str:
    close = difflib.get_close_matches(str(value).lower(), list(known), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"use one of {', '.join(known)}{hint}"


_MISSING = object()


def _lookup(config: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(config, Mapping) or part not in config:
            return _MISSING
        config = config[part]
    return config


def _is_mistyped(mistyped: set[str], *keys: str) -> bool:
    return any(key in mistyped or key.split(".")[0] in mistyped for key in keys)


def _template_ok(tokenizer: Any) -> bool:
    template = tokenizer.get("chat_template") if isinstance(tokenizer, dict) else None
    return not (isinstance(template, str) and template.endswith(".jinja")) or os.path.isfile(
        template
    )


def _is_file_or_none(path: str | None) -> bool:
    return path is None or os.path.isfile(path)
