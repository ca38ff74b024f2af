"""Message contents given as lists of parts (``{"type": "text", "text": ...}``,
``{"type": "image", "image": ...}``): their text, their images, and whether a value is one.
Imports no torch (Pillow only when an image is loaded), so ``envloop run`` can check prompts
and images before it imports torch."""

from __future__ import annotations

import io
import os
from collections.abc import Mapping
from pathlib import Path
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


def has_images(content: Any) -> bool:
    """Whether a message's ``content`` holds an image part."""
    return isinstance(content, list) and any(_is_image_part(p) for p in content)


def content_images(content: Any, where: str = "message") -> list[Any]:
    """The images of a message's ``content`` parts, loaded as RGB PIL images, in order."""
    if not isinstance(content, list):
        return []
    return [
        load_image(part["image"], f"{where}, content part {k}")
        for k, part in enumerate(content)
        if _is_image_part(part)
    ]


def load_image(image: Any, where: str = "image") -> Any:
    """``image`` as an RGB PIL image: a PIL image, a local path, encoded bytes, or a
    ``{"bytes": ..., "path": ...}`` dict (a ``datasets`` Image feature's stored form).

    Raises ``ValueError`` naming ``where`` and the fix when it cannot be read.
    """
    from PIL import Image, UnidentifiedImageError

    if isinstance(image, Image.Image):
        return image if image.mode == "RGB" else image.convert("RGB")
    if isinstance(image, Mapping) and ("bytes" in image or "path" in image):
        image = image.get("bytes") or image.get("path")
    try:
        if isinstance(image, (bytes, bytearray, memoryview)):
            opened = Image.open(io.BytesIO(bytes(image)))
        elif isinstance(image, (str, os.PathLike)):
            path = Path(image)
            if not path.is_file():
                raise ValueError(
                    f"{where}: image file {os.fspath(image)!r} does not exist; give an existing "
                    "local path (relative paths in a dataset are relative to its data file)."
                )
            opened = Image.open(path)
        else:
            raise ValueError(
                f"{where}: an image must be a PIL image, a local file path, encoded bytes or a "
                f'{{"bytes": ..., "path": ...}} dict, got {type(image).__name__}.'
            )
        opened.load()
    except (UnidentifiedImageError, OSError) as exc:
        shown = (
            f"{os.fspath(image)!r}"
            if isinstance(image, (str, os.PathLike))
            else f"the {len(bytes(image))} bytes given"
        )
        reason = (
            "Pillow cannot identify its format"
            if isinstance(exc, UnidentifiedImageError)
            else str(exc)
        )
        raise ValueError(
            f"{where}: {shown} is not a readable image ({reason}); give a PNG, JPEG or another "
            "format Pillow reads."
        ) from None
    return opened.convert("RGB")


def _is_image_part(part: Any) -> bool:
    return isinstance(part, Mapping) and part.get("type") == "image"
