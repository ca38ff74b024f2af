"""The report's image thumbnails: each image a message holds, downscaled into a ``data:``
URI, so the page stays one self-contained file.

An image part of ``rollouts.jsonl`` names its file in the run directory
(``images/<hash>.png``, named by content, see :mod:`envloop.run.records`). Each distinct
file becomes one thumbnail of at most :data:`THUMBNAIL_PX` pixels on its long side (never
enlarged), as PNG or JPEG, whichever is smaller; every message that shows the image refers
to that one thumbnail. A report embeds at most :data:`MAX_THUMBNAILS` of them (the first
met, in sample order), which bounds the page's size on large runs; the page says how many
it left out, and shows such an image, or one whose file is missing, as a note with its name.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

from envloop.data.multimodal_utils import load_image

THUMBNAIL_PX = 128
MAX_THUMBNAILS = 200
JPEG_QUALITY = 85


def thumbnail(image: Any, px: int = THUMBNAIL_PX) -> tuple[str, int, int]:
    """A ``data:`` URI of ``image`` (anything ``load_image`` reads) shrunk to fit ``px`` x
    ``px`` pixels, with its width and height in pixels.

    >>> from PIL import Image
    >>> src, width, height = thumbnail(Image.new("RGB", (512, 256), "red"))
    >>> src[:22], width, height
    ('data:image/png;base64,', 128, 64)
    """
    small = load_image(image).copy()
    small.thumbnail((px, px))
    encoded = []
    for fmt, options in (("png", {}), ("jpeg", {"quality": JPEG_QUALITY})):
        buffer = io.BytesIO()
        small.save(buffer, format=fmt, **options)
        encoded.append((len(buffer.getvalue()), fmt, buffer.getvalue()))
    _, fmt, data = min(encoded)
    return f"data:image/{fmt};base64,{base64.b64encode(data).decode('ascii')}", *small.size


class Thumbnails:
    """The thumbnails of one report: ``part(value)`` gives the page's view of an image
    part whose ``image`` is ``value``; ``images`` maps each shown image's name to its
    ``src``, ``width``, ``height``, ``alt`` and ``title`` (original size). Only files inside
    ``run_dir`` are read."""

    def __init__(self, run_dir: str | Path | None, limit: int = MAX_THUMBNAILS) -> None:
        self.run_dir = None if run_dir is None else Path(run_dir).resolve()
        self.limit = limit
        self.images: dict[str, dict[str, Any]] = {}
        self.unshown: dict[str, str] = {}  # name -> why it has no thumbnail
        self.left_out = 0  # distinct images beyond the limit
        self.parts = 0

    def part(self, value: Any) -> dict[str, Any]:
        """``{"image": name}``, plus ``"note"`` saying why when there is no thumbnail."""
        self.parts += 1
        name = value if isinstance(value, str) else f"<{type(value).__name__}>"
        if name not in self.images and name not in self.unshown:
            self._add(name, value)
        if name in self.unshown:
            return {"image": name, "note": self.unshown[name]}
        return {"image": name}

    def note(self) -> str:
        """A line about the page's images ("" when it has none)."""
        if not self.parts:
            return ""
        distinct = len(self.images) + len(self.unshown)
        line = (
            f"{_plural(self.parts, 'image')} in messages ({distinct} distinct), "
            f"{len(self.images)} shown as thumbnails"
        )
        if self.left_out:
            line += f"; {self.left_out} left out (a report embeds at most {self.limit})"
        if len(self.unshown) > self.left_out:
            missing = len(self.unshown) - self.left_out
            line += f"; {missing} not shown (missing, unreadable or outside the run directory)"
        return line + "."

    def _add(self, name: str, value: Any) -> None:
        path = self._path(value)
        if path is None:
            self.unshown[name] = "not a file of the run directory"
        elif len(self.images) >= self.limit:
            self.unshown[name] = f"left out: the report embeds at most {self.limit} images"
            self.left_out += 1
        else:
            try:
                image = load_image(path, name)
            except ValueError:
                self.unshown[name] = "file not found or unreadable"
                return
            src, width, height = thumbnail(image)
            size = f"{image.width}×{image.height} px"
            self.images[name] = {"src": src, "width": width, "height": height,
                                 "alt": f"image, {size}", "title": f"{name} · {size}"}  # fmt: skip

    def _path(self, value: Any) -> Path | None:
        """The file ``value`` names, when it is a file name inside the run directory."""
        if not isinstance(value, str) or self.run_dir is None:
            return None
        path = (self.run_dir / value).resolve()
        return path if path.is_relative_to(self.run_dir) else None


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'s' * (count != 1)}"
