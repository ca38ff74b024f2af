"""``envloop envs`` and ``envloop check-env``: what environments exist and whether one keeps
the ``EnvironmentInterface`` contract."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

import yaml

from envloop.config.env_fields import env_config_fields

DEFAULT_SAMPLES: list[tuple[list[dict[str, str]], dict[str, Any]]] = [
    (
        [{"role": "user", "content": "What is 2 + 3?"},
         {"role": "assistant", "content": "2 + 3 = 5, so the answer is \\boxed{5}."}],
        {"ground_truth": "5"},
    ),
    (
        [{"role": "user", "content": "What is 6 * 7?"},
         {"role": "assistant", "content": "I think it is \\boxed{41}."}],
        {"ground_truth": "42"},
    ),
]  # fmt: skip
"""Samples ``check-env`` steps when given none: a right and a wrong math answer."""


def list_command(args: argparse.Namespace) -> int:
    """Print each registered environment, its class, and its config fields with defaults."""
    from envloop.environments.registry import get_env_class, list_envs, unknown_name_message

    names = args.names or list_envs()
    unknown = [name for name in names if name not in list_envs()]
    if unknown:
        print(unknown_name_message("environment", unknown[0], list_envs()))
        return 1
    print(ENVS_HEADER + "\n")
    for name in names:
        try:
            cls = get_env_class(name)
        except ValueError:
            print(unknown_name_message("environment", name, list_envs()))
            return 1
        except (ImportError, TypeError) as exc:
            print(f"{name}\n  (cannot import: {exc})\n")
            continue
        print(f"{name}  ({cls.__module__}:{cls.__qualname__})")
        print(describe_config(cls) + "\n")
    return 0


ENVS_HEADER = (
    "Registered environments: each one's class, then its config keys with their type, default\n"
    '(JSON notation: null, true, "text") and description. Set them under envs.<task>.config\n'
    "in a run config; envloop envs NAME shows one."
)
COLUMNS = ("key", "type", "default", "description")
WIDE_DEFAULT = 24
"""Defaults longer than this do not widen their column (their description follows them)."""
_RESTATED_DEFAULTS = (re.compile(r"\s*\[(.*)\]$"), re.compile(r"\s*\((?:default:? )?([^()]*)\)$"))


def describe_config(cls: type) -> str:
    """The config fields of environment ``cls`` as aligned lines under a column header:
    key, type, default (JSON notation), description (without a restated default)."""
    fields = env_config_fields(cls)
    if not fields:
        return "  (no typed config found)"
    rows = [COLUMNS] + [
        (f.name, f.type, json.dumps(f.default), describe_field(f.help, f.default)) for f in fields
    ]
    widths = [max(len(r[i]) for r in rows if i < 2 or len(r[i]) <= WIDE_DEFAULT) for i in range(3)]
    return "\n".join(
        f"  {n:<{widths[0]}}  {t:<{widths[1]}}  {d:<{widths[2]}}  {h}".rstrip()
        for n, t, d, h in rows
    )


def describe_field(help_text: str, default: Any) -> str:
    """``help_text`` without a trailing restatement of ``default`` (``[4]``, ``(10)``,
    ``(default 2)``: the default column shows it), and ``None`` written as ``null``.

    >>> describe_field("worker processes (default 2)", 2), describe_field("limit [10.0]", 10.0)
    ('worker processes', 'limit')
    >>> describe_field('ends there [["</code>"]]', ["</code>"]), describe_field("x (None)", None)
    ('ends there', 'x')
    >>> describe_field("stop strings (default None: EOS only)", None)
    'stop strings (null: EOS only)'
    >>> describe_field('how answers are checked (None: "math")', "math")
    'how answers are checked (null: "math")'
    """
    for pattern in _RESTATED_DEFAULTS:
        match = pattern.search(help_text)
        if match and _same_value(match.group(1), default):
            return _null(help_text[: match.start()])
    return _null(help_text)


def _null(text: str) -> str:
    return re.sub(r"\b(?:default )?None\b", "null", text)


def _same_value(text: str, default: Any) -> bool:
    try:
        value = None if text == "None" else yaml.safe_load(text)
    except yaml.YAMLError:
        return False
    return bool(value == default and type(value) in (type(default), int, float))


def check_command(args: argparse.Namespace) -> int:
    """Instantiate the environment (its default config unless ``--config``), step it on
    samples and run :func:`envloop.environments.check_env`; 0 when it passes, else 1."""
    from envloop.run.config_checks import resolve_env_class

    cls = resolve_env_class(args.target)
    config = _load_config(args.config)
    logs, metadata = _load_samples(args.sample_jsonl, cls, config)
    hint = _SAMPLES_HINT if args.sample_jsonl is None else ""
    try:
        env = cls(config) if config is not None else cls()
    except Exception as exc:
        print(f"FAILED: {cls.__qualname__}({'config' if config else ''}) raised {exc!r}")
        return 1
    try:
        status = _check(env, logs, metadata, cls.__qualname__, hint)
        if status == 0 and args.ray:
            status = _check_as_actor(cls, config, logs, metadata, hint)
    finally:
        if hasattr(env, "shutdown"):
            env.shutdown()
    return status


_SAMPLES_HINT = (
    "check-env stepped its {n} default samples (math answers); pass samples with the "
    "metadata your environment needs: --sample-jsonl FILE, one JSON object per line, e.g. "
    '{{"messages": [{{"role": "user", "content": "..."}}, {{"role": "assistant", '
    '"content": "..."}}], "metadata": {{{key}: ...}}}}'
)
"""Printed when a step fails for want of a metadata key and the default samples were used."""


def _check(env: Any, logs: list, metadata: list, name: str, hint: str = "") -> int:
    from envloop.environments.checker import (
        EnvironmentContractError,
        MissingMetadataError,
        check_env,
    )

    try:
        ret = check_env(env, logs, metadata)
    except MissingMetadataError as exc:
        print(f"FAILED: {exc}")
        if hint:
            print(hint.format(n=len(logs), key=json.dumps(exc.key, default=str)))
        return 1
    except EnvironmentContractError as exc:
        print(f"FAILED: {exc}")
        return 1
    rewards = ret.rewards if isinstance(ret.rewards, dict) else {"reward": ret.rewards}
    samples = f"{len(logs)} sample{'s' * (len(logs) != 1)}"
    print(f"OK: {name} keeps the environment contract on {samples}")
    for i, observation in enumerate(ret.observations):
        parts = ", ".join(f"{k} {float(v[i]):.4g}" for k, v in rewards.items())
        text = str(observation.get("content", ""))[:70].replace("\n", " ")
        print(f"  sample {i}: {parts}; {observation.get('role')}: {text!r}")
    return 0


def _check_as_actor(cls: type, config: Any, logs: list, metadata: list, hint: str) -> int:
    import ray

    from envloop.distributed.ray_utils import init_ray
    from envloop.environments.interfaces import actor_class

    init_ray(num_cpus=2, log_to_driver=False)
    actor_cls = actor_class(cls)
    actor = actor_cls.remote(config) if config is not None else actor_cls.remote()
    try:
        return _check(actor, logs, metadata, f"{cls.__qualname__} as a Ray actor", hint)
    finally:
        ray.kill(actor)


def _load_config(text: str | None) -> Any:
    if text is None:
        return None
    path = Path(text)
    if path.is_file():
        text = path.read_text(encoding="utf-8")
    return yaml.safe_load(text)


def _load_samples(path: str | None, cls: type, config: Any) -> tuple[list, list]:
    """``--sample-jsonl``'s samples, else :data:`DEFAULT_SAMPLES` (with episodes from the
    environment's ``new_episode_metadata(seed)`` when it has one)."""
    logs: list[Any] = []
    metadata: list[Any] = []
    if path is None:
        logs = [log for log, _ in DEFAULT_SAMPLES]
        metadata = [dict(md) for _, md in DEFAULT_SAMPLES]
        if callable(getattr(cls, "new_episode_metadata", None)):
            env = cls(config) if config is not None else cls()
            metadata = [env.new_episode_metadata(seed) for seed in range(len(logs))]
        return logs, metadata
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        sample = json.loads(line)
        if not isinstance(sample, dict) or not isinstance(sample.get("messages"), list):
            raise ValueError(
                f"{path}, line {number}: expected {{'messages': [...], 'metadata': ...}}"
            )
        logs.append(sample["messages"])
        metadata.append(sample.get("metadata"))
    if not logs:
        raise ValueError(f"{path} holds no samples")
    return logs, metadata
