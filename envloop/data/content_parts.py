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


def is_message_content(content: Any) -> bool:
    """Whether ``content`` is a message content: a string, or a list of parts each
    ``{"type": "text", "text": str}`` or ``{"type": "image", "image": ...}``.

    >>> is_message_content("hi"), is_message_content([{"type": "image", "image": b"..."}])
    (True, True)
    >>> is_message_content([{"type": "text"}]), is_message_content(3)
    (False, False)
    """
    if isinstance(content, str):
        return True
    return isinstance(content, list) and all(_is_part(part) for part in content)


def _is_part(part: Any) -> bool:
    if not isinstance(part, Mapping):
        return False
    if part.get("type") == "text":
        return isinstance(part.get("text"), str)
    return part.get("type") == "image" and part.get("image") is not None
