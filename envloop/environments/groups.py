"""Which samples are generations of one prompt: those of one task whose messages before the
first response are the same. Environments that score a prompt's samples together group a
step's samples by :func:`prompt_key`, and the async engine's group hook
(:mod:`envloop.experience.group_scoring`) holds them back by it until the last one comes."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

__all__ = ["prompt_key"]


def prompt_key(log: Any) -> str:
    """What the samples of one prompt share: the roles and contents of their messages
    before the first assistant message, as one string.

    >>> prompt_key([{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}])
    '[["user", "Q"]]'
    """
    prompt = []
    for message in log if isinstance(log, list) else []:
        if not isinstance(message, Mapping) or message.get("role") == "assistant":
            break
        prompt.append([message.get("role"), message.get("content")])
    return json.dumps(prompt, default=str)
