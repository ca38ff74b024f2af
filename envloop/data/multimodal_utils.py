"""Images in message logs: content parts, and the packed vision inputs of tokenized messages.

A message's ``content`` may be a list of parts in the usual chat format::

    [{"type": "image", "image": <PIL image | local path | bytes>}, {"type": "text", "text": "..."}]

Tokenized with a processor (``get_formatted_message_log(log, processor)``), such a message
carries its ``token_ids`` with the model's image placeholders expanded, and its vision
inputs (``pixel_values``, ``image_grid_thw`` or whatever the processor returns) each in a
:class:`PackedTensor`: per-item tensors that are concatenated along ``dim_to_pack`` only
when a model needs them, so selecting, slicing and repeating samples never copies image data.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

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


class PackedTensor:
    """A batch of items (one per sample or per message), each a tensor or None, kept apart.

    ``as_tensor()`` concatenates the present items along ``dim_to_pack`` (e.g. the image
    patches of every sample, [sum of patches, D], as a vision tower takes them). Selecting,
    slicing and repeating build new lists of the same tensor objects: no image data is copied.

    >>> p = PackedTensor([torch.ones(2, 3), None, torch.zeros(1, 3)], dim_to_pack=0)
    >>> len(p), tuple(p.as_tensor().shape), len(p.slice([2, 0]))
    (3, (3, 3), 2)
    >>> PackedTensor.flattened_concat([p, p.slice([1])]).as_tensor().shape[0]
    3
    """

    def __init__(self, tensors: torch.Tensor | Sequence[torch.Tensor | None], dim_to_pack: int):
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        if not isinstance(tensors, Sequence) or isinstance(tensors, (str, bytes)):
            raise TypeError(
                f"PackedTensor takes a tensor or a list of tensors (None for an item without "
                f"this input), got {type(tensors).__name__}."
            )
        items = list(tensors)
        for k, item in enumerate(items):
            if item is not None and not isinstance(item, torch.Tensor):
                raise TypeError(
                    f"PackedTensor item {k} is a {type(item).__name__}; items are tensors or None."
                )
            if item is not None and item.dim() <= dim_to_pack:
                raise ValueError(
                    f"PackedTensor item {k} has shape {tuple(item.shape)}, which has no "
                    f"dimension {dim_to_pack} to pack along."
                )
        self.tensors: list[torch.Tensor | None] = items
        self.dim_to_pack = dim_to_pack

    def __len__(self) -> int:
        return len(self.tensors)

    def __iter__(self) -> Iterator[torch.Tensor | None]:
        return iter(self.tensors)

    def __getitem__(self, index: int) -> torch.Tensor | None:
        return self.tensors[index]

    def __repr__(self) -> str:
        shapes = [None if t is None else tuple(t.shape) for t in self.tensors[:4]]
        more = f", ... {len(self) - 4} more" if len(self) > 4 else ""
        return f"PackedTensor({len(self)} items {shapes}{more}, dim_to_pack={self.dim_to_pack})"

    def as_tensor(self, device: str | torch.device | None = None) -> torch.Tensor | None:
        """The present items concatenated along ``dim_to_pack`` (None when all are None)."""
        present = [t for t in self.tensors if t is not None]
        if not present:
            return None
        packed = present[0] if len(present) == 1 else torch.cat(present, dim=self.dim_to_pack)
        return packed if device is None else packed.to(device)

    def to(self, device: str | torch.device) -> PackedTensor:
        """Every item moved to ``device``."""
        return PackedTensor(
            [None if t is None else t.to(device) for t in self.tensors], self.dim_to_pack
        )

    def slice(self, indices: Iterable[int] | torch.Tensor | slice) -> PackedTensor:
        """The items at ``indices`` (a slice, a list or a 1-D tensor), in that order."""
        if isinstance(indices, slice):
            return PackedTensor(self.tensors[indices], self.dim_to_pack)
        if isinstance(indices, torch.Tensor):
            indices = indices.tolist()
        return PackedTensor([self.tensors[int(i)] for i in indices], self.dim_to_pack)

    def repeat_interleave(self, repeats: int) -> PackedTensor:
        """Each item ``repeats`` times in a row, sharing the item's tensor (no copy)."""
        return PackedTensor([t for t in self.tensors for _ in range(repeats)], self.dim_to_pack)

    @classmethod
    def empty_like(cls, other: PackedTensor, num_items: int = 0) -> PackedTensor:
        """``num_items`` None items, packed like ``other``."""
        return cls([None] * num_items, other.dim_to_pack)

    @classmethod
    def concat(cls, packed: Sequence[PackedTensor]) -> PackedTensor:
        """The items of every ``packed`` value in order (batches joined end to end)."""
        dim = _common_dim(packed)
        return cls([t for p in packed for t in p.tensors], dim)

    @classmethod
    def flattened_concat(cls, packed: Sequence[PackedTensor | None]) -> PackedTensor:
        """One item per entry of ``packed``: that entry's items concatenated (None for a
        None entry or one with no present item). Turns a log's per-message values into one
        per-sample item, or per-sample values into a batch."""
        dim = _common_dim([p for p in packed if p is not None])
        return cls([None if p is None else p.as_tensor() for p in packed], dim)


def _common_dim(packed: Sequence[PackedTensor]) -> int:
    dims = {p.dim_to_pack for p in packed}
    if len(dims) > 1:
        raise ValueError(f"PackedTensor values packed along different dimensions: {sorted(dims)}.")
    return dims.pop() if dims else 0


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
