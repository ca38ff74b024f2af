"""Images in message logs: content parts, and the packed vision inputs of tokenized messages.

A message's ``content`` may be a list of parts in the usual chat format::

    [{"type": "image", "image": <PIL image | local path | bytes>}, {"type": "text", "text": "..."}]

Tokenized with a processor (``get_formatted_message_log(log, processor)``), such a message
carries its ``token_ids`` with the model's image placeholders expanded, and its vision
inputs (``pixel_values``, ``image_grid_thw`` or whatever the processor returns) each in a
:class:`PackedTensor`: per-item tensors that are concatenated along ``dim_to_pack`` only
when a model needs them, so selecting, slicing and repeating samples never copies image data.
``PackedTensor`` is defined in ``envloop.distributed.packed_tensor`` (so ``BatchedDataDict``
can handle it) and published here.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from envloop.distributed.packed_tensor import PackedTensor

__all__ = [
    "TEXT_ONLY_KEYS",
    "PackedTensor",
    "content_images",
    "content_text_parts",
    "get_dim_to_pack_along",
    "has_images",
    "is_processor",
    "load_image",
    "message_vision_inputs",
    "text_tokenizer",
    "vision_keys",
]

TEXT_ONLY_KEYS = frozenset(
    {"input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids", "position_ids"}
)
"""Processor outputs that are per-token text inputs, not vision inputs."""


def get_dim_to_pack_along(processor: Any, key: str) -> int:
    """The dimension along which ``key``'s items are packed: the first, for every processor
    envloop knows (patches [N, D], grids [N, 3], images [N, C, H, W])."""
    del processor, key
    return 0


def is_processor(tokenizer_or_processor: Any) -> bool:
    """Whether this is a multimodal processor (it holds an image processor and a tokenizer)."""
    return hasattr(tokenizer_or_processor, "image_processor") and hasattr(
        tokenizer_or_processor, "tokenizer"
    )


def text_tokenizer(tokenizer_or_processor: Any) -> Any:
    """The text tokenizer of a processor, or the tokenizer itself."""
    if is_processor(tokenizer_or_processor):
        return tokenizer_or_processor.tokenizer
    return tokenizer_or_processor


def vision_keys(processor_output: Mapping[str, Any]) -> list[str]:
    """The keys of a processor's output that are vision inputs (not per-token text ones)."""
    return [k for k in processor_output if k not in TEXT_ONLY_KEYS]


def message_vision_inputs(
    processor: Any, processor_output: Mapping[str, Any]
) -> dict[str, PackedTensor]:
    """A processor's vision outputs for one message, each as a one-item :class:`PackedTensor`."""
    return {
        key: PackedTensor(
            [torch.as_tensor(processor_output[key])], get_dim_to_pack_along(processor, key)
        )
        for key in vision_keys(processor_output)
    }


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


def content_text_parts(content: Any) -> str:
    """The text of a message's ``content``: itself if a string, else its text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            str(p.get("text", ""))
            for p in content
            if isinstance(p, Mapping) and p.get("type") == "text"
        )
    return "" if content is None else str(content)


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
                f"{where}: an image must be a PIL image, a local file path or encoded bytes, "
                f"got {type(image).__name__}."
            )
        opened.load()
    except (UnidentifiedImageError, OSError) as exc:
        shown = (
            f"{os.fspath(image)!r}" if isinstance(image, (str, os.PathLike)) else "the bytes given"
        )
        raise ValueError(
            f"{where}: {shown} is not a readable image ({exc}); give a PNG, JPEG or another "
            "format Pillow reads."
        ) from None
    return opened.convert("RGB")


def _is_image_part(part: Any) -> bool:
    return isinstance(part, Mapping) and part.get("type") == "image"
