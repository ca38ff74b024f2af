"""Resolving import paths (custom environments, reward functions).

Two spellings name the same object: envloop's ``"package.module:attribute"``, where the colon
says where the module ends, and the fully qualified ``"package.module.attribute"`` that
NeMo-RL's registries use, where the longest importable prefix is the module.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import Any


def import_from_path(
    path: str,
    what: str,
    kind: str = "attribute",
    accept: Callable[[Any], bool] = lambda obj: True,
) -> Any:
    """The object at ``"module:attribute"`` (or dotted ``"module.attribute"``); ``ImportError``
    naming ``what`` when the module cannot be imported or has no such ``kind`` (an attribute
    that ``accept`` rejects).

    >>> import_from_path("os.path:join", "Reward function 'x'", "function", callable).__name__
    'join'
    >>> import_from_path("os.path.join", "Reward function 'x'", "function", callable).__name__
    'join'
    >>> import_from_path("os.path:sep", "Reward function 'x'", "function", callable)
    Traceback (most recent call last):
    ...
    ImportError: Reward function 'x': module os.path has no function 'sep'.
    """
    if ":" in path:
        module_name, _, attr = path.partition(":")
        module = _import_module(module_name, path, what)
    else:
        module_name, attr = _longest_module_prefix(path, what)
        module = sys.modules[module_name]
    obj = _get_attribute_chain(module, attr)
    if obj is None or not accept(obj):
        raise ImportError(f"{what}: module {module_name} has no {kind} {attr!r}.")
    return obj


def _import_module(module_name: str, path: str, what: str) -> ModuleType:
    try:
        return importlib.import_module(module_name)
    except Exception as exc:
        raise _import_failed(module_name, path, what, exc) from exc


def _longest_module_prefix(path: str, what: str) -> tuple[str, str]:
    """The longest prefix of dotted ``path`` that imports as a module (now imported), and
    the rest of the path.

    A prefix that does not exist is skipped; a module that exists but fails to import (a
    missing dependency inside it) is reported, not skipped.
    """
    parts = path.split(".")
    for end in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:end])
        try:
            importlib.import_module(module_name)
            return module_name, ".".join(parts[end:])
        except ModuleNotFoundError as exc:
            if exc.name is None or not _is_prefix_of(exc.name, module_name):
                raise _import_failed(module_name, path, what, exc) from exc
        except Exception as exc:
            raise _import_failed(module_name, path, what, exc) from exc
    raise ImportError(
        f"{what}: cannot import module {parts[0]!r} from {path!r}; is its package installed, "
        "and on the PYTHONPATH of Ray workers too? (Paths look like 'package.module:Class' "
        "or 'package.module.Class'.)"
    )


def _import_failed(module_name: str, path: str, what: str, exc: Exception) -> ImportError:
    return ImportError(
        f"{what}: cannot import module {module_name!r} from {path!r} ({exc}); is its "
        "package installed, and on the PYTHONPATH of Ray workers too?"
    )


def _is_prefix_of(missing: str, module_name: str) -> bool:
    """Whether the module Python could not find is ``module_name`` or a package above it."""
    return module_name == missing or module_name.startswith(missing + ".")


def _get_attribute_chain(module: ModuleType, attr: str) -> Any:
    """``module.a.b`` for ``attr == "a.b"`` (nested classes); None when a link is missing."""
    obj: Any = module
    for name in attr.split("."):
        obj = getattr(obj, name, None) if name else None
        if obj is None:
            return None
    return obj


def lazy_attributes(
    package: str, public: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``, whose public names (keys of
    ``public``) live in the modules ``public`` maps them to, imported on first use.

    >>> getattr_, dir_ = lazy_attributes("pkg", {"dumps": "json"})
    >>> getattr_("dumps").__module__, dir_()
    ('json', ['dumps'])
    >>> getattr_("loads")
    Traceback (most recent call last):
    ...
    AttributeError: module 'pkg' has no attribute 'loads'
    """
    names = sorted(public)

    def __getattr__(name: str) -> Any:
        if name not in public:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(public[name]), name)

    def __dir__() -> list[str]:
        return names

    return __getattr__, __dir__
