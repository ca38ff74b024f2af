"""Message contents given as lists of parts, read without torch or Pillow (so that
``envloop run`` can check prompts before it imports either)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def content_text_parts(content: Any) -> str:
    """The text of a message's ``content``: itself if a string, else its text parts joined.

    >>> content_text_parts([{"type": "image", "image": "a.png"}, {"type": "text", "text": "Hi"}])
    'Hi'
    """
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(part.get("text", ""))
            for part in content
            if isinstance(part, Mapping) and part.get("type") == "text"
        )
    return "" if content is None else str(content)
