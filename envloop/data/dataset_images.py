"""The images of a dataset row (``data.columns.images``), loaded and checked.

A row's value is one image or a list of them, each a file path (a relative one is relative
to the data file's folder), encoded bytes (a Parquet binary column), a PIL image, or the
``{"bytes", "path"}`` dict a ``datasets`` Image feature stores. :func:`row_images` loads
them all as RGB PIL images and names every one that cannot be read, with its row, column,
value, why and the fix. Loading imports torch (through
:mod:`envloop.data.multimodal_utils`); a text-only dataset never comes here.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["row_images"]

MAX_SHOWN_CHARS = 60


def row_images(
    value: Any, column: str, folder: Path | None, where: str
) -> tuple[list[Any], list[str]]:
    """The images of a row whose ``column`` holds ``value`` (``where`` names the row), as
    RGB PIL images in order, and a problem for each image that cannot be read (then the
    images are incomplete: use them only when there is no problem). ``folder``: what
    relative paths are relative to (None: the current directory). ``[]`` is a row without
    images; None (a missing value) is a problem."""
    from envloop.data.multimodal_utils import load_image

    key = f"column {column!r}, data.columns.images"
    if value is None:
        return [], [
            f"{where}: no image ({key}); give the row its image(s), [] for a row without "
            "images, or drop the row"
        ]
    items = list(value) if isinstance(value, (list, tuple)) else [value]
    images, problems = [], []
    for k, item in enumerate(items):
        which = f"image {k} " if isinstance(value, (list, tuple)) else "image "
        try:
            where_item = f"{where}: {which}{_shown(item)} ({key})"
            images.append(load_image(_resolved(item, folder), where_item))
        except ValueError as exc:
            problems.append(str(exc))
    return images, problems


def _resolved(item: Any, folder: Path | None) -> Any:
    """``item`` with a relative path (or a ``{"path"}`` dict without bytes) made relative
    to ``folder``."""
    if isinstance(item, Mapping) and not item.get("bytes") and isinstance(item.get("path"), str):
        item = item["path"]
    if isinstance(item, str) and folder is not None and not os.path.isabs(item):
        return str(folder / item)
    return item


def _shown(item: Any) -> str:
    """``item`` for a message: short, and bytes by their size and first bytes."""
    if isinstance(item, (bytes, bytearray, memoryview)):
        data = bytes(item)
        head = f"{data[:12]!r}{'...' if len(data) > 12 else ''}"
        return f"of {len(data)} bytes {head}"
    if isinstance(item, Mapping) and ("bytes" in item or "path" in item):
        stored = item.get("bytes")
        size = f"{len(stored)} bytes" if isinstance(stored, (bytes, bytearray)) else repr(stored)
        return f"{{'bytes': {size}, 'path': {item.get('path')!r}}}"
    text = repr(item)
    return text if len(text) <= MAX_SHOWN_CHARS else text[: MAX_SHOWN_CHARS - 3] + "..."
