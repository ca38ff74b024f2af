"""Reading config declarations back: each field's type, default and description.

A config declares each field once (see :mod:`envloop.config.validation`); ``envloop envs``
lists an environment's fields with :func:`declared_fields`, environments take their
defaults with :func:`declared_defaults`, and the config reference (docs/config-reference.md) is
:func:`reference_rows` of the run config.
"""

from __future__ import annotations

import json
import re
import types
import typing
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import typing_extensions
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from envloop.config.problems import strip_annotations

__all__ = [
    "DeclaredField",
    "declared_defaults",
    "declared_fields",
    "markdown_table",
    "options_table",
    "reference_rows",
    "type_name",
]


@dataclass(frozen=True)
class DeclaredField:
    """One field of a config, as declared."""

    name: str
    annotation: Any  # the type, without its Annotated metadata
    default: Any  # None when the field declares none
    description: str  # "" when the field declares none
    required: bool
    has_default: bool  # a default value or factory is declared
    info: FieldInfo | None = None  # pydantic's record of the field, when it has one


def declared_fields(spec: type) -> list[DeclaredField]:
    """Every field of ``spec`` (a TypedDict or a pydantic model such as a
    :class:`~envloop.config.validation.Config`), in declaration order."""
    if isinstance(spec, type) and issubclass(spec, BaseModel):
        return [
            _declared(name, f.annotation, f, f.is_required())
            for name, f in spec.model_fields.items()
        ]
    hints = typing.get_type_hints(spec, include_extras=True)
    required: frozenset[str] = getattr(spec, "__required_keys__", frozenset())
    return [
        _declared(name, hint, _field_info(hint), name in required) for name, hint in hints.items()
    ]


def declared_defaults(spec: type) -> dict[str, Any]:
    """The declared defaults of ``spec``'s fields (fields without one are left out)."""
    return {f.name: f.default for f in declared_fields(spec) if f.has_default}


def reference_rows(spec: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, str, str, str]]:
    """``(dotted key, type, default, description)`` of every field of config class ``spec``,
    nested sections flattened; a ``dict[str, Section]`` field is listed as
    ``key.<name>.*``, where ``name`` is the field's ``json_schema_extra["placeholder"]``."""
    for f in declared_fields(spec):
        key = f"{prefix}.{f.name}" if prefix else f.name
        section = _section_of(f.annotation)
        variants = _sections_of_union(f.annotation)
        if section is not None:
            yield from reference_rows(section, key)
        elif variants:
            yield from _variant_rows(variants, key)
        elif _section_of(_dict_values_of(f.annotation)) is not None:
            extra = (f.info.json_schema_extra if f.info else None) or {}
            placeholder = extra.get("placeholder", "name") if isinstance(extra, dict) else "name"
            values = _section_of(_dict_values_of(f.annotation))
            yield from reference_rows(values, f"{key}.<{placeholder}>")  # type: ignore[arg-type]
        else:
            default = _default_text(f.default) if f.has_default else "(required)"
            yield key, type_name(f.annotation), default, _yaml_words(markdown_text(f.description))


def options_table(spec: type[BaseModel]) -> str:
    """The fields of ``spec`` as keyword options of a Python call: a Markdown table of
    option, default (as Python writes it) and meaning."""
    rows = [
        (f"`{f.name}`", f"`{_python_default(f)}`", markdown_text(f.description))
        for f in declared_fields(spec)
    ]
    return markdown_table(("option", "default", "meaning"), rows)


def markdown_table(header: tuple[str, ...], rows: Iterable[tuple[str, ...]]) -> str:
    """A Markdown table, ``|`` in cells escaped.

    >>> print(markdown_table(("a", "b"), [("1", "x|y")]))
    | a | b |
    |---|---|
    | 1 | x\\|y |
    """
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines)


