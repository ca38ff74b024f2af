"""Resolving ``"package.module:attribute"`` paths (custom environments, reward functions)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def import_from_path(
    path: str,
    what: str,
    kind: str = "attribute",
    accept: Callable[[Any], bool] = lambda obj: True,
) -> Any:
    """The object at ``"module:attribute"``; ``ImportError`` naming ``what`` when the module
    cannot be imported or has no such ``kind`` (an attribute that ``accept`` rejects).

    >>> import_from_path("os.path:join", "Reward function 'x'", "function", callable).__name__
    'join'
    >>> import_from_path("os.path:sep", "Reward function 'x'", "function", callable)
    Traceback (most recent call last):
    ...
    ImportError: Reward function 'x': module os.path has no function 'sep'.
    """
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise ImportError(
            f"{what}: cannot import module {module_name!r} from {path!r} ({exc}); is its "
            "package installed, and on the PYTHONPATH of Ray workers too?"
        ) from exc
    obj = getattr(module, attr, None)
    if obj is None or not accept(obj):
        raise ImportError(f"{what}: module {module_name} has no {kind} {attr!r}.")
    return obj
