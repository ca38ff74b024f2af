"""The ``envloop run`` application: the run config, the checks before Ray starts, the
environments' actors, progress, and the run directory's files.

``run`` and ``RunResult`` are imported on first use: reading a config
(``envloop.run.config``) does not import torch or Ray.
"""

from __future__ import annotations

from envloop.config.import_paths import lazy_attributes

_PUBLIC = {
    "RunConfig": "envloop.run.config",
    "RunResult": "envloop.run.runner",
    "load_run_config": "envloop.run.config",
    "run": "envloop.run.runner",
}

__all__ = sorted(_PUBLIC)


__getattr__, __dir__ = lazy_attributes(__name__, _PUBLIC)
