"""The config of ``envloop run``: one typed section per concern, loaded from YAML plus
dotted ``key=value`` overrides, and validated with every problem reported at once.

>>> config = load_run_config(None, ["policy.model_name=bundled:policy", "data.path=d.jsonl",
...                                 "envs.math.name=math", "rollout.max_turns=2"], deep=False)
>>> config.rollout.max_turns, config.policy.max_new_tokens, config.envs["math"].name
(2, 512, 'math')
>>> load_run_config(None, ["policy.model_name=m", "data.path=d.jsonl", "envs.math.name=math",
...                        "policy.tempreature=2", "rollout.max_turns=four"], deep=False)
Traceback (most recent call last):
...
envloop.config.errors.ConfigError: Invalid run config:
  - policy.tempreature: unknown option. Did you mean 'temperature'?
  - rollout.max_turns: expected int, got str ('four')
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import Field, field_validator

from envloop.config.declarations import markdown_table, reference_rows
from envloop.config.errors import ConfigError
from envloop.config.validation import Config
from envloop.data.dataset_config import DataConfig
from envloop.run.config_checks import env_problems, semantic_problems
from envloop.run.config_sections import (
    EnvConfig,
    HfPolicyConfig,
    OutputConfig,
    PolicyConfig,
    RayConfig,
    RolloutConfig,
    ServerPolicyConfig,
)

__all__ = [
    "DataConfig",
    "EnvConfig",
    "HfPolicyConfig",
    "OutputConfig",
    "PolicyConfig",
    "RayConfig",
    "RolloutConfig",
    "RunConfig",
    "ServerPolicyConfig",
    "apply_overrides",
    "config_reference_rows",
    "config_reference_table",
    "load_run_config",
]


class RunConfig(Config, title="run config"):
    """Everything ``envloop run`` needs; ``config.yaml`` in a run directory is this, resolved."""

    policy: PolicyConfig
    """The policy."""
    data: DataConfig
    """The prompts."""
    envs: Annotated[dict[str, EnvConfig], Field(json_schema_extra={"placeholder": "task"})]
    """Task name -> environment."""
    rollout: RolloutConfig = RolloutConfig()
    """Rollouts."""
    ray: RayConfig = RayConfig()
    """The Ray session."""
    output: OutputConfig = OutputConfig()
    """The results."""

    @field_validator("envs")
    @classmethod
    def _some_task(cls, envs: dict[str, EnvConfig]) -> dict[str, EnvConfig]:
        if not envs:
            raise ValueError("name at least one task, e.g. envs: {math: {name: math}}")
        return envs

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dicts (what ``config.yaml`` holds)."""
        return self.model_dump()


def load_run_config(
    path: str | Path | None, overrides: Sequence[str] = (), *, deep: bool = True
) -> RunConfig:
    """The YAML file at ``path`` (None: start from nothing) with ``overrides`` applied,
    validated. Raises one :class:`ConfigError` naming every bad key. With ``deep``, also
    checks that ``data.path`` and a ``policy.chat_template`` file exist (a relative path not
    found in the current directory is looked up next to the config file), that models,
    tokenizers and checkpoints can be found, and that the environments exist and their
    configs pass every check their constructors run (see
    :func:`~envloop.run.config_checks.env_problems`).

    The environment checks run only once everything else is valid: a built-in's imports
    nothing heavy, but an environment without a registered config check is checked by
    importing its class, and with it torch (about a second)."""
    raw = _read_yaml(path) if path is not None else {}
    problems: list[str] = []
    raw = apply_overrides(raw, overrides, problems)
    if deep and path is not None:
        _resolve_relative_paths(raw, Path(path).parent)
    try:
        config = RunConfig.from_mapping(raw)
    except ConfigError as exc:
        config, problems = None, problems + exc.problems
    if deep:
        problems += semantic_problems(raw)
    if not problems and deep:
        problems += env_problems(raw)
    if problems or config is None:
        raise ConfigError("run config", problems)
    return config


def apply_overrides(
    raw: dict[str, Any], overrides: Sequence[str], problems: list[str]
) -> dict[str, Any]:
    """A copy of ``raw`` with each ``dotted.key=value`` set; values are parsed as YAML
    (``2`` is an int, ``null`` is None, ``[a, b]`` a list). Malformed overrides are added
    to ``problems``.

    >>> apply_overrides({"rollout": {"max_turns": 4}}, ["rollout.max_turns=2", "a.b=[x]"], [])
    {'rollout': {'max_turns': 2}, 'a': {'b': ['x']}}
    """
    result = _deep_copy(raw)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            problems.append(
                f"override {item!r}: expected dotted.key=value, e.g. rollout.max_turns=4"
            )
            continue
        try:
            value = yaml.load(text, Loader=_YamlLoader)
        except yaml.YAMLError as exc:
            problems.append(f"{key}: override value {text!r} is not valid YAML ({exc})")
            continue
        *parents, last = key.split(".")
        node = result
        for i, part in enumerate(parents):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                where = ".".join(parents[: i + 1])
                problems.append(f"{key}: cannot set it, {where} is {child!r}, not a mapping")
                break
            node = child
        else:
            node[last] = value
    return result


def config_reference_rows() -> Iterator[tuple[str, str, str, str]]:
    """``(dotted key, type, default, description)`` of every config field, in file order."""
    return reference_rows(RunConfig)


def config_reference_table() -> str:
    """The config reference as a Markdown table (docs/config-reference.md holds a copy,
    checked against it)."""
    rows = (
        (f"`{key}`", type_, f"`{default}`" if default else "", description)
        for key, type_, default, description in config_reference_rows()
    )
    return markdown_table(("key", "type", "default", "description"), rows)


class _YamlLoader(yaml.SafeLoader):
    """YAML's safe loader, reading ``1e-3`` as a float, as YAML 1.2 does (1.1 needs a dot:
    ``1.0e-3``; without this, ``lr: 1e-3`` is a string and fails a float field)."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError("run config", [f"{path}: no such config file"])
    try:
        raw = yaml.load(path.read_text(encoding="utf-8"), Loader=_YamlLoader)
    except yaml.YAMLError as exc:
        raise ConfigError("run config", [f"{path}: not valid YAML ({exc})"]) from exc
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(
            "run config", [f"{path}: expected a mapping of sections, got {raw!r:.40}"]
        )
    return raw


def _resolve_relative_paths(raw: dict[str, Any], config_dir: Path) -> None:
    """A relative ``data.path``, or ``policy.chat_template`` file, missing from the current
    directory but present next to the config file is taken from there."""
    for section, key in (("data", "path"), ("policy", "chat_template")):
        values = raw.get(section)
        if not isinstance(values, dict) or not isinstance(values.get(key), str):
            continue
        path = Path(values[key])
        if section == "policy" and path.suffix != ".jinja":
            continue  # template text, or "default"
        if not path.is_absolute() and not path.exists() and (config_dir / path).exists():
            values[key] = str(config_dir / path)


def _deep_copy(raw: dict[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, dict) else v for k, v in raw.items()}