def type_name(hint: Any) -> str:
    """A readable name of a field type: ``int``, ``int or null``, ``one of sync, async``.

    >>> type_name(int | None), type_name(Literal["a", "b"]), type_name(list[str] | None)
    ('int or null', 'one of a, b', 'list of str or null')
    """
    hint = strip_annotations(hint)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        named = [type_name(a) for a in args if a is not type(None)]
        return " or ".join(named) + (" or null" if type(None) in args else "")
    if origin is Literal:
        return "one of " + ", ".join(str(a) for a in args)
    if origin is list:
        return f"list of {type_name(args[0])}" if args else "list"
    if origin is dict or hint is dict or typing_extensions.is_typeddict(hint):
        return "mapping"
    if hint is Any:
        return "any"
    return getattr(hint, "__name__", str(hint))


def markdown_text(docstring: str) -> str:
    """A field's docstring as one line of Markdown: ``x`` becomes `x`, a Sphinx role
    ``:class:`~a.b.C``` becomes `C`.

    >>> markdown_text("Uses ``model_name``;\\n see :class:`~envloop.run.config.RunConfig`.")
    'Uses `model_name`; see `RunConfig`.'
    """
    text = re.sub(r":\w+:`~[\w.]*?(\w+)`", r"`\1`", docstring)
    text = re.sub(r":\w+:`([^`]+)`", r"`\1`", text)
    return " ".join(text.replace("``", "`").split())


def _declared(name: str, hint: Any, info: FieldInfo | None, required: bool) -> DeclaredField:
    has_default = info is not None and not info.is_required()
    default = info.get_default(call_default_factory=True) if info and has_default else None
    description = (info.description or "") if info is not None else ""
    bare = strip_annotations(hint)
    return DeclaredField(name, bare, default, description, required, has_default, info)


def _field_info(hint: Any) -> FieldInfo | None:
    if typing.get_origin(hint) is not typing.Annotated:
        return None
    infos = [m for m in hint.__metadata__ if isinstance(m, FieldInfo)]
    return FieldInfo.merge_field_infos(*infos) if infos else None  # as pydantic combines them


def _section_of(hint: Any) -> type[BaseModel] | None:
    hint = strip_annotations(hint)
    return hint if isinstance(hint, type) and issubclass(hint, BaseModel) else None


def _sections_of_union(hint: Any) -> list[type[BaseModel]]:
    """The config classes of a union of them (a section with variants), else []."""
    hint = strip_annotations(hint)
    if typing.get_origin(hint) not in (typing.Union, types.UnionType):
        return []
    members = [_section_of(m) for m in typing.get_args(hint)]
    return [m for m in members if m is not None] if all(members) else []


def _variant_rows(variants: list[type[BaseModel]], key: str) -> Iterator[tuple[str, str, str, str]]:
    """The rows of a section with variants told apart by their ``backend``-like first
    differing key: the first variant's rows, then each other's own keys, marked with it
    (e.g. "server:")."""
    seen: set[str] = set()
    for i, variant in enumerate(variants):
        tag = _variant_tag(variant)
        for row_key, type_, default, description in reference_rows(variant, key):
            if row_key in seen:
                continue
            seen.add(row_key)
            yield row_key, type_, default, description if i == 0 else f"({tag}) {description}"


def _variant_tag(variant: type[BaseModel]) -> str:
    """The value of the variant's literal-typed field with no default (its tag)."""
    for f in declared_fields(variant):
        literal = typing.get_origin(strip_annotations(f.annotation)) is typing.Literal
        if literal and not f.has_default:
            return str(typing.get_args(strip_annotations(f.annotation))[0])
    return variant.__name__


def _dict_values_of(hint: Any) -> Any:
    hint = strip_annotations(hint)
    return typing.get_args(hint)[1] if typing.get_origin(hint) is dict else None


def _yaml_words(text: str) -> str:
    """Python's None, True and False as YAML writes them, outside `code`."""
    words = {"None": "null", "True": "true", "False": "false"}
    parts = text.split("`")
    parts[::2] = [re.sub(r"\b(None|True|False)\b", lambda m: words[m[1]], p) for p in parts[::2]]
    return "`".join(parts)


def _python_default(f: DeclaredField) -> str:
    return "(required)" if not f.has_default else str(f.default)


def _default_text(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, BaseModel):
        return ""
    return value if isinstance(value, str) else json.dumps(value)
