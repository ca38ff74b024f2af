"""One error that reports every problem of a config at once."""

from __future__ import annotations

from collections.abc import Iterable


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


def prefixed(problems: Iterable[str], prefix: str) -> list[str]:
    """``problems`` of a config section, keyed under the section's dotted ``prefix``: a
    problem that starts with its key gets ``prefix.``, one without a key gets ``prefix: ``.

    >>> prefixed(["max_attempts: must be >= 1, got 0", "expected a mapping, got list"],
    ...          "envs.math.config")
    ['envs.math.config.max_attempts: must be >= 1, got 0', \
'envs.math.config: expected a mapping, got list']
    """
    return [f"{prefix}.{p}" if ":" in p.split(" ")[0] else f"{prefix}: {p}" for p in problems]
