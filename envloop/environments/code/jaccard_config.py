"""The ``code_jaccard`` environment's options (:class:`CodeJaccardEnvConfig`), their defaults
and their check (:func:`config_problems`). Imports nothing heavy: ``envloop run`` checks
configs with it before starting Ray."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypedDict

from envloop.config.errors import typed_dict_problems


class CodeJaccardEnvConfig(TypedDict, total=False):
    num_workers: int  # NeMo-RL config compatibility only: validated, unused (scoring is cheap)
    stop_strings: list[str] | None  # returned as next_stop_strings; no turn follows (None)
    alignment_threshold: float  # a score above this is "aligned" (0.5)


DEFAULTS: CodeJaccardEnvConfig = {
    "num_workers": 1,
    "stop_strings": None,
    "alignment_threshold": 0.5,
}


def config_problems(config: Any) -> list[str]:
    """Every problem of a ``code_jaccard`` config (None: the defaults), one line each.

    >>> config_problems({"num_workers": 0, "alignment_threshold": 1})
    ['num_workers: must be at least 1, got 0', 'alignment_threshold: must be in [0, 1), got 1']
    """
    if config is None:
        return []
    problems = typed_dict_problems(config, CodeJaccardEnvConfig)
    if not isinstance(config, Mapping):
        return problems
    workers, threshold = config.get("num_workers", 1), config.get("alignment_threshold", 0.5)
    if isinstance(workers, int) and workers < 1:
        problems.append(f"num_workers: must be at least 1, got {workers}")
    if isinstance(threshold, (int, float)) and not 0 <= threshold < 1:
        problems.append(f"alignment_threshold: must be in [0, 1), got {threshold}")
    return problems
