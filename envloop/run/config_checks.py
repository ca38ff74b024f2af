"""Checks of a run config that go beyond types, each problem naming its dotted key.

Two tiers after the types and values (:class:`~envloop.run.config.RunConfig`), so that a bad
config fails fast: :func:`semantic_problems` (the models, tokenizers, checkpoints and the
dataset named can be found), then :func:`env_problems`
(each environment exists and its config passes every check its constructor runs). Neither
imports anything heavy for the built-in environments, whose registry entries name a
torch-free config check; an environment without one (a ``module:Class`` path, or one
registered without ``config_check``) is checked by importing its class, and with it torch."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from envloop.config.errors import prefixed
from envloop.data.dataset_config import DATA_FORMATS
from envloop.models.bundled import resolve_bundled, resolve_model
from envloop.run.config_paths import dataset_problem, file_problem, model_problem

__all__ = [
    "env_problems",
    "resolve_bundled",
    "resolve_env_class",
    "resolve_model",
    "semantic_problems",
]

ENV_MODEL_KEYS = ("model_name", "tokenizer", "tokenizer_name")
"""Environment config keys naming a model or tokenizer (folder, hub id or bundled:<name>)."""
ENV_FILE_KEYS = {"checkpoint_path": "state-dict file (.safetensors or a torch checkpoint)"}
"""Environment config keys naming a local file, with what the file holds."""


def semantic_problems(raw: Mapping[str, Any]) -> list[str]:
    """Whether the models, tokenizers, checkpoints and the dataset the raw config mapping
    names can be found (see :mod:`envloop.run.config_paths`); read from the mapping, so
    they are reported together with type errors. Imports nothing heavy."""
    problems = []
    policy = _section(raw, "policy")
    server = policy.get("backend") == "server"
    for key in ("tokenizer",) if server else ("model_name", "tokenizer_name"):
        if isinstance(policy.get(key), str):
            problems += _some(model_problem(f"policy.{key}", policy[key]))
    template = policy.get("chat_template")
    if isinstance(template, str) and template.endswith(".jinja") and not Path(template).is_file():
        problems.append(
            f"policy.chat_template: no such .jinja file: {template!r} (relative paths are "
            "looked up in the current directory, then next to the config file). Give an "
            "existing file, the template text, default (the tokenizer's own) or null (the "
            "message contents concatenated)."
        )
    for task, env in _section(raw, "envs").items():
        config = env.get("config") if isinstance(env, Mapping) else None
        if isinstance(config, Mapping):
            problems += _env_path_problems(f"envs.{task}.config", config)
    data = _section(raw, "data")
    fmt = data.get("format", "auto")
    if isinstance(data.get("path"), str) and fmt in DATA_FORMATS:
        problems += _some(dataset_problem("data.path", data["path"], fmt))
    return problems


def env_problems(raw: Mapping[str, Any]) -> list[str]:
    """Each task's environment exists and its config passes the environment's checks: the
    registered config check if the entry names one, else the types of the class's config
    TypedDict and ``cls.config_problems`` (importing the class)."""
    problems = []
    for task, env in _section(raw, "envs").items():
        env = env if isinstance(env, Mapping) else {}
        if isinstance(env.get("name"), str):
            problems += _env_problems(task, env["name"], env.get("config"))
    return problems


def resolve_env_class(name: str) -> type:
    """The class of a registered environment name or a ``module:Class`` path."""
    from envloop.config.import_paths import import_from_path
    from envloop.environments.registry import get_env_class, list_envs

    if ":" in name and name not in list_envs():
        cls: type = import_from_path(name, f"Environment {name!r}", "class", _is_class)
        return cls
    return get_env_class(name)


def _env_problems(task: str, name: str, config: Any) -> list[str]:
    from envloop.environments.registry import get_config_check, list_envs, unknown_name_message

    key = f"envs.{task}"
    try:
        check = get_config_check(name) if name in list_envs() else None
        if check is None:
            cls = resolve_env_class(name)
    except ValueError:
        return [f"{key}.name: {unknown_name_message('environment', name, list_envs())}"]
    except (ImportError, TypeError) as exc:
        return [f"{key}.name: {exc}"]
    if check is not None:
        return prefixed(check(config), f"{key}.config")
    return _class_config_problems(cls, config, f"{key}.config")


def _class_config_problems(cls: type, config: Any, key: str) -> list[str]:
    """The types of the class's config TypedDict, then its own ``config_problems``."""
    from envloop.config.env_fields import env_config_problems

    own_check = getattr(cls, "config_problems", None)
    own = prefixed(own_check(config), key) if callable(own_check) else []
    return list(dict.fromkeys(env_config_problems(cls, config, key) + own))


def _env_path_problems(key: str, config: Mapping[str, Any]) -> list[str]:
    """Models, tokenizers and checkpoints an environment's config names, and any other
    ``bundled:<name>`` inside it."""
    problems = []
    for name in ENV_MODEL_KEYS:
        value = config.get(name)
        value = value.get("name") if isinstance(value, Mapping) else value
        if isinstance(value, str):
            problems += _some(model_problem(f"{key}.{name}", value))
    for name, what in ENV_FILE_KEYS.items():
        if isinstance(config.get(name), str):
            problems += _some(file_problem(f"{key}.{name}", config[name], what))
    rest = {k: v for k, v in config.items() if k not in ENV_MODEL_KEYS}
    try:
        resolve_bundled(rest)
    except (ValueError, FileNotFoundError) as exc:
        problems.append(f"{key}: {exc}")
    return problems


def _some(problem: str | None) -> list[str]:
    return [] if problem is None else [problem]


def _section(raw: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    value = raw.get(name)
    return value if isinstance(value, Mapping) else {}


def _is_class(obj: Any) -> bool:
    return isinstance(obj, type)
