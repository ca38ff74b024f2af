"""Declaring and validating configs: one mechanism (pydantic v2) for every config.

A config is a TypedDict (the published interface's environment configs are) whose fields are
declared once, with their default, constraints and one-line description::

    class PuzzleConfig(TypedDict, total=False):
        size: Annotated[int, Field(3, ge=2, description="N of an N x N puzzle")]

:func:`validated` returns a plain mapping with the defaults filled in, or raises one
:class:`~envloop.config.errors.ConfigError` listing every problem with its dotted key, in
envloop's wording (``size: must be >= 2, got 1``; ``sise: unknown option. Did you mean
'size'?``). Validation is strict: YAML's ``2`` is an int, ``"2"`` is not, and ``true`` is
not a number. :func:`declared_fields` and :func:`declared_defaults` read the declarations
(``envloop envs`` and the README's config reference show them).
"""

from __future__ import annotations

import collections.abc
import dataclasses
import difflib
import functools
import operator
import re
import sys
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar, cast

import typing_extensions
from pydantic import ConfigDict, Field, TypeAdapter, ValidationError
from pydantic.dataclasses import dataclass as pydantic_dataclass
from pydantic.fields import FieldInfo

from envloop.config.errors import ConfigError

__all__ = [
    "DeclaredField",
    "NonEmptyStr",
    "built",
    "config_dataclass",
    "config_problems",
    "declared_defaults",
    "declared_fields",
    "validated",
]

T = TypeVar("T")

STRICT = ConfigDict(strict=True, extra="forbid")
"""How every config is validated: no coercion, no unknown keys."""

NonEmptyStr = Annotated[str, Field(min_length=1)]
"""A string field that may not be empty (names, paths, stop strings)."""


@dataclass(frozen=True)
class DeclaredField:
    """One field of a config, as declared."""

    name: str
    annotation: Any  # the type, without its Annotated metadata
    default: Any  # None when the field declares none
    description: str  # "" when the field declares none
    required: bool
    has_default: bool  # a default value or factory is declared


def validated(spec: type, config: Any, what: str | None = None) -> dict[str, Any]:
    """``config`` (a mapping; None: every default) checked against TypedDict ``spec``, with
    the declared defaults filled in. Raises :class:`ConfigError` (``what``, default the
    spec's name) listing every problem.

    >>> from envloop.environments.code.jaccard_config import CodeJaccardEnvConfig
    >>> validated(CodeJaccardEnvConfig, {"num_workers": 2})
    {'num_workers': 2, 'stop_strings': None, 'alignment_threshold': 0.5}
    >>> validated(CodeJaccardEnvConfig, {"num_workers": 0, "alignment_treshold": 0.2})
    Traceback (most recent call last):
    ...
    envloop.config.errors.ConfigError: Invalid CodeJaccardEnvConfig:
      - num_workers: must be >= 1, got 0
      - alignment_treshold: unknown option. Did you mean 'alignment_threshold'?
    """
    try:
        return dict(_adapter(spec).validate_python({} if config is None else config))
    except ValidationError as exc:
        raise ConfigError(what or spec.__name__, _problems(spec, exc)) from None


