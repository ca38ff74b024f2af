"""SampleVision: each sample's vision inputs as references to its messages' tensors, joined
only for the policy call at hand."""

from __future__ import annotations

import torch
from PIL import Image

from envloop.data.multimodal_utils import PackedTensor
from envloop.experience.sample_vision import SampleVision


def image_message(role: str, pixels: torch.Tensor, colour: str) -> dict:
    return {
        "role": role,
        "content": [{"type": "image", "image": Image.new("RGB", (4, 4), colour)}],
        "pixel_values": PackedTensor([pixels], 0),
    }


def test_a_shared_prompt_image_is_referenced_not_copied_and_joined_per_call():
    prompt_pixels = torch.arange(12.0).reshape(3, 4)
    prompt = image_message("user", prompt_pixels, "red")
    vision = SampleVision(2)
    vision.reset(0, [prompt])  # two generations of one prompt share its message
    vision.reset(1, [prompt])
    assert vision.inputs[0]["pixel_values"][0] is vision.inputs[1]["pixel_values"][0]

    observation_pixels = torch.full((2, 4), -1.0)
    vision.add(1, image_message("user", observation_pixels, "blue"))
    assert vision.inputs[1]["pixel_values"][0] is vision.inputs[0]["pixel_values"][0]

    columns = vision.columns([0, 1])
    first, second = columns["pixel_values"].tensors
    assert first.data_ptr() == vision.inputs[0]["pixel_values"][0].data_ptr()  # uncopied
    assert torch.equal(second, torch.cat([prompt_pixels, observation_pixels]))
    assert [len(images) for images in columns["images"]] == [1, 2]
    assert columns["images"][1][1].getpixel((0, 0)) == (0, 0, 255)


def test_samples_without_images_give_no_columns():
    vision = SampleVision(2)
    vision.reset(0, [{"role": "user", "content": "no picture"}])
    assert not vision.any and vision.columns([0, 1]) == {}
