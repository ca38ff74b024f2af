"""pydantic's validation errors in envloop's wording: one line per bad key, dotted.

``batch_size: must be >= 1, got 0``; ``sise: unknown option. Did you mean 'size'?``;
``stop_strings: expected list[str] | None, got str ('x')``. Used by
:mod:`envloop.config.validation` for every config, TypedDict or :class:`Config` class.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import math
import re
import types
import typing
from collections.abc import Mapping
from typing import Any

import typing_extensions
from pydantic import BaseModel, Tag, ValidationError

__all__ = ["record_fields", "strip_annotations", "validation_problems"]


def validation_problems(spec: type, exc: ValidationError) -> list[str]:
    """One line per bad key of ``exc`` (raised validating ``spec``).

    pydantic reports a value that fits no member of a union once per member. When the value
    has one member's type and fails inside it (a range, a nested key), only that member's
    problems are shown; when it has none of their types, one line names the whole union."""
    errors = [_located(spec, error) for error in exc.errors(include_url=False)]
    failed_inside = {e["union"] for e in errors if e["union"] is not None and e["inside"]}
    by_key: dict[str, list[dict[str, Any]]] = {}
    for error in errors:
        if error["inside"] or error["union"] not in failed_inside:
            by_key.setdefault(error["key"], []).append(error)
    return [_line(key, errors) for key, errors in by_key.items()]


def record_fields(spec: Any) -> dict[str, Any]:
    """The fields of a TypedDict, dataclass or pydantic model, name -> annotation (with its
    ``Annotated`` metadata); {} for anything else."""
    if isinstance(spec, type) and issubclass(spec, BaseModel):
        return {name: f.rebuild_annotation() for name, f in spec.model_fields.items()}
    if typing_extensions.is_typeddict(spec) or dataclasses.is_dataclass(spec):
        return typing.get_type_hints(spec, include_extras=True)
    return {}


def strip_annotations(annotation: Any) -> Any:
    """``annotation`` without ``Annotated[...]``, ``Required[...]`` and ``NotRequired[...]``."""
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) in (typing_extensions.Required, typing_extensions.NotRequired):
        return strip_annotations(typing.get_args(annotation)[0])
    return annotation


def _line(key: str, errors: list[dict[str, Any]]) -> str:
    first = errors[0]
    if len(errors) > 1 or _is_type_error(first["type"]):
        message = _expected(first["annotation"], first["input"])
    else:
        message = _message(first)
    return f"{key}: {message}" if key else message


def _is_type_error(kind: str) -> bool:
    """Whether pydantic error type ``kind`` says the value has the wrong type."""
    return kind.endswith(("_type", "_parsing")) or kind in (
        "is_instance_of", "none_required", "model_type", "model_attributes_type", "dict_type",
    )  # fmt: skip


def _message(error: dict[str, Any]) -> str:
    kind, ctx, value = error["type"], error.get("ctx") or {}, error.get("input")
    bounds = {
        "greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=",
        "less_than": "<",
    }  # fmt: skip
    if kind in bounds:
        limit = next(iter(ctx.values()))
        if isinstance(limit, float) and limit.is_integer():
            limit = int(limit)  # a float field's bound reads as written: ">= 0", not ">= 0.0"
        return f"must be {bounds[kind]} {limit}, got {_shown(value)}"
    if kind == "value_error":  # a validator's own problem line (e.g. options in conflict)
        return str(ctx.get("error", error["msg"]))
    if kind == "finite_number":
        return f"must be a finite number, got {_shown(value)}"
    if kind in ("extra_forbidden", "unexpected_keyword_argument"):
        name = str(error["loc"][-1])
        close = difflib.get_close_matches(name, error["known"], n=1)
        hint = f"Did you mean {close[0]!r}?" if close else f"Known: {', '.join(error['known'])}."
        return f"unknown option. {hint}"
    if kind == "missing":
        return "required"
    if kind == "literal_error":
        expected = ctx.get("expected", "")
        names = re.findall(r"'([^']*)'", expected) or re.split(r", | or ", expected)
        close = difflib.get_close_matches(_shown(value, 200).strip("'"), names, n=1)
        hint = f". Did you mean {close[0]!r}?" if close else ""
        return f"{_shown(value)} is not one of {', '.join(names)}{hint}"
    if kind in ("too_short", "string_too_short"):
        what = "item" if kind == "too_short" else "character"
        count = ctx["min_length"]
        return f"must have at least {count} {what}{'s' * (count != 1)}, got {_shown(value)}"
    return f"{error['msg'][0].lower()}{error['msg'][1:]}"


def _expected(annotation: Any, value: Any) -> str:
    return f"expected {_type_name(annotation)}, got {type(value).__name__} ({_shown(value, 40)})"


def _shown(value: Any, limit: int | None = None) -> str:
    """``repr(value)``, cut to ``limit`` characters; a value whose repr fails (an int past
    Python's 4,300-digit limit, inside a container or not) is described instead.

    >>> _shown("abc"), _shown(10**5000), _shown([1, 10**5000], 10)
    ("'abc'", 'an int of about 5001 digits', 'a list tha')
    """
    try:
        text = repr(value)
    except ValueError:
        if isinstance(value, int):
            text = f"an int of about {int(math.log10(abs(value))) + 1} digits"
        else:
            text = f"a {type(value).__name__} that cannot be printed"
    return text if limit is None else text[:limit]


def _type_name(annotation: Any) -> str:
    """``int``, ``list[str] | None``, ``'a' | 'b'``: how problems name a type."""
    annotation = strip_annotations(annotation)
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if annotation is type(None):
        return "None"
    if origin is dict:
        return "dict"
    if origin is collections.abc.Callable:
        return "a function"
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type_name(a) for a in args)}]"
    if annotation is float:
        return "number"
    if typing_extensions.is_typeddict(annotation) or (
        isinstance(annotation, type) and issubclass(annotation, (Mapping, BaseModel))
    ):
        return "a mapping"
    return getattr(annotation, "__name__", str(annotation))


def _located(spec: Any, error: Any) -> dict[str, Any]:
    """``error`` with its dotted ``key``, the ``annotation`` there, the ``known`` names beside
    it (for unknown keys), the dotted key of the last ``union`` its location crosses (None:
    none), and whether it failed ``inside`` that union's member rather than on its type."""
    parts: list[str] = []
    current, known = spec, _keys(spec)
    union, union_annotation, depth = None, None, 0
    for step in error["loc"]:
        current = strip_annotations(current)
        member = _union_member(current, step)
        if member is not None:
            union, union_annotation, depth = ".".join(parts), current, 0
            current = member
            continue
        depth += 1
        current = _without_none(current)  # pydantic reports X | None's errors as X's
        if _is_record(current) and isinstance(step, str):
            hints = record_fields(current)
            known = list(hints)
            parts.append(step)
            current = hints.get(step)
        elif typing.get_origin(current) in (list, tuple) and isinstance(step, int):
            parts[-1] = f"{parts[-1]}[{step}]" if parts else f"[{step}]"
            current = (typing.get_args(current) or (Any,))[0]
        elif typing.get_origin(current) is dict and isinstance(step, str):
            parts.append(step)
            current = (typing.get_args(current) or (Any, Any))[-1]
        else:
            parts.append(str(step))
            current = None
    inside = depth > 0 or not (_is_type_error(error["type"]) or error["type"] == "literal_error")
    if union is not None and not inside:
        current = union_annotation  # a type mismatch: the union as a whole is expected
    return {**error, "key": ".".join(parts), "annotation": current, "known": known,
            "union": union, "inside": inside}  # fmt: skip


def _without_none(annotation: Any) -> Any:
    """``X`` for ``X | None``; any other annotation unchanged."""
    if typing.get_origin(annotation) not in (typing.Union, types.UnionType):
        return annotation
    members = [m for m in typing.get_args(annotation) if m is not type(None)]
    return strip_annotations(members[0]) if len(members) == 1 else annotation


def _is_record(spec: Any) -> bool:
    """A type whose fields are keys of the config."""
    return bool(record_fields(spec)) or typing_extensions.is_typeddict(spec)


def _keys(spec: Any) -> list[str]:
    return list(record_fields(spec))


def _union_member(annotation: Any, tag: Any) -> Any:
    """The member of union ``annotation`` that pydantic's location tag ``tag`` names."""
    if typing.get_origin(annotation) not in (typing.Union, types.UnionType):
        return None
    for member in typing.get_args(annotation):
        names = {_tag(member), _type_name(member), f"constrained-{_tag(strip_annotations(member))}"}
        names |= {m.tag for m in getattr(member, "__metadata__", ()) if isinstance(m, Tag)}
        if tag in names:
            return member
    return None


def _tag(member: Any) -> str:
    """How pydantic names a union member in an error location."""
    if member is type(None):
        return "none"
    if member is Any:
        return "any"
    origin = typing.get_origin(strip_annotations(member))
    if origin is typing.Literal:
        values = ",".join(repr(a) for a in typing.get_args(strip_annotations(member)))
        return f"literal[{values}]"
    if origin is not None:
        return f"{origin.__name__}[{','.join(_tag(a) for a in typing.get_args(member))}]"
    if typing_extensions.is_typeddict(member):
        return member.__name__
    return getattr(member, "__name__", str(member))
