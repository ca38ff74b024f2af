"""BatchedDataDict.repeat_interleave(..., share_immutable_media=True): repeats share media."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.distributed.packed_tensor import PackedTensor


def _log(pixels: PackedTensor, image: Image.Image) -> list[dict]:
    return [
        {
            "role": "user",
            "content": [{"type": "image", "image": image}, {"type": "text", "text": "what?"}],
            "token_ids": torch.tensor([1, 2, 3]),
            "pixel_values": pixels,
        }
    ]


def test_plain_repeats_copy_the_media_as_published():
    pixels = PackedTensor(torch.rand(4, 6), dim_to_pack=0)
    image = Image.new("RGB", (4, 4))
    plain = BatchedDataDict({"message_log": [_log(pixels, image)]}).repeat_interleave(3)
    first, second = plain["message_log"][0][0], plain["message_log"][1][0]
    assert not pixels.deduplication_enabled and not first["pixel_values"].deduplication_enabled
    copies = [first["pixel_values"].tensors[0], second["pixel_values"].tensors[0]]
    assert len({id(pixels.tensors[0]), *map(id, copies)}) == 3
    assert torch.equal(copies[0], pixels.tensors[0]) and torch.equal(copies[1], pixels.tensors[0])
    assert first["content"][0]["image"] is not image and second["content"][0]["image"] is not image
    assert first["content"][0]["image"].tobytes() == image.tobytes()


def test_shared_media_is_deduplicated_and_the_containers_stay_separate():
    pixels = PackedTensor(torch.rand(4, 6), dim_to_pack=0)
    image = Image.new("RGB", (4, 4))
    batch = BatchedDataDict({"message_log": [_log(pixels, image)]})
    shared = batch.repeat_interleave(3, share_immutable_media=True)
    assert pixels.deduplication_enabled  # the source's PackedTensors get provenance in place
    logs = shared["message_log"]
    first, second = logs[0][0], logs[1][0]
    assert first is not second and first["content"] is not second["content"]
    assert first["pixel_values"] is not second["pixel_values"]
    assert (
        first["pixel_values"].tensors[0] is second["pixel_values"].tensors[0] is pixels.tensors[0]
    )
    assert first["pixel_values"]._segment_provenance == pixels._segment_provenance
    assert first["content"][0]["image"] is image
    assert first["token_ids"].data_ptr() != second["token_ids"].data_ptr()


@pytest.mark.parametrize("share_immutable_media", [False, True])
def test_a_packed_tensor_column_is_refused_with_the_fix(share_immutable_media):
    pixels = PackedTensor(torch.rand(4, 6), dim_to_pack=0)
    batch = BatchedDataDict({"message_log": [_log(pixels, Image.new("RGB", (4, 4)))]})
    batch["pixel_values"] = pixels
    with pytest.raises(
        NotImplementedError,
        match=r"PackedTensor does not currently support repeat_interleave \(column "
        r"'pixel_values'\).*batch\['pixel_values'\]\.repeat_interleave\(n\)",
    ):
        batch.repeat_interleave(2, share_immutable_media=share_immutable_media)
    assert not pixels.deduplication_enabled  # refused before anything changed
    repeated = pixels.repeat_interleave(2)
    assert len(repeated) == 2 and repeated[1] is pixels.tensors[0]


def test_raw_media_under_native_keys_and_in_media_parts_is_shared_only_when_asked():
    image, video, audio = torch.ones(1, 2), np.ones((2, 2), np.float32), np.ones(16, np.float32)
    part = {"type": "input_audio", "input_audio": {"data": audio, "format": "wav"}}
    batch = BatchedDataDict(
        {
            "vllm_images": [[image]],
            "vllm_videos": [[video]],
            "vllm_audios": [[(audio, 16_000)]],
            "message_log": [[{"role": "user", "content": [part, {"type": "text", "text": "hi"}]}]],
            "extra": [[torch.zeros(2)]],
        }
    )
    plain = batch.repeat_interleave(2)
    assert plain["vllm_images"][0][0] is not plain["vllm_images"][1][0]
    assert plain["vllm_videos"][0][0] is not plain["vllm_videos"][1][0]
    assert plain["vllm_audios"][0][0][0] is not plain["vllm_audios"][1][0][0]
    shared = batch.repeat_interleave(2, share_immutable_media=True)
    assert shared["vllm_images"][0] is not shared["vllm_images"][1]
    assert shared["vllm_images"][0][0] is shared["vllm_images"][1][0] is image
    assert shared["vllm_videos"][1][0] is video and shared["vllm_audios"][1][0][0] is audio
    parts = [log[0]["content"] for log in shared["message_log"]]
    assert parts[0] is not parts[1] and parts[0][0] is not parts[1][0]
    assert parts[1][0]["input_audio"]["data"] is audio
    assert shared["extra"][0][0] is not shared["extra"][1][0]  # not media: copied