@typing_extensions.dataclass_transform(frozen_default=True, field_specifiers=(Field,))
def config_dataclass(what: str) -> Callable[[type[T]], type[T]]:
    """A frozen dataclass whose fields carry their defaults, constraints and descriptions
    (``Annotated[int, Field(ge=0)] = 1``), validated strictly by pydantic on construction;
    a bad value raises one :class:`ConfigError` (titled ``what``) listing every problem.
    Build one from a mapping with :func:`built`."""

    def decorate(cls: type[T]) -> type[T]:
        validated_cls = pydantic_dataclass(frozen=True, config=STRICT)(cls)
        pydantic_init = validated_cls.__init__

        @functools.wraps(pydantic_init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            try:
                pydantic_init(self, *args, **kwargs)
            except ValidationError as exc:
                raise ConfigError(what, _problems(validated_cls, exc)) from None

        validated_cls.__init__ = __init__  # type: ignore[method-assign]
        return cast(type[T], validated_cls)

    return decorate


def built(cls: type[T], options: Any) -> T:
    """An instance of :func:`config_dataclass` ``cls`` from the keyword ``options`` (a
    mapping); raises :class:`ConfigError` listing every problem."""
    if not isinstance(options, Mapping):
        raise ConfigError(cls.__name__, [f"expected a mapping, got {type(options).__name__}"])
    return cls(**options)


def config_problems(spec: type, config: Any) -> list[str]:
    """Every problem of ``config`` against ``spec`` (see :func:`validated`); [] if none."""
    try:
        validated(spec, config)
    except ConfigError as exc:
        return exc.problems
    return []


def declared_fields(spec: type) -> list[DeclaredField]:
    """Every field of TypedDict ``spec``, in declaration order."""
    hints = typing.get_type_hints(spec, include_extras=True)
    required: frozenset[str] = getattr(spec, "__required_keys__", frozenset())
    fields = []
    for name, hint in hints.items():
        info = _field_info(hint)
        has_default = info is not None and not info.is_required()
        default = info.get_default(call_default_factory=True) if info and has_default else None
        description = (info.description or "") if info is not None else ""
        bare = typing.get_args(hint)[0] if _is_annotated(hint) else hint
        fields.append(
            DeclaredField(name, bare, default, description, name in required, has_default)
        )
    return fields


def declared_defaults(spec: type) -> dict[str, Any]:
    """The declared defaults of ``spec``'s fields (fields without one are left out)."""
    return {f.name: f.default for f in declared_fields(spec) if f.has_default}


@functools.cache
def _adapter(spec: type) -> TypeAdapter[Any]:
    spec = _portable(spec)
    _make_strict(spec)
    return TypeAdapter(spec)


def _portable(hint: Any) -> Any:
    """``hint`` with every ``typing.TypedDict`` in it rebuilt as a ``typing_extensions`` one
    (pydantic needs that before Python 3.12; environment authors write either)."""
    if sys.version_info >= (3, 12):
        return hint
    if typing_extensions.is_typeddict(hint) and type(hint).__module__ == "typing":
        return _rebuilt_typeddict(hint)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if _is_annotated(hint):
        params = (_portable(args[0]), *hint.__metadata__)
        return typing.Annotated[params]
    if origin in (typing.Union, types.UnionType):
        return functools.reduce(operator.or_, [_portable(a) for a in args])
    if origin in (list, dict, tuple, set) and args:
        return origin[tuple(_portable(a) for a in args)]
    return hint


@functools.cache
def _rebuilt_typeddict(spec: Any) -> Any:
    hints = typing.get_type_hints(spec, include_extras=True)
    required = getattr(spec, "__required_keys__", frozenset(hints))
    fields = {}
    for name, hint in hints.items():
        hint = _portable(hint)
        marked = typing.get_origin(hint) in (
            typing_extensions.Required,
            typing_extensions.NotRequired,
        )
        fields[name] = hint if marked or name in required else typing_extensions.NotRequired[hint]
    return typing_extensions.TypedDict(spec.__name__, fields)  # type: ignore[operator]


def _make_strict(spec: Any) -> None:
    """Give ``spec`` and the TypedDicts inside it :data:`STRICT` unless they declare their own
    pydantic config (pydantic reads a TypedDict's config from the class)."""
    spec = _strip(spec)
    if typing_extensions.is_typeddict(spec):
        if "__pydantic_config__" not in vars(spec):
            spec.__pydantic_config__ = STRICT
        for hint in typing.get_type_hints(spec, include_extras=True).values():
            _make_strict(hint)
    for arg in typing.get_args(spec):
        if not isinstance(arg, (str, int, float, bool)) and arg is not None:
            _make_strict(arg)


def _is_annotated(hint: Any) -> bool:
    return typing.get_origin(hint) is typing.Annotated


def _field_info(hint: Any) -> FieldInfo | None:
    if not _is_annotated(hint):
        return None
    infos = [m for m in hint.__metadata__ if isinstance(m, FieldInfo)]
    return FieldInfo.merge_field_infos(*infos) if infos else None  # as pydantic combines them


# --- pydantic's errors in envloop's wording -------------------------------------------------


def _problems(spec: type, exc: ValidationError) -> list[str]:
    """One line per bad key; the several errors of a union's members become one."""
    by_key: dict[str, list[dict[str, Any]]] = {}
    for error in exc.errors(include_url=False):
        key, annotation, siblings = _resolve(spec, error["loc"])
        if key in by_key:  # another member of a union failed too: name the whole union
            named = set(re.split(r"[.\[\]]", key))
            annotation = _resolve(spec, tuple(s for s in error["loc"] if str(s) in named))[1]
            by_key[key][0]["annotation"] = annotation
        by_key.setdefault(key, []).append({**error, "annotation": annotation, "known": siblings})
    return [_line(key, errors) for key, errors in by_key.items()]


def _line(key: str, errors: list[dict[str, Any]]) -> str:
    first = errors[0]
    if len(errors) > 1 or first["type"].endswith(("_type", "_parsing")) or first["type"] in (
        "is_instance_of", "none_required", "model_attributes_type", "dict_type"
    ):  # fmt: skip
        message = _expected(first["annotation"], first["input"])
    else:
        message = _message(first)
    return f"{key}: {message}" if key else message


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
        return f"must be {bounds[kind]} {limit}, got {value!r}"
    if kind == "value_error":  # a validator's own problem line (e.g. options in conflict)
        return str(ctx.get("error", error["msg"]))
    if kind == "finite_number":
        return f"must be a finite number, got {value!r}"
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
        close = difflib.get_close_matches(str(value), names, n=1)
        hint = f". Did you mean {close[0]!r}?" if close else ""
        return f"{value!r} is not one of {', '.join(names)}{hint}"
    if kind in ("too_short", "string_too_short"):
        what = "item" if kind == "too_short" else "character"
        count = ctx["min_length"]
        return f"must have at least {count} {what}{'s' * (count != 1)}, got {value!r}"
    return f"{error['msg'][0].lower()}{error['msg'][1:]}"


def _expected(annotation: Any, value: Any) -> str:
    return f"expected {_type_name(annotation)}, got {type(value).__name__} ({value!r:.40})"


def _type_name(annotation: Any) -> str:
    """``int``, ``list[str] | None``, ``'a' | 'b'``: how problems name a type."""
    annotation = _strip(annotation)
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
        isinstance(annotation, type) and issubclass(annotation, Mapping)
    ):
        return "a mapping"
    return getattr(annotation, "__name__", str(annotation))


