"""The ``code_jaccard`` environment's options (:class:`CodeJaccardEnvConfig`), their defaults
and their check (:func:`config_problems`). Imports nothing heavy: ``envloop run`` checks
configs with it before starting Ray."""

from __future__ import annotations

from typing import Annotated, Any, Literal, cast

from pydantic import Field
from typing_extensions import TypedDict

from envloop.config import validation
from envloop.environments.utils import MaxParseChars


class CodeJaccardEnvConfig(TypedDict, total=False):
    num_workers: Annotated[
        int, Field(1, ge=1, description="NeMo-RL config compatibility only: validated, unused")
    ]
    stop_strings: Annotated[
        list[str] | None,
        Field(None, description="returned as next_stop_strings; no turn follows (None)"),
    ]
    alignment_threshold: Annotated[
        float, Field(0.5, ge=0, lt=1, description='a score above this is "aligned"')
    ]
    similarity: Annotated[
        Literal["words", "code_tokens"],
        Field(
            "words",
            description=(
                "words: NeMo-RL's score (all assistant replies joined, lower-cased words, "
                "exact match 1.0, Jaccard times the length ratio); code_tokens: envloop's "
                "Jaccard of the last reply's code tokens (fenced code if any)"
            ),
        ),
    ]
    max_parse_chars: MaxParseChars  # of the response, and of the ground truth


DEFAULTS = cast(CodeJaccardEnvConfig, validation.declared_defaults(CodeJaccardEnvConfig))


def config_problems(config: Any) -> list[str]:
    """Every problem of a ``code_jaccard`` config (None: the defaults), one line each.

    >>> config_problems({"num_workers": 0, "alignment_threshold": 1})
    ['num_workers: must be >= 1, got 0', 'alignment_threshold: must be < 1, got 1']
    """
    return validation.config_problems(CodeJaccardEnvConfig, config)
