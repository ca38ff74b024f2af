"""Helpers shared by environments, and NeMo-RL's ``nemo_rl.environments.utils`` for code
ported by renaming the package.

The registry is :mod:`envloop.environments.registry`'s (one registry, re-exported here):
:data:`ENV_REGISTRY`, :class:`EnvRegistryEntry`, :func:`register_env`, :func:`create_env`
(NeMo-RL's ``(env_name, env_config)``). Left out, as they have no envloop counterpart:
the per-actor Python executables and virtualenvs NeMo-RL sets up in ``create_env``
(``ray_actor_environment_registry``, ``create_local_venv_on_each_node``): envloop actors run
on the driver's interpreter, with its environment variables, unless ``runtime_env`` says
otherwise; and ``EnvRegistryEntry.default_processor``, which names a NeMo-RL data processor.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

from pydantic import Field

from envloop.environments.registry import (
    ENV_REGISTRY,
    EnvRegistryEntry,
    create_env,
    register_env,
)

if TYPE_CHECKING:  # not at run time: the environments' config modules import this one
    # and must not import torch (``envloop run`` checks configs before starting Ray)
    from envloop.data.interfaces import LLMMessageLogType

__all__ = [
    "ENV_REGISTRY",
    "MAX_PARSE_CHARS",
    "EnvRegistryEntry",
    "MaxParseChars",
    "chunk_list_to_workers",
    "content_text",
    "create_env",
    "last_assistant_text",
    "parse_cap_reason",
    "register_env",
]

T = TypeVar("T")

MAX_PARSE_CHARS = 1_000_000
"""Default of every built-in environment's ``max_parse_chars``: about 250k tokens, several
times the longest chains of thought that models generate (32k-128k tokens), so no genuine
response is refused, while a degenerate one (a repeated ``\\boxed{``) is refused before any
parser reads it."""

MaxParseChars = Annotated[
    int,
    Field(
        MAX_PARSE_CHARS,
        ge=1,
        description=(
            "a longer text is not parsed: its sample scores 0, saying why in its metadata"
            " (1,000,000 chars ~ 250k tokens, past any genuine chain of thought)"
        ),
    ),
]
"""The ``max_parse_chars`` option, declared once for every built-in environment's config."""


def chunk_list_to_workers(to_chunk: list[T], num_workers: int) -> list[list[T]]:
    """Split ``to_chunk`` in order into per-worker lists, as NeMo-RL does.

    With no more items than workers, each item gets its own list, followed by empty lists
    up to ``num_workers``. Otherwise items go in consecutive chunks of
    ``ceil(len / num_workers)``, the last possibly shorter, so there can be fewer chunks
    than workers (5 items over 4 workers make 3 chunks of 2, 2, 1).

    >>> chunk_list_to_workers([1, 2, 3, 4, 5], 3)
    [[1, 2], [3, 4], [5]]
    >>> chunk_list_to_workers([1, 2, 3, 4, 5], 4)
    [[1, 2], [3, 4], [5]]
    >>> chunk_list_to_workers(["a", "b"], 3), chunk_list_to_workers([], 2)
    ([['a'], ['b'], []], [[], []])
    """
    if not isinstance(num_workers, int) or num_workers < 1:
        raise ValueError(f"chunk_list_to_workers: num_workers must be >= 1, got {num_workers!r}.")
    if len(to_chunk) <= num_workers:
        return [[item] for item in to_chunk] + [[] for _ in range(num_workers - len(to_chunk))]
    size = -(-len(to_chunk) // num_workers)
    return [list(to_chunk[i : i + size]) for i in range(0, len(to_chunk), size)]


def parse_cap_reason(what: str, chars: int, max_parse_chars: int) -> str | None:
    """Why a text of ``chars`` characters is not parsed (it is over ``max_parse_chars``), or
    None when it is not over; ``what`` names the text.

    >>> parse_cap_reason("response", 1_200_000, 1_000_000)
    'response has 1,200,000 characters, over max_parse_chars=1,000,000; raise \
max_parse_chars to score it'
    >>> parse_cap_reason("response", 1_000_000, 1_000_000) is None
    True
    """
    if chars <= max_parse_chars:
        return None
    return (
        f"{what} has {chars:,} characters, over max_parse_chars={max_parse_chars:,}; "
        "raise max_parse_chars to score it"
    )


def last_assistant_text(message_log: LLMMessageLogType) -> str:
    """The text of the conversation's last assistant message (the response a step scores):
    its ``content`` when that is a string, the ``text`` of its parts when it is a multimodal
    list of ``{"type": ..., "text": ...}`` parts; "" when there is no assistant message
    (also when ``message_log`` is not a list of messages).

    >>> log = [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]
    >>> last_assistant_text(log)
    'a'
    >>> last_assistant_text([{"role": "assistant", "content": [{"type": "text", "text": "c"}]}])
    'c'
    >>> last_assistant_text(None)
    ''
    """
    if not isinstance(message_log, (list, tuple)):
        return ""
    for message in reversed(message_log):
        if isinstance(message, Mapping) and message.get("role") == "assistant":
            return content_text(message.get("content"))
    return ""


def content_text(content: Any) -> str:
    """Message content as text: a str as is, the ``text`` of each part of a multimodal list
    joined, anything else "".

    >>> content_text([{"type": "image"}, {"type": "text", "text": "hi"}]), content_text(None)
    ('hi', '')
    """
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return ""