def _resolve(spec: Any, loc: tuple[Any, ...]) -> tuple[str, Any, list[str]]:
    """The dotted key of pydantic location ``loc`` (union members' tags dropped), the
    annotation there, and the names known beside it (for unknown keys)."""
    parts: list[str] = []
    current, known = spec, _keys(spec)
    for step in loc:
        current = _strip(current)
        member = _union_member(current, step)
        if member is not None:
            current = member
            continue
        current = _without_none(current)  # pydantic reports X | None's errors as X's
        if _is_record(current) and isinstance(step, str):
            hints = typing.get_type_hints(current, include_extras=True)
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
    return ".".join(parts), current, known


def _without_none(annotation: Any) -> Any:
    """``X`` for ``X | None``; any other annotation unchanged."""
    if typing.get_origin(annotation) not in (typing.Union, types.UnionType):
        return annotation
    members = [m for m in typing.get_args(annotation) if m is not type(None)]
    return _strip(members[0]) if len(members) == 1 else annotation


def _is_record(spec: Any) -> bool:
    """A TypedDict or a dataclass: a type whose fields are keys of the config."""
    return typing_extensions.is_typeddict(spec) or dataclasses.is_dataclass(spec)


def _keys(spec: Any) -> list[str]:
    return list(typing.get_type_hints(spec)) if _is_record(spec) else []


def _strip(annotation: Any) -> Any:
    while _is_annotated(annotation):
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) in (typing_extensions.Required, typing_extensions.NotRequired):
        return _strip(typing.get_args(annotation)[0])
    return annotation


def _union_member(annotation: Any, tag: Any) -> Any:
    """The member of union ``annotation`` that pydantic's location tag ``tag`` names."""
    if typing.get_origin(annotation) not in (typing.Union, types.UnionType):
        return None
    for member in typing.get_args(annotation):
        names = {_tag(member), _type_name(member)}
        if tag in names:
            return member
    return None


def _tag(member: Any) -> str:
    """How pydantic names a union member in an error location."""
    if member is type(None):
        return "none"
    origin = typing.get_origin(_strip(member))
    if origin is typing.Literal:
        values = ",".join(repr(a) for a in typing.get_args(_strip(member)))
        return f"literal[{values}]"
    if origin is not None:
        return f"{origin.__name__}[{','.join(_tag(a) for a in typing.get_args(member))}]"
    if typing_extensions.is_typeddict(member):
        return member.__name__
    return getattr(member, "__name__", str(member))
