"""The config of ``envloop run``: one typed section per concern, loaded from YAML plus
dotted ``key=value`` overrides, and validated with every problem reported at once.

>>> config = load_run_config(None, ["data.path=d.jsonl", "envs.math.name=math",
...                                 "rollout.max_turns=2"], deep=False)
>>> config.rollout.max_turns, config.policy.model, config.envs["math"].name
(2, 'bundled:policy', 'math')
>>> load_run_config(None, ["data.path=d.jsonl", "envs.math.name=math", "policy.tempreature=2",
...                        "rollout.max_turns=four"], deep=False)
Traceback (most recent call last):
...
envloop.config.errors.ConfigError: Invalid run config:
  - policy.tempreature: unknown option. Did you mean 'temperature'?
  - rollout.max_turns: expected int, got 'four'
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import field
from pathlib import Path
from typing import Any

import yaml

from envloop.config.errors import ConfigError
from envloop.config.schema import build_config, meta, reference_rows
from envloop.data.dataset_config import DataConfig
from envloop.run.config_checks import env_problems, semantic_problems
from envloop.run.config_sections import (
    EnvConfig,
    OutputConfig,
    PolicyConfig,
    RayConfig,
    RolloutConfig,
)

__all__ = [
    "DataConfig",
    "EnvConfig",
    "OutputConfig",
    "PolicyConfig",
    "RayConfig",
    "RolloutConfig",
    "RunConfig",
    "apply_overrides",
    "config_reference_rows",
    "config_reference_table",
    "load_run_config",
]


@dataclasses.dataclass(kw_only=True)
class RunConfig:
    """Everything ``envloop run`` needs; ``config.yaml`` in a run directory is this, resolved."""

    policy: PolicyConfig = field(default_factory=PolicyConfig, metadata=meta("the policy"))
    data: DataConfig = field(metadata=meta("the prompts"))
    envs: dict[str, EnvConfig] = field(
        metadata=meta("task name -> environment", placeholder="task")
    )
    rollout: RolloutConfig = field(default_factory=RolloutConfig, metadata=meta("rollouts"))
    ray: RayConfig = field(default_factory=RayConfig, metadata=meta("the Ray session"))
    output: OutputConfig = field(default_factory=OutputConfig, metadata=meta("the results"))

    def to_dict(self) -> dict[str, Any]:
        """Plain nested dicts (what ``config.yaml`` holds)."""
        return dataclasses.asdict(self)


def load_run_config(
    path: str | Path | None, overrides: Sequence[str] = (), *, deep: bool = True
) -> RunConfig:
    """The YAML file at ``path`` (None: start from nothing) with ``overrides`` applied,
    validated. Raises one :class:`ConfigError` naming every bad key. With ``deep``, also
    checks that ``data.path`` exists (a relative path not found in the current directory
    is looked up next to the config file), that models, tokenizers and checkpoints can be
    found, and that the environments exist and their configs pass every check their
    constructors run (see :func:`~envloop.run.config_checks.env_problems`).

    The environment checks run only once everything else is valid: a built-in's imports
    nothing heavy, but an environment without a registered config check is checked by
    importing its class, and with it torch (about a second)."""
    raw = _read_yaml(path) if path is not None else {}
    problems: list[str] = []
    raw = apply_overrides(raw, overrides, problems)
    if deep and path is not None:
        _resolve_data_path(raw, Path(path).parent)
    config = build_config(RunConfig, raw, "", problems)
    problems += semantic_problems(raw, deep)
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
            value = yaml.safe_load(text)
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
    """The config reference as a Markdown table (the README's copy is checked against it)."""
    lines = ["| key | type | default | description |", "|---|---|---|---|"]
    for row in config_reference_rows():
        cells = [f"`{row[0]}`", row[1], f"`{row[2]}`" if row[2] else "", row[3]]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def _read_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError("run config", [f"{path}: no such config file"])
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ConfigError("run config", [f"{path}: not valid YAML ({exc})"]) from exc
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(
            "run config", [f"{path}: expected a mapping of sections, got {raw!r:.40}"]
        )
    return raw


def _resolve_data_path(raw: dict[str, Any], config_dir: Path) -> None:
    """A relative ``data.path`` missing from the current directory but present next to the
    config file is taken from there."""
    data = raw.get("data")
    if not isinstance(data, dict) or not isinstance(data.get("path"), str):
        return
    path = Path(data["path"])
    if not path.is_absolute() and not path.exists() and (config_dir / path).exists():
        data["path"] = str(config_dir / path)


def _deep_copy(raw: dict[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, dict) else v for k, v in raw.items()}
