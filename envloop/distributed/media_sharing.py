"""Which parts of a row are immutable media that repeated rows share
(``BatchedDataDict.repeat_interleave(..., share_immutable_media=True)``).

``PackedTensor`` values anywhere in a row get provenance ids (``enable_deduplication``), so
the repeats' copies and everything built from them (flattened batches, shards, joined
batches) store each image's tensors once. Raw media (arrays, tensors, audio tuples, URLs)
is shared where a row names it as media: under a key of ``NATIVE_MULTIMODAL_KEYS`` or
inside a content part whose ``type`` is in ``MULTIMODAL_CONTENT_TYPES``. The containers
around them (rows, messages, content lists) are still copied, so repeats can diverge.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from envloop.distributed.packed_tensor import PackedTensor

__all__ = [
    "AUDIO_CONTENT_TYPES",
    "IMAGE_CONTENT_TYPES",
    "MULTIMODAL_CONTENT_TYPES",
    "NATIVE_MULTIMODAL_KEYS",
    "VIDEO_CONTENT_TYPES",
    "VLLM_MULTIMODAL_DATA_KEYS",
    "prepare_media_sharing",
]

VLLM_MULTIMODAL_DATA_KEYS = frozenset({"vllm_images", "vllm_videos", "vllm_audios"})
"""Keys holding raw media for a vLLM-style engine (one list per row)."""
NATIVE_MULTIMODAL_KEYS = frozenset({"vllm_content", *VLLM_MULTIMODAL_DATA_KEYS})
"""Keys whose every leaf is media."""
IMAGE_CONTENT_TYPES = frozenset({"input_image", "image", "image_url"})
VIDEO_CONTENT_TYPES = frozenset({"input_video", "video", "video_url"})
AUDIO_CONTENT_TYPES = frozenset({"input_audio", "audio", "audio_url"})
MULTIMODAL_CONTENT_TYPES = frozenset(
    {*IMAGE_CONTENT_TYPES, *VIDEO_CONTENT_TYPES, *AUDIO_CONTENT_TYPES}
)
"""Content part types whose values are media."""


def prepare_media_sharing(item: Any, media_context: bool = False) -> dict[int, Any]:
    """Enable deduplication on every ``PackedTensor`` in ``item`` (in place; rows unchanged)
    and return the media leaves to share, as ``copy.deepcopy`` memo entries (id -> object).

    ``media_context``: every leaf of ``item`` is media (its column is a native media key).

    >>> import numpy as np
    >>> frame = np.zeros(2)
    >>> part = {"type": "video", "video": frame, "note": ["x"]}
    >>> shared = prepare_media_sharing([part, {"type": "text", "text": "hi"}])
    >>> shared[id(frame)] is frame, any(v == "hi" for v in shared.values() if isinstance(v, str))
    (True, False)
    """
    shared: dict[int, Any] = {}
    stack: list[tuple[Any, bool]] = [(item, media_context)]
    while stack:
        value, in_media = stack.pop()
        if isinstance(value, PackedTensor):
            value.enable_deduplication()
        elif isinstance(value, Mapping):
            typed = value.get("type") in MULTIMODAL_CONTENT_TYPES
            for key, child in reversed(list(value.items())):
                stack.append((child, in_media or typed or key in NATIVE_MULTIMODAL_KEYS))
        elif isinstance(value, (list, tuple)):
            stack.extend((child, in_media) for child in reversed(value))
        elif in_media:
            shared[id(value)] = value
    return shared
