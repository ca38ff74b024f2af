"""The ``envloop run`` application: the run config, the checks before Ray starts, the
environments' actors, progress, and the run directory's files.

``run`` and ``RunResult`` are imported on first use: reading a config
(``envloop.run.config``) does not import torch or Ray.
"""

from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = {
    "RunConfig": "envloop.run.config",
    "RunResult": "envloop.run.runner",
    "load_run_config": "envloop.run.config",
    "run": "envloop.run.runner",
}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name not in _PUBLIC:
        raise AttributeError(f"module 'envloop.run' has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC[name]), name)


def __dir__() -> list[str]:
    return __all__
