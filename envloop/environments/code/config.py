"""The ``code`` environment's options (:class:`CodeEnvConfig`: the sandbox's limits,
:class:`SandboxLimitsConfig`, plus the episode's), their defaults and their check
(:func:`config_problems`). Imports nothing heavy: ``envloop run`` checks configs with it
before starting Ray."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import Field
from typing_extensions import TypedDict

from envloop.config import validation
from envloop.environments.utils import MaxParseChars


class SandboxLimitsConfig(TypedDict, total=False):
    """Resource limits of one sandbox run (see :mod:`envloop.environments.code.sandbox` for
    what enforces each)."""

    timeout_s: Annotated[
        float, Field(10.0, gt=0, description="wall-clock limit of a run's code, replays included")
    ]
    cpu_time_s: Annotated[
        int, Field(10, ge=1, description="CPU seconds of the process running the code")
    ]
    memory_mb: Annotated[
        int, Field(1024, ge=64, description="address-space limit (>= 64: Python needs ~30 MB)")
    ]
    max_output_bytes: Annotated[
        int, Field(16384, ge=1, description="output kept per turn; more stops the run")
    ]
    max_processes: Annotated[
        int, Field(1, ge=1, description="processes of the sandbox user; 1 also blocks fork")
    ]
    disk_mb: Annotated[
        int, Field(64, ge=1, description="largest file, and the working directory's tmpfs size")
    ]
    max_open_files: Annotated[int, Field(64, ge=16, description="open files of the process")]
    sandbox_user: Annotated[
        validation.NonEmptyStr,
        Field("nobody", description="unprivileged user the code runs as under root"),
    ]


class CodeEnvConfig(SandboxLimitsConfig, total=False):
    """Options of :class:`CodeEnvironment`; every key is optional."""

    num_workers: Annotated[int, Field(4, ge=1, description="sandboxes running at once")]
    max_turns: Annotated[
        int, Field(8, ge=1, description='code turns per episode unless metadata["max_turns"]')
    ]
    stop_strings: Annotated[
        list[validation.NonEmptyStr],
        Field(
            default_factory=lambda: ["</code>"],
            min_length=1,
            description="where generation stops for the next turn",
        ),
    ]
    max_parse_chars: MaxParseChars  # of each response


DEFAULTS: dict[str, Any] = validation.declared_defaults(CodeEnvConfig)


def config_problems(config: Any) -> list[str]:
    """Every problem of a ``code`` config (None: the defaults), one line each.

    >>> config_problems({"max_turns": 0, "memory_mb": "big"})
    ["memory_mb: expected int, got str ('big')", 'max_turns: must be >= 1, got 0']
    """
    problems = validation.config_problems(CodeEnvConfig, config)
    user = config.get("sandbox_user") if isinstance(config, Mapping) else None
    return problems + sandbox_user_problems(user if isinstance(user, str) and user else "nobody")


def with_defaults(config: Mapping[str, Any] | None) -> dict[str, Any]:
    """The config's options over :data:`DEFAULTS` (unknown keys dropped)."""
    return {**DEFAULTS, **{k: v for k, v in (config or {}).items() if k in DEFAULTS}}


def sandbox_user_problems(user: str) -> list[str]:
    """Why the code cannot run as ``user`` here ([] when it can, or when we are not root)."""
    if os.geteuid() != 0:
        return []
    import pwd

    try:
        uid = pwd.getpwnam(user).pw_uid
    except KeyError:
        return [f"sandbox_user: no user {user!r} here; use an unprivileged one such as 'nobody'"]
    return [] if uid != 0 else [f"sandbox_user: {user!r} is root; use one such as 'nobody'"]
