"""The vision inputs of a generation batch, row by row, checked against the model.

A vision-language prompt batch carries, next to ``input_ids``, one column per vision input
of the processor (``pixel_values``, ``image_grid_thw``, ...), each a
:class:`~envloop.data.multimodal_utils.PackedTensor` with one item per row (None for a
row without images), as ``batched_message_log_to_flat_message`` builds it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from envloop.data.multimodal_utils import PackedTensor

__all__ = ["row_visions", "vision_columns"]


def vision_columns(data: Mapping[str, Any]) -> dict[str, PackedTensor]:
    """The columns of ``data`` that are packed vision inputs."""
    return {k: v for k, v in data.items() if isinstance(v, PackedTensor)}


def row_visions(
    data: Mapping[str, Any], prompts: Sequence[torch.Tensor], model: Any
) -> list[dict[str, torch.Tensor] | None] | None:
    """Each row's vision inputs (None for a row without), or None for a text-only batch.

    Raises ``ValueError`` naming the column or row when the batch has images but the model
    is text-only, a column has the wrong number of items, or a row's image placeholder
    tokens do not match its images (a prompt tokenized with another processor).
    """
    columns = vision_columns(data)
    if not columns:
        return None
    image_token_id = getattr(model.config, "image_token_id", None)
    if getattr(model.config, "vision_config", None) is None:
        raise ValueError(
            f"The generation input has vision columns {sorted(columns)} but the model "
            f"({type(model).__name__}) is text-only; load a vision-language model, or tokenize "
            "the prompts without images."
        )
    for key, column in columns.items():
        if len(column) != len(prompts):
            raise ValueError(
                f"Vision column {key!r} has {len(column)} items for {len(prompts)} prompts; "
                "give one per prompt (None for a prompt without images)."
            )
    visions: list[dict[str, torch.Tensor] | None] = []
    for row, prompt in enumerate(prompts):
        inputs = {k: item for k, c in columns.items() if (item := c[row]) is not None}
        _check_placeholders(row, prompt, inputs, image_token_id, model.config)
        visions.append(inputs or None)
    return visions


def _check_placeholders(
    row: int, prompt: torch.Tensor, inputs: dict[str, Any], image_token_id: Any, config: Any
) -> None:
    grid = inputs.get("image_grid_thw")
    if image_token_id is None:
        return
    found = int((prompt == image_token_id).sum())
    if grid is None:
        if found and "pixel_values" not in inputs:
            raise ValueError(
                f"Row {row} holds {found} image placeholder tokens but no images (no "
                "pixel_values); tokenize its message log with the model's processor."
            )
        return
    merge = getattr(config.vision_config, "spatial_merge_size", 1)
    expected = int(grid.prod(dim=-1).sum()) // (merge * merge)
    if found != expected:
        raise ValueError(
            f"Row {row} holds {found} image placeholder tokens but its images need "
            f"{expected} (image_grid_thw {grid.tolist()}); its prompt and images were not "
            "tokenized together by this model's processor."
        )
