"""Dataclass configs built from nested mappings (YAML), every problem named by its dotted key.

A config class is a dataclass whose fields are declared with :func:`option` (a default, a
one-line help text and an optional value check). :func:`build_config` checks a mapping
against it recursively and collects every problem (unknown keys with a close match, missing
required keys, wrong types, bad values) instead of stopping at the first;
:func:`reference_rows` lists every field for documentation.

>>> from dataclasses import dataclass
>>> @dataclass(kw_only=True)
... class Rollout:
...     max_turns: int = option(4, "turns per sample", check=at_least(1))
>>> problems = []
>>> build_config(Rollout, {"max_turns": "four", "max_turn": 2}, "rollout", problems) is None
True
>>> print("\\n".join(problems))
rollout.max_turn: unknown option. Did you mean 'max_turns'?
rollout.max_turns: expected int, got 'four'
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal, TypeVar

from envloop.config.errors import unknown_keys

T = TypeVar("T")
Check = Callable[[Any], "str | None"]
"""A value check: None when the value is fine, else what is wrong with it."""


def option(
    default: Any = dataclasses.MISSING, help: str = "", *, check: Check | None = None
) -> Any:
    """A dataclass field with a default, ``help`` text and an optional ``check`` of its
    value (for immutable defaults; use ``dataclasses.field(..., metadata=meta(...))`` for
    others)."""
    return dataclasses.field(default=default, metadata=meta(help, check=check))


def meta(help: str, *, check: Check | None = None, placeholder: str = "name") -> dict[str, Any]:
    """Field metadata: ``help`` text, a value ``check``, and the ``placeholder`` naming the
    keys of a ``dict[str, Section]`` field in :func:`reference_rows`."""
    return {"help": help, "check": check, "placeholder": placeholder}


def at_least(low: float, *, above: bool = False) -> Check:
    """A check that a number (when not None) is >= ``low`` (> ``low`` with ``above``)."""

    def check(value: Any) -> str | None:
        bad = value is not None and (value <= low if above else value < low)
        return f"{value!r} must be {'>' if above else '>='} {low}" if bad else None

    return check


def build_config(cls: type[T], raw: Any, prefix: str, problems: list[str]) -> T | None:
    """``cls`` built from mapping ``raw`` (None counts as empty); None when anything is wrong,
    with one line per problem appended to ``problems``, each starting with its dotted key."""
    raw = {} if raw is None else raw
    if not isinstance(raw, Mapping):
        problems.append(f"{prefix}: expected a mapping, got {_show(raw)}")
        return None
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    hints = typing.get_type_hints(cls)
    start = len(problems)
    problems += [_dotted(prefix, p) for p in unknown_keys(raw, fields)]
    values: dict[str, Any] = {}
    for name, f in fields.items():
        key, before = _dotted(prefix, name), len(problems)
        if name in raw or _dataclass_of(hints[name]):
            values[name] = _build_value(raw.get(name), hints[name], key, problems)
        elif _required(f):
            problems.append(f"{key}: required")
        check = f.metadata.get("check")
        message = (
            check(values[name]) if check and name in values and len(problems) == before else None
        )
        if message:
            problems.append(f"{key}: {message}")
    return cls(**values) if len(problems) == start else None


def reference_rows(cls: type, prefix: str = "") -> Iterator[tuple[str, str, str, str]]:
    """``(dotted key, type, default, description)`` for every field of ``cls``, nested
    sections flattened; a ``dict[str, Section]`` field is listed as ``key.<name>.*``."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key, hint = _dotted(prefix, f.name), hints[f.name]
        if _dataclass_of(hint) is not None:
            yield from reference_rows(hint, key)
        elif _dict_section_of(hint) is not None:
            name = f.metadata.get("placeholder", "name")
            yield from reference_rows(_dict_section_of(hint), f"{key}.<{name}>")  # type: ignore[arg-type]
        else:
            yield key, type_name(hint), _default_text(f), f.metadata.get("help", "")


def type_name(hint: Any) -> str:
    """A readable name of a field type: ``int``, ``int or null``, ``one of sync, async``.

    >>> type_name(int | None), type_name(Literal["a", "b"]), type_name(list[str] | None)
    ('int or null', 'one of a, b', 'list of str or null')
    """
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        named = [type_name(a) for a in args if a is not type(None)]
        return " or ".join(named) + (" or null" if type(None) in args else "")
    if origin is Literal:
        return "one of " + ", ".join(str(a) for a in args)
    if origin is list:
        return f"list of {type_name(args[0])}" if args else "list"
    if origin is dict or hint is dict:
        return "mapping"
    if hint is Any:
        return "any"
    return getattr(hint, "__name__", str(hint))


def _build_value(value: Any, hint: Any, key: str, problems: list[str]) -> Any:
    section = _dataclass_of(hint)
    if section is not None:
        return build_config(section, value, key, problems)
    section = _dict_section_of(hint)
    if section is not None:
        if not isinstance(value, Mapping):
            problems.append(f"{key}: expected a mapping, got {_show(value)}")
            return None
        return {
            name: build_config(section, v, f"{key}.{name}", problems) for name, v in value.items()
        }
    ok, converted = _converted(value, hint)
    if not ok:
        problems.append(f"{key}: expected {type_name(hint)}, got {_show(value)}")
    return converted


def _converted(value: Any, hint: Any) -> tuple[bool, Any]:
    """Whether ``value`` fits ``hint``, and the value (ints and numeric strings such as
    YAML's ``1e-3`` become floats where a float is expected)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            ok, converted = _converted(value, arg)
            if ok:
                return True, converted
        return False, value
    if hint is type(None):
        return value is None, value
    if origin is Literal:
        return value in args and isinstance(value, str) == isinstance(args[0], str), value
    if hint is float:
        if isinstance(value, str):
            try:
                return True, float(value)
            except ValueError:
                return False, value
        return _is_number(value), float(value) if _is_number(value) else value
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if origin is list:
        items = [_converted(v, args[0]) for v in value] if isinstance(value, list) else [(False, 0)]
        return all(ok for ok, _ in items), [v for _, v in items] if isinstance(
            value, list
        ) else value
    if hint is Any:
        return True, value
    target = origin or hint
    return isinstance(value, target), value


def _dataclass_of(hint: Any) -> type | None:
    return hint if dataclasses.is_dataclass(hint) and isinstance(hint, type) else None


def _dict_section_of(hint: Any) -> type | None:
    if typing.get_origin(hint) is dict:
        return _dataclass_of(typing.get_args(hint)[1])
    return None


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _default_text(f: dataclasses.Field) -> str:
    if _required(f):
        return "(required)"
    factory: Any = f.default_factory
    value = f.default if f.default is not dataclasses.MISSING else factory()
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return value if isinstance(value, str) else json.dumps(value)


def _dotted(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


def _show(value: Any) -> str:
    return f"{value!r:.60}" if not isinstance(value, (dict, list)) else type(value).__name__


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
