"""BatchedDataDict.get_multimodal_dict: the model inputs besides the token ids."""

from __future__ import annotations

import pytest
import torch

from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.distributed.packed_tensor import PackedTensor


def _batch() -> BatchedDataDict:
    image = PackedTensor(torch.rand(4, 6), 0).enable_deduplication()
    grid = PackedTensor(torch.tensor([[1, 2, 2]]), 0).enable_deduplication()
    return BatchedDataDict(
        {
            "input_ids": torch.zeros(3, 5, dtype=torch.long),
            "pixel_values": PackedTensor.concat([image] * 3),
            "image_grid_thw": PackedTensor.concat([grid] * 3),
            "mm_token_type_ids": torch.ones(3, 5, dtype=torch.long),
            "message_log": [[], [], []],
        }
    )


def test_the_packed_columns_and_token_type_ids_are_the_multimodal_inputs():
    batch = _batch()
    packed = batch.get_multimodal_dict()
    assert list(packed) == ["pixel_values", "image_grid_thw", "mm_token_type_ids"]
    assert packed["pixel_values"] is batch["pixel_values"]
    tensors = batch.get_multimodal_dict(as_tensors=True, device="meta")
    assert (
        tensors["pixel_values"].shape == (12, 6) and tensors["pixel_values"].device.type == "meta"
    )
    assert tensors["image_grid_thw"].shape == (3, 3)
    assert batch.get_multimodal_dict(as_tensors=True)["image_grid_thw"].tolist() == [[1, 2, 2]] * 3
    assert tensors["mm_token_type_ids"].device.type == "meta"
    assert batch["pixel_values"].tensors[0].device.type == "cpu"  # the batch is not moved


def test_pixel_dtype_casts_the_pixels_once_and_keeps_the_grids():
    batch = _batch()
    cast = batch.get_multimodal_dict(pixel_dtype=torch.bfloat16)
    assert len(cast["pixel_values"].tensors) == 1
    assert cast["pixel_values"].tensors[0].dtype == torch.bfloat16
    assert batch["pixel_values"].tensors[0].dtype == torch.float32
    assert cast["image_grid_thw"] is batch["image_grid_thw"]
    out = batch.get_multimodal_dict(as_tensors=True, pixel_dtype=torch.bfloat16)
    assert (
        out["pixel_values"].dtype == torch.bfloat16 and out["image_grid_thw"].dtype == torch.int64
    )


def test_coupled_inputs_whose_rows_disagree_are_refused_before_the_model_sees_them():
    batch = _batch()
    grid = batch["image_grid_thw"]
    batch["image_grid_thw"] = PackedTensor.concat(
        [grid.slice([0, 1]), PackedTensor.empty_like(grid, 1)]
    )
    with pytest.raises(ValueError) as raised:
        batch.get_multimodal_dict(as_tensors=True)
    assert str(raised.value).startswith(
        "Coupled multimodal keys must have the same ordered per-row segment counts, but "
        "'pixel_values' has [1, 1, 1] and 'image_grid_thw' has [1, 1, 0]. Build both"
    )
    assert batch.get_multimodal_dict()["image_grid_thw"] is batch["image_grid_thw"]
