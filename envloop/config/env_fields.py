"""What an environment class accepts as config: its TypedDict, defaults and field comments.

Environments declare their config as a TypedDict annotated on ``__init__``'s config
parameter, with one ``# comment`` per field, and keep defaults in a module-level dict
(``DEFAULTS``, ``DEFAULT_CONFIG`` or ``_DEFAULTS``). Everything here degrades gracefully:
a class without an annotated config yields no fields and accepts any mapping.

>>> from envloop.environments.games.sliding_puzzle import SlidingPuzzleEnv
>>> [(f.name, f.type, f.default) for f in env_config_fields(SlidingPuzzleEnv)][:2]
[('default_size', 'int', 3), ('default_shuffle_moves', 'int', 10)]
>>> env_config_problems(SlidingPuzzleEnv, {"move_penalti": 0.1}, "envs.puzzle.config")
["envs.puzzle.config.move_penalti: unknown option. Did you mean 'move_penalty'?"]
"""

from __future__ import annotations

import inspect
import re
import sys
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

from typing_extensions import is_typeddict

from envloop.config.declarations import type_name
from envloop.config.errors import prefixed

DEFAULTS_NAMES = ("DEFAULTS", "DEFAULT_CONFIG", "_DEFAULTS")
_COMMENTED_FIELD = re.compile(r"^\s+(\w+)\s*:[^#]*#\s*(.+?)\s*$")


@dataclass(frozen=True)
class EnvConfigField:
    """One config key of an environment."""

    name: str
    type: str  # readable type, e.g. "int or null"
    default: Any  # the module's default value, or None when it names none
    help: str  # the field's comment in the TypedDict, or ""


def env_config_spec(cls: type) -> type | None:
    """The TypedDict annotated on the first parameter of ``cls.__init__``, if any."""
    init: Any = cast(Any, cls).__init__
    try:
        params = list(inspect.signature(init).parameters.values())[1:]
        hints = typing.get_type_hints(init)
    except Exception:
        return None
    if not params or params[0].name not in hints:
        return None
    candidates = typing.get_args(hints[params[0].name]) or (hints[params[0].name],)
    return next((c for c in candidates if is_typeddict(c)), None)


def env_defaults(cls: type) -> dict[str, Any]:
    """The module-level defaults dict next to ``cls`` or its config TypedDict ({} if none)."""
    spec = env_config_spec(cls)
    for module_name in dict.fromkeys([cls.__module__, getattr(spec, "__module__", "")]):
        module = sys.modules.get(module_name)
        for name in DEFAULTS_NAMES:
            value = getattr(module, name, None)
            if isinstance(value, dict):
                return value
    return {}


def env_config_fields(cls: type) -> list[EnvConfigField]:
    """Every key of the environment's config TypedDict, in declaration order."""
    spec = env_config_spec(cls)
    if spec is None:
        return []
    from envloop.config.validation import declared_fields

    defaults, helps = env_defaults(cls), _field_comments(spec)
    return [
        EnvConfigField(
            f.name,
            type_name(f.annotation),
            f.default if f.default is not None else defaults.get(f.name),
            f.description or helps.get(f.name, ""),
        )
        for f in declared_fields(spec)
    ]


def env_config_problems(cls: type, config: Any, prefix: str) -> list[str]:
    """Problems of ``config`` against the environment's TypedDict (nested TypedDicts
    included, checked over their defaults as environments merge them), each prefixed with
    ``prefix``; [] when the class declares no TypedDict. Range checks are the class's own
    (``EnvironmentInterface.config_problems``)."""
    from envloop.config.validation import config_problems

    spec = env_config_spec(cls)
    if config is None or spec is None:
        return []
    if isinstance(config, Mapping):
        config = _over_nested_defaults(config, spec, env_defaults(cls))
    return prefixed(config_problems(spec, config), prefix)


def _over_nested_defaults(
    config: Mapping[str, Any], spec: type, defaults: Mapping[str, Any]
) -> dict[str, Any]:
    """``config`` with each nested section (a TypedDict field) merged over its default."""
    merged = dict(config)
    for key, hint in typing.get_type_hints(spec).items():
        default = defaults.get(key)
        if _nested_spec(hint) is None or not isinstance(default, Mapping):
            continue
        value = merged.get(key, default)
        merged[key] = {**default, **value} if isinstance(value, Mapping) else value
    return merged


def _nested_spec(hint: Any) -> type | None:
    candidates = typing.get_args(hint) or (hint,)
    return next((c for c in candidates if is_typeddict(c)), None)


def _field_comments(spec: type) -> dict[str, str]:
    try:
        source = inspect.getsource(spec)
    except (OSError, TypeError):
        return {}
    matches = (_COMMENTED_FIELD.match(line) for line in source.splitlines())
    return {m.group(1): m.group(2) for m in matches if m}
