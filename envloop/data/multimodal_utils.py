"""Images in message logs: content parts, and the packed vision inputs of tokenized messages.

A message's ``content`` may be a list of parts in the usual chat format::

    [{"type": "image", "image": <PIL image | local path | bytes>}, {"type": "text", "text": "..."}]

Tokenized with a processor (``get_formatted_message_log(log, processor)``), such a message
carries its ``token_ids`` with the model's image placeholders expanded, and its vision
inputs (``pixel_values``, ``image_grid_thw`` or whatever the processor returns) each in a
:class:`PackedTensor`: per-item tensors that are concatenated along ``dim_to_pack`` only
when a model needs them, so selecting, slicing and repeating samples never copies image data.
``PackedTensor`` is defined in ``envloop.distributed.packed_tensor`` (so ``BatchedDataDict``
can handle it) and published here, with the media key and content type names that
``BatchedDataDict.repeat_interleave(..., share_immutable_media=True)`` shares
(``envloop.distributed.media_sharing``). See docs/multimodal_data.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from envloop.data.content_parts import (
    content_images,
    content_text_parts,
    has_images,
    load_image,
)
from envloop.distributed.media_sharing import (
    AUDIO_CONTENT_TYPES,
    IMAGE_CONTENT_TYPES,
    MULTIMODAL_CONTENT_TYPES,
    NATIVE_MULTIMODAL_KEYS,
    VIDEO_CONTENT_TYPES,
    VLLM_MULTIMODAL_DATA_KEYS,
)
from envloop.distributed.packed_tensor import PackedTensor

__all__ = [
    "AUDIO_CONTENT_TYPES",
    "IMAGE_CONTENT_TYPES",
    "MULTIMODAL_CONTENT_TYPES",
    "NATIVE_MULTIMODAL_KEYS",
    "TEXT_ONLY_KEYS",
    "VIDEO_CONTENT_TYPES",
    "VLLM_MULTIMODAL_DATA_KEYS",
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
