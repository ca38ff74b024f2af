"""The ``code`` environment's options (:class:`CodeEnvConfig`), their defaults and their
check (:func:`config_problems`). Imports nothing heavy: ``envloop run`` checks configs with
it before starting Ray."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, TypedDict

from envloop.config.errors import typed_dict_problems
from envloop.environments.code.sandbox import SandboxLimits


class CodeEnvConfig(TypedDict, total=False):
    """Options of :class:`CodeEnvironment`; every key is optional (defaults in brackets)."""

    num_workers: int  # sandboxes running at once, each its own process [4]
    timeout_s: float  # wall-clock limit of a run's code (not start-up), replays included [10.0]
    cpu_time_s: int  # CPU seconds of one run [10]
    memory_mb: int  # address-space limit of the sandbox process [1024]
    max_output_bytes: int  # output kept per turn; more stops the run [16384]
    max_processes: int  # processes of the sandbox user; 1 also blocks fork/subprocess [1]
    disk_mb: int  # largest file, and the size of the working directory's tmpfs [64]
    max_open_files: int  # open files of the sandbox process [64]
    sandbox_user: str  # unprivileged user the code runs as when we are root ["nobody"]
    max_turns: int  # code turns per episode unless metadata["max_turns"] says otherwise [8]
    stop_strings: list[str]  # where generation stops for the next turn [["</code>"]]


DEFAULTS: dict[str, Any] = {
    **dataclasses.asdict(SandboxLimits()),
    "num_workers": 4,
    "max_turns": 8,
    "stop_strings": ["</code>"],
}


def config_problems(config: Any) -> list[str]:
    """Every problem of a ``code`` config (None: the defaults), one line each; the ranges of
    keys whose types are wrong are not checked.

    >>> config_problems({"max_turns": 0, "memory_mb": "big"})
    ["memory_mb: expected int, got str ('big')", 'max_turns: must be >= 1, got 0']
    """
    if config is None:
        return []
    problems = typed_dict_problems(config, CodeEnvConfig, "CodeEnvConfig")
    if not isinstance(config, Mapping):
        return problems
    bad = {p.split(":")[0] for p in problems}
    options = with_defaults({k: v for k, v in config.items() if k not in bad})
    problems += sandbox_limits(options).problems()
    problems += [f"{k}: must be >= 1, got {options[k]}" for k in ("num_workers", "max_turns")
                 if options[k] < 1]  # fmt: skip
    stops = options["stop_strings"]
    if not stops or not all(isinstance(s, str) and s for s in stops):
        problems.append(f"stop_strings: must be a non-empty list of non-empty strings, got {stops}")
    return problems


def with_defaults(config: Mapping[str, Any] | None) -> dict[str, Any]:
    """The config's options over :data:`DEFAULTS` (unknown keys dropped)."""
    return {**DEFAULTS, **{k: v for k, v in (config or {}).items() if k in DEFAULTS}}


def sandbox_limits(options: Mapping[str, Any]) -> SandboxLimits:
    """The sandbox limits among a config's options."""
    names = {f.name for f in dataclasses.fields(SandboxLimits)}
    return SandboxLimits(**{k: v for k, v in options.items() if k in names})
