"""Checks of a run config that go beyond types: environments exist and their configs fit,
the data and bundled models can be found. Each problem names its dotted key."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from envloop.demo import resolve_bundled, resolve_model
from envloop.env_introspection import env_config_problems
from envloop.environments.registry import get_env_class, list_envs, unknown_name_message
from envloop.import_paths import import_from_path

_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
_FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
_FORMATS = ("auto", "jsonl", "parquet", "hf_disk", "hf_hub")


def semantic_problems(raw: Mapping[str, Any], deep: bool = True) -> list[str]:
    """Problems beyond types, found in the raw config mapping (so they are reported together
    with type errors); ``deep`` also looks at files and imports environment classes."""
    envs, rollout = _section(raw, "envs"), _section(raw, "rollout")
    problems = []
    if not envs and "envs" in raw:
        problems.append("envs: name at least one task, e.g. envs: {math: {name: math}}")
    if rollout.get("mode") == "async":
        problems.append("rollout.mode: 'async' is not available yet; use sync")
    if not deep:
        return problems
    for task, env in envs.items():
        env = env if isinstance(env, Mapping) else {}
        if isinstance(env.get("name"), str):
            problems += _env_problems(task, env["name"], env.get("config"))
    model = _section(raw, "policy").get("model")
    if isinstance(model, str):
        problems += _model_problems("policy.model", model)
    data = _section(raw, "data")
    if isinstance(data.get("path"), str) and data.get("format", "auto") in _FORMATS:
        problems += _data_path_problems(data["path"], data.get("format", "auto"))
    return problems


def resolve_env_class(name: str) -> type:
    """The class of a registered environment name or a ``module:Class`` path."""
    if ":" in name and name not in list_envs():
        cls: type = import_from_path(name, f"Environment {name!r}", "class", _is_class)
        return cls
    return get_env_class(name)


def _env_problems(task: str, name: str, config: Any) -> list[str]:
    key = f"envs.{task}"
    try:
        cls = resolve_env_class(name)
    except ValueError:
        return [f"{key}.name: {unknown_name_message('environment', name, list_envs())}"]
    except (ImportError, TypeError) as exc:
        return [f"{key}.name: {exc}"]
    problems = env_config_problems(cls, config, f"{key}.config")
    try:
        resolve_bundled(config)
    except (ValueError, FileNotFoundError) as exc:
        problems.append(f"{key}.config: {exc}")
    return problems


def _model_problems(key: str, path: str) -> list[str]:
    try:
        resolve_model(path)
    except (ValueError, FileNotFoundError) as exc:
        return [f"{key}: {exc}"]
    return []


def _data_path_problems(path: str, fmt: str) -> list[str]:
    if fmt == "hf_hub" or Path(path).exists():
        return []
    if fmt == "auto" and _HUB_ID.match(path) and not path.endswith(_FILE_SUFFIXES):
        return []  # a hub id, resolved when the data loads
    return [f"data.path: no such file or folder: {path}"]


def _section(raw: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = raw.get(name)
    return value if isinstance(value, Mapping) else {}


def _is_class(obj: Any) -> bool:
    return isinstance(obj, type)
