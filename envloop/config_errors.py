"""One error that reports every problem of a config at once."""

from __future__ import annotations

import difflib
from collections.abc import Iterable


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
