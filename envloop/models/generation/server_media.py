"""Images of a generation row, in the form inference servers take them.

A row's prompt holds each image as the processor expanded it, Qwen-VL style:
``<|vision_start|>`` then one ``<|image_pad|>`` per merged patch then ``<|vision_end|>``
(:class:`VisionTokens` reads those ids from the served model's config). The servers need the
images themselves, not the row's ``pixel_values``, so the rollout gives them in the row's
``images`` column: each row's images in the order of its image spans.

Every server resizes an image itself, each with its own rule (llama.cpp pads to its own
token limits, SGLang resizes with its own pixel limits); an image already at the size the
processor resized it to (``image_grid_thw`` times the patch size) is left alone by all of
them. :func:`request_images` therefore sends each image at that size (resized as the Pillow
image processor does, bicubic), so that the server embeds the pixels the trainer's
``pixel_values`` hold, and the dialects check that the server counted as many prompt tokens
as the row has.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import torch

IMAGE_FORMAT = "PNG"


@dataclass(frozen=True)
class VisionTokens:
    """The ids that delimit an image in a prompt, and the vision patch geometry."""

    start: int
    pad: int
    end: int
    patch_size: int
    merge_size: int

    @classmethod
    def from_config(cls, config: Any) -> VisionTokens | None:
        """From a transformers model config; None for a model without a vision part."""
        vision = getattr(config, "vision_config", None)
        start, pad, end = (getattr(config, k, None) for k in _ID_KEYS)
        if vision is None or not (
            isinstance(start, int) and isinstance(pad, int) and isinstance(end, int)
        ):
            return None
        return cls(
            start, pad, end,
            patch_size=int(getattr(vision, "patch_size", 14)),
            merge_size=int(getattr(vision, "spatial_merge_size", 1)),
        )  # fmt: skip


_ID_KEYS = ("vision_start_token_id", "image_token_id", "vision_end_token_id")


@dataclass(frozen=True)
class RequestImages:
    """A row's images as a server takes them.

    ``spans[i]`` is the ``[start, end)`` of image ``i``'s ``vision_start .. vision_end`` run
    in the prompt; ``png[i]`` the image encoded as PNG at the size its span was made for."""

    png: tuple[bytes, ...]
    spans: tuple[tuple[int, int], ...]


def image_spans(prompt: list[int], tokens: VisionTokens) -> list[tuple[int, int]]:
    """The ``[start, end)`` of every ``start pad+ end`` run of ``prompt``.

    >>> image_spans([7, 1, 2, 2, 3, 8], VisionTokens(1, 2, 3, 14, 2))
    [(1, 5)]
    """
    spans, i = [], 0
    while i < len(prompt):
        if prompt[i] == tokens.start and i + 1 < len(prompt) and prompt[i + 1] == tokens.pad:
            end = i + 1
            while end < len(prompt) and prompt[end] == tokens.pad:
                end += 1
            if end < len(prompt) and prompt[end] == tokens.end:
                spans.append((i, end + 1))
                i = end + 1
                continue
        i += 1
    return spans


def request_images(
    row: int, prompt: list[int], images: Any, grid: torch.Tensor | None, tokens: VisionTokens
) -> RequestImages:
    """Row ``row``'s images (a list of PIL images) checked against its prompt's image spans
    and ``grid`` (its ``image_grid_thw`` [images, 3], if the batch has one), resized to the
    processor's size and encoded.

    Raises ``ValueError`` naming the row when the counts disagree."""
    spans = image_spans(prompt, tokens)
    if not isinstance(images, (list, tuple)) or len(images) != len(spans):
        count = len(images) if isinstance(images, (list, tuple)) else type(images).__name__
        raise ValueError(
            f"Row {row} has {len(spans)} image(s) in its prompt but {count} in its images "
            "column; give each row the images of its conversation, in order."
        )
    sizes = _grid_sizes(row, grid, spans, tokens)
    encoded = tuple(_png(image, size) for image, size in zip(images, sizes))
    return RequestImages(encoded, tuple(spans))


def _grid_sizes(
    row: int, grid: torch.Tensor | None, spans: list[tuple[int, int]], tokens: VisionTokens
) -> list[tuple[int, int] | None]:
    """Each image's (width, height) in pixels from ``grid``; None without a grid."""
    if grid is None:
        return [None] * len(spans)
    if grid.shape[0] != len(spans):
        raise ValueError(
            f"Row {row} has {len(spans)} image(s) in its prompt but image_grid_thw has "
            f"{grid.shape[0]} row(s); its prompt and images were not tokenized together."
        )
    sizes: list[tuple[int, int] | None] = []
    for (start, end), (t, h, w) in zip(spans, grid.tolist()):
        expected = t * h * w // tokens.merge_size**2
        if end - start - 2 != expected:
            raise ValueError(
                f"Row {row}: an image span of {end - start - 2} placeholder tokens, but "
                f"image_grid_thw {[t, h, w]} needs {expected}; tokenize the row with the "
                "served model's processor."
            )
        sizes.append((w * tokens.patch_size, h * tokens.patch_size))
    return sizes


def _png(image: Any, size: tuple[int, int] | None) -> bytes:
    from PIL import Image

    if not isinstance(image, Image.Image):
        raise ValueError(f"images hold {type(image).__name__}, expected PIL images")
    image = image.convert("RGB")
    if size is not None and image.size != size:
        image = image.resize(size, resample=Image.Resampling.BICUBIC)
    buffer = io.BytesIO()
    image.save(buffer, format=IMAGE_FORMAT)
    return buffer.getvalue()
