"""One error that reports every problem of a config at once."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar


class ConfigError(ValueError):
    """Raised with every problem found in a config, one per line, each naming its key.

    >>> print(ConfigError("RolloutOptions", ["on_env_error: 'x' is not one of record, raise"]))
    Invalid RolloutOptions:
      - on_env_error: 'x' is not one of record, raise
    """

    def __init__(self, what: str, problems: Iterable[str]) -> None:
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"Invalid {what}:\n{lines}")


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


ConfigT = TypeVar("ConfigT")


def config_from_mapping(cls: type[ConfigT], options: Mapping[str, Any], what: str) -> ConfigT:
    """Build dataclass ``cls`` from ``options``, reporting unknown keys, missing required
    fields and bad values (from the dataclass's own validation) in one :class:`ConfigError`.
    """
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    missing = [f"{f.name}: required" for f in fields if _required(f) and f.name not in options]
    problems = unknown_keys(options, [f.name for f in fields]) + missing
    built = None
    if not missing:
        try:
            built = cls(**{f.name: options[f.name] for f in fields if f.name in options})
        except ConfigError as exc:
            problems += exc.problems
    if problems or built is None:
        raise ConfigError(what, problems)
    return built


def _required(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
