"""Declaring and validating configs: one mechanism (pydantic v2) for every config.

Two kinds of config, both declared field by field with a default, constraints and a
one-line description, and both validated strictly (YAML's ``2`` is an int, ``"2"`` is not,
``true`` is not a number; unknown keys are errors):

- **TypedDicts**, where the published interface has them (the environments' configs)::

      class PuzzleConfig(TypedDict, total=False):
          size: Annotated[int, Field(3, ge=2, description="N of an N x N puzzle")]

  :func:`validated` returns a plain mapping with the defaults filled in.
- **:class:`Config` classes** (frozen pydantic models) for envloop's own settings: the
  generation backend's, the rollout options, and the run config that composes them::

      class PuzzleSettings(Config, title="puzzle settings"):
          size: Annotated[int, Field(ge=2)] = 3
          '''N of an N x N puzzle.'''

  A nested section may be given as a mapping (as YAML gives it) or as its class.

Either way, a bad config raises one :class:`~envloop.config.errors.ConfigError` listing
every problem with its dotted key, in envloop's wording (``size: must be >= 2, got 1``;
``sise: unknown option. Did you mean 'size'?``; see :mod:`envloop.config.problems`).
:mod:`envloop.config.declarations` reads the declarations back (``envloop envs`` and the
config reference, docs/config-reference.md, show them).
"""

from __future__ import annotations

import functools
import operator
import sys
import types
import typing
from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, cast

import typing_extensions
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError
from typing_extensions import Self

from envloop.config.declarations import DeclaredField, declared_defaults, declared_fields
from envloop.config.errors import ConfigError
from envloop.config.problems import strip_annotations, validation_problems

__all__ = [
    "Config",
    "DeclaredField",
    "NonEmptyStr",
    "config_problems",
    "declared_defaults",
    "declared_fields",
    "validated",
]

STRICT = ConfigDict(strict=True, extra="forbid")
"""How every config is validated: no coercion, no unknown keys."""

NonEmptyStr = Annotated[str, Field(min_length=1)]
"""A string field that may not be empty (names, paths, stop strings)."""


if TYPE_CHECKING:  # pydantic's metaclass by its private name, for type checkers only
    from pydantic._internal._model_construction import ModelMetaclass as _ModelClass
else:
    _ModelClass = type(BaseModel)


class _ConfigClass(_ModelClass):
    """Constructing a config class (``HfGenerationConfig(...)``) raises a
    :class:`ConfigError`. Here, not in ``__init__``: pydantic validates a nested section by
    calling an overridden ``__init__``, and the section's problems must stay its parent's,
    with their dotted keys."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().__call__(*args, **kwargs)
        except ValidationError as exc:
            config = cast("type[Config]", cls)  # the metaclass of Config classes only
            raise ConfigError(config.config_title(), validation_problems(config, exc)) from None


class Config(BaseModel, metaclass=_ConfigClass):
    """Base of envloop's config classes: frozen, validated strictly on construction, each
    field's description its docstring. A bad value raises one :class:`ConfigError` titled
    with the class's ``title`` (a class keyword; default: the class name) listing every
    problem, nested sections' included.

    >>> class Workers(Config, title="worker settings"):
    ...     count: Annotated[int, Field(ge=1)] = 1
    ...     '''How many.'''
    >>> Workers.from_mapping({"count": 0, "cont": 2})
    Traceback (most recent call last):
    ...
    envloop.config.errors.ConfigError: Invalid worker settings:
      - count: must be >= 1, got 0
      - cont: unknown option. Did you mean 'count'?
    """

    model_config = ConfigDict(**STRICT, frozen=True, use_attribute_docstrings=True)

    @classmethod
    def config_title(cls) -> str:
        """What errors call this config (the ``title`` class keyword, else the class name)."""
        return cls.model_config.get("title") or cls.__name__

    @classmethod
    def from_mapping(cls, options: Any) -> Self:
        """An instance from a mapping of options (as YAML or keyword arguments give them);
        raises :class:`ConfigError` listing every problem."""
        if not isinstance(options, Mapping):
            got = type(options).__name__
            raise ConfigError(cls.config_title(), [f"expected a mapping, got {got}"])
        return cls(**options)


def validated(spec: type, config: Any, what: str | None = None) -> dict[str, Any]:
    """``config`` (a mapping; None: every default) checked against TypedDict ``spec``, with
    the declared defaults filled in. Raises :class:`ConfigError` (``what``, default the
    spec's name) listing every problem.

    >>> from envloop.environments.code.jaccard_config import CodeJaccardEnvConfig
    >>> validated(CodeJaccardEnvConfig, {"num_workers": 2})  # doctest: +NORMALIZE_WHITESPACE
    {'num_workers': 2, 'stop_strings': None, 'alignment_threshold': 0.5, 'similarity': 'words',
     'max_parse_chars': 1000000}
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
        raise ConfigError(what or spec.__name__, validation_problems(spec, exc)) from None


def config_problems(spec: type, config: Any) -> list[str]:
    """Every problem of ``config`` against ``spec`` (see :func:`validated`); [] if none."""
    try:
        validated(spec, config)
    except ConfigError as exc:
        return exc.problems
    return []


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
    if typing.get_origin(hint) is typing.Annotated:
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
    spec = strip_annotations(spec)
    if typing_extensions.is_typeddict(spec):
        if "__pydantic_config__" not in vars(spec):
            spec.__pydantic_config__ = STRICT
        for hint in typing.get_type_hints(spec, include_extras=True).values():
            _make_strict(hint)
    for arg in typing.get_args(spec):
        if not isinstance(arg, (str, int, float, bool)) and arg is not None:
            _make_strict(arg)
