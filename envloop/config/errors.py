"""One error that reports every problem of a config at once."""

from __future__ import annotations

import difflib
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any, cast


class ConfigError(ValueError):
    """Raised with every problem found in a config, one per line, each naming its key.

    >>> print(ConfigError("RolloutOptions", ["on_env_error: 'x' is not one of record, raise"]))
    Invalid RolloutOptions:
      - on_env_error: 'x' is not one of record, raise
    """

    def __init__(self, what: str, problems: Iterable[str]) -> None:
        self.what = what
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"Invalid {what}:\n{lines}")

    def __reduce__(self) -> tuple[type, tuple[str, list[str]]]:
        # Rebuilt from its parts, so it survives pickling (e.g. out of a Ray actor).
        return (type(self), (self.what, self.problems))


def unknown_keys(given: Iterable[str], known: Iterable[str]) -> list[str]:
    """A problem line for each key of ``given`` not in ``known``, with a close match if any."""
    known = list(known)
    problems = []
    for key in given:
        if key in known:
            continue
        close = difflib.get_close_matches(key, known, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else f" Known: {', '.join(known)}."
        problems.append(f"{key}: unknown option.{hint}")
    return problems


def prefixed(problems: Iterable[str], prefix: str) -> list[str]:
    """``problems`` of a config section, keyed under the section's dotted ``prefix``: a
    problem that starts with its key gets ``prefix.``, one without a key gets ``prefix: ``.

    >>> prefixed(["max_attempts: must be >= 1, got 0", "expected a mapping, got list"],
    ...          "envs.math.config")
    ['envs.math.config.max_attempts: must be >= 1, got 0', \
'envs.math.config: expected a mapping, got list']
    """
    return [f"{prefix}.{p}" if ":" in p.split(" ")[0] else f"{prefix}: {p}" for p in problems]


def typed_dict_problems(config: Any, spec: type, what: str = "config") -> list[str]:
    """Problems of ``config`` against TypedDict ``spec``: not a mapping, unknown keys (with a
    close match), missing required keys, and values of the wrong type (for plain classes,
    ``X | None``, ``Literal[...]`` (with a close match), ``list[...]`` (the entries too, for
    lists of str, int, float or bool) and ``dict[...]`` annotations; others are not checked).

    >>> from typing import TypedDict
    >>> class Cfg(TypedDict):
    ...     num_workers: int
    ...     stop_strings: list[str] | None
    >>> for problem in typed_dict_problems({"num_worker": 2, "stop_strings": "x"}, Cfg):
    ...     print(problem)
    num_worker: unknown option. Did you mean 'num_workers'?
    num_workers: required
    stop_strings: expected list | None, got str ('x')
    >>> typed_dict_problems({"num_workers": 1, "stop_strings": ["</a>", 3]}, Cfg)
    ['stop_strings: every entry must be a string']
    """
    if not isinstance(config, Mapping):
        return [f"{what}: expected a dict, got {type(config).__name__}"]
    hints = typing.get_type_hints(spec)
    required = getattr(spec, "__required_keys__", frozenset(hints))
    problems = unknown_keys(config, hints)
    problems += [f"{key}: required" for key in hints if key in required and key not in config]
    for key, value in config.items():
        if key in hints and not _matches(value, hints[key]):
            problems.append(f"{key}: {_mismatch(value, hints[key])}")
    return problems


def _mismatch(value: Any, annotation: Any) -> str:
    """Why ``value`` does not fit ``annotation``: the allowed values (with a close match)
    for a ``Literal``, else the expected type."""
    entry = _list_entry_type(annotation)
    if isinstance(value, list) and entry is not None:
        return f"every entry must be {_ENTRY_NAMES[entry]}"
    choices = _literal_choices(annotation)
    if choices:
        close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
        hint = f". Did you mean {close[0]!r}?" if close else ""
        return f"{value!r} is not one of {', '.join(str(c) for c in choices)}{hint}"
    return f"expected {_describe(annotation)}, got {type(value).__name__} ({value!r:.40})"


def _list_entry_type(annotation: Any) -> type | None:
    """The checked entry type of the ``list[...]`` part of ``annotation``, if any."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        found = [_list_entry_type(arg) for arg in typing.get_args(annotation)]
        return next((t for t in found if t is not None), None)
    items = typing.get_args(annotation)
    if typing.get_origin(annotation) is list and len(items) == 1 and items[0] in _ENTRY_NAMES:
        return items[0]
    return None


def _literal_choices(annotation: Any) -> list[Any]:
    """The values of the ``Literal`` parts of ``annotation`` (``Literal["a"] | None``: ["a"])."""
    if typing.get_origin(annotation) is typing.Literal:
        return list(typing.get_args(annotation))
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [c for arg in typing.get_args(annotation) for c in _literal_choices(arg)]
    return []


def _matches(value: Any, annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if origin is typing.Literal:
        return any(value == c and type(value) is type(c) for c in typing.get_args(annotation))
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    target = origin or annotation
    if not isinstance(target, type) or not isinstance(value, target):
        return not isinstance(target, type)
    entry = _list_entry_type(annotation)
    return entry is None or all(_matches(item, entry) for item in cast(list, value))


_ENTRY_NAMES = {str: "a string", int: "an int", float: "a number", bool: "a bool"}
"""Element types whose entries ``list[...]`` annotations check, and how errors name them."""


def _describe(annotation: Any) -> str:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return " | ".join(_describe(a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return "None"
    target = typing.get_origin(annotation) or annotation
    return getattr(target, "__name__", str(target))
