"""PackedTensor(pad_to_max_shape=True): media of mixed shapes padded, then packed."""

from __future__ import annotations

import pytest
import torch

from envloop.distributed.media_padding import pad_and_concat
from envloop.distributed.packed_tensor import PackedTensor


def _ramp(*shape: int) -> torch.Tensor:
    return torch.arange(1, 1 + torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)


def test_images_of_mixed_sizes_are_zero_padded_to_the_largest_height_and_width():
    wide, tall = _ramp(1, 3, 2, 4), _ramp(1, 3, 4, 2)
    packed = PackedTensor([wide, None, tall], dim_to_pack=0, pad_to_max_shape=True).as_tensor()
    assert packed.shape == (2, 3, 4, 4)
    assert torch.equal(packed[0, :, :2, :], wide[0]) and not packed[0, :, 2:, :].any()
    assert torch.equal(packed[1, :, :, :2], tall[0]) and not packed[1, :, :, 2:].any()


@pytest.mark.parametrize(
    ("shapes", "packed_shape"),
    [
        ([(1, 80, 30), (2, 80, 50)], (3, 80, 50)),  # audio features [clips, mels, frames]
        ([(4, 3, 2, 8, 6), (2, 3, 2, 6, 8)], (6, 3, 2, 8, 8)),  # video [frames, C, T, H, W]
    ],
)
def test_audio_and_video_pad_every_dimension_but_the_packing_one(shapes, packed_shape):
    first, second = _ramp(*shapes[0]), _ramp(*shapes[1])
    packed = PackedTensor([first, second], 0, pad_to_max_shape=True).as_tensor()
    assert packed.shape == packed_shape
    n = shapes[0][0]
    assert torch.equal(packed[(slice(0, n), *(slice(0, s) for s in shapes[0][1:]))], first)
    assert torch.equal(packed[(slice(n, None), *(slice(0, s) for s in shapes[1][1:]))], second)
    assert packed.sum() == first.sum() + second.sum()  # the rest is zeros


def test_a_negative_packing_dimension_counts_from_the_end():
    packed = PackedTensor([_ramp(2, 3, 1), _ramp(4, 2, 1)], -3, pad_to_max_shape=True)
    assert packed.as_tensor().shape == (6, 3, 1)
    along_last = pad_and_concat([_ramp(3, 2), _ramp(2, 5)], -1, True)
    assert along_last.shape == (3, 7)


def test_padding_survives_row_operations_and_deduplication():
    small = PackedTensor(_ramp(1, 1, 2), 0, pad_to_max_shape=True).enable_deduplication()
    large = PackedTensor(_ramp(1, 2, 1), 0, pad_to_max_shape=True).enable_deduplication()
    joined = PackedTensor.concat([small, small, large])
    assert joined.pad_to_max_shape and len(joined.tensors) == 2
    out = joined.slice([0, 2]).as_tensor()
    assert out.shape == (2, 2, 2)
    assert out[0].tolist() == [[1.0, 2.0], [0.0, 0.0]] and out[1].tolist() == [
        [1.0, 0.0],
        [2.0, 0.0],
    ]


def test_without_padding_mismatched_shapes_fail_as_torch_does():
    with pytest.raises(RuntimeError):
        PackedTensor([_ramp(1, 3, 2), _ramp(1, 3, 4)], 0).as_tensor()


def test_padding_tensors_of_different_ranks_is_refused_naming_the_ranks():
    with pytest.raises(ValueError) as raised:
        PackedTensor([torch.ones(1, 3, 4), torch.ones(1, 3)], 0, pad_to_max_shape=True).as_tensor()
    assert str(raised.value).startswith(
        "pad_to_max_shape requires tensors with the same rank, but received ranks [2, 3]; "
        "give every item of this input the same number of dimensions"
    )


def test_a_packing_dimension_the_tensors_lack_is_an_index_error():
    with pytest.raises(IndexError, match=r"dim_to_pack=3 is invalid for tensors with rank 3; use "):
        pad_and_concat([torch.ones(1, 3, 4), torch.ones(2, 3, 4)], 3, True)
    with pytest.raises(IndexError, match="dim_to_pack=3 is invalid"):
        PackedTensor([torch.ones(1, 3, 4)], 3, pad_to_max_shape=True)
