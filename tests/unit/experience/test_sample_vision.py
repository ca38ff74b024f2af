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


def test_a_policy_is_handed_only_the_representation_it_reads():
    prompt = image_message("user", torch.ones(3, 4), "red")
    prompt["image_grid_thw"] = PackedTensor([torch.tensor([[1, 1, 3]])], 0)
    observation = image_message("user", torch.zeros(2, 4), "blue")
    observation["image_grid_thw"] = PackedTensor([torch.tensor([[1, 1, 2]])], 0)
    both = SampleVision(1)
    both.reset(0, [prompt, observation])
    assert sorted(both.columns([0])) == ["image_grid_thw", "images", "pixel_values"]

    images = SampleVision(1, reads_images=True)  # a server backend: images and their grids
    images.reset(0, [prompt, observation])
    columns = images.columns([0])
    assert sorted(columns) == ["image_grid_thw", "images"]
    assert columns["image_grid_thw"][0].tolist() == [[1, 1, 3], [1, 1, 2]]
    assert [image.getpixel((0, 0)) for image in columns["images"][0]] == [
        (255, 0, 0),
        (0, 0, 255),
    ]

    inputs = SampleVision(1, reads_images=False)  # HfGeneration: the vision inputs
    inputs.reset(0, [prompt, observation])
    columns = inputs.columns([0])
    assert sorted(columns) == ["image_grid_thw", "pixel_values"]
    assert torch.equal(columns["pixel_values"][0], torch.cat([torch.ones(3, 4), torch.zeros(2, 4)]))
