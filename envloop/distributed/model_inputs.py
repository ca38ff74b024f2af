"""The model inputs of a batch besides token ids: ``BatchedDataDict.get_multimodal_dict``.

Every ``PackedTensor`` column is a model input (``pixel_values``, ``image_grid_thw``,
audio features, ...), and so are the per-token tensors a multimodal model needs beside
``input_ids`` (``OPTIONAL_MODEL_INPUT_KEYS``). Some inputs describe others row by row
(``COUPLED_MEDIA_KEYS``: the grid of each image's patches); materialising deduplicated
values, their rows must hold the same number of segments in both, or the model would
pair an image with another image's grid.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from envloop.distributed.packed_tensor import PackedTensor

__all__ = [
    "COUPLED_MEDIA_KEYS",
    "OPTIONAL_MODEL_INPUT_KEYS",
    "PIXEL_DTYPE_CAST_KEYS",
    "check_coupled_segments",
    "multimodal_inputs",
]

OPTIONAL_MODEL_INPUT_KEYS = ("token_type_ids", "mm_token_type_ids")
"""Per-token tensors some multimodal models take beside ``input_ids`` (Gemma 3 marks its
image tokens with ``token_type_ids``; Qwen2.5-VL its text/image/video tokens with
``mm_token_type_ids``)."""
PIXEL_DTYPE_CAST_KEYS = frozenset({"pixel_values", "pixel_values_videos"})
"""The keys ``pixel_dtype`` casts (other media values, e.g. integer grids, are kept)."""
COUPLED_MEDIA_KEYS = (
    ("pixel_values", "image_grid_thw"),
    ("pixel_values", "imgs_sizes"),
    ("pixel_values", "num_frames"),
    ("pixel_values_videos", "video_grid_thw"),
)
"""Pairs ``(media, metadata)`` whose rows hold one segment each per image or video."""


def check_coupled_segments(batch: Mapping[str, Any]) -> None:
    """``ValueError`` if a coupled pair's deduplicated values differ in per-row segment
    counts (plain values are not scanned: their rows are their own items)."""
    for value_key, metadata_key in COUPLED_MEDIA_KEYS:
        value, metadata = batch.get(value_key), batch.get(metadata_key)
        if not isinstance(value, PackedTensor) or not isinstance(metadata, PackedTensor):
            continue
        if not (value.segmented or metadata.segmented):
            continue
        value_counts = value.logical_segment_counts_by_row()
        metadata_counts = metadata.logical_segment_counts_by_row()
        if value_counts != metadata_counts:
            raise ValueError(
                "Coupled multimodal keys must have the same ordered per-row segment counts, "
                f"but {value_key!r} has {value_counts} and {metadata_key!r} has "
                f"{metadata_counts}. Build both from the same processor output per message "
                "(get_formatted_message_log does), and move their rows together."
            )


def multimodal_inputs(
    batch: Mapping[str, Any],
    as_tensors: bool = False,
    device: str | torch.device | None = None,
    pixel_dtype: torch.dtype | None = None,
) -> dict[str, Any]:
    """The ``PackedTensor`` columns of ``batch`` (each packed, ``as_tensor(device)``, if
    ``as_tensors``) and its ``OPTIONAL_MODEL_INPUT_KEYS`` tensors, in column order.

    ``pixel_dtype`` casts the ``PIXEL_DTYPE_CAST_KEYS`` values (``PackedTensor.to_dtype``:
    each stored segment once, shared rows kept shared).
    """
    if as_tensors:
        check_coupled_segments(batch)
    out: dict[str, Any] = {}
    for key, value in batch.items():
        if isinstance(value, PackedTensor):
            if pixel_dtype is not None and key in PIXEL_DTYPE_CAST_KEYS:
                value = value.to_dtype(pixel_dtype)
            out[key] = value.as_tensor(device) if as_tensors else value
        elif key in OPTIONAL_MODEL_INPUT_KEYS:
            moves = as_tensors and device is not None and isinstance(value, torch.Tensor)
            out[key] = value.to(device) if moves else value
        # other columns (token ids, lengths, logs) are not multimodal inputs
    return out
