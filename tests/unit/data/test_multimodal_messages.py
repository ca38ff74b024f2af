"""get_formatted_message_log with a multimodal processor (tiny Qwen2.5-VL, real PIL images):
token-exact against ``processor.apply_chat_template`` of the whole conversation, vision inputs
per message, clear errors for unreadable images, and processors loaded without torchvision."""

from __future__ import annotations

import io
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from envloop.data.interfaces import TaskDataSpec
from envloop.data.llm_message_utils import get_formatted_message_log
from envloop.data.multimodal_utils import PackedTensor
from envloop.models.processors import load_processor, torchvision_available
from envloop.models.tiny_vlm import build_tiny_vlm_processor, tiny_vlm_config
from tests.fixtures.images import image_part as _img
from tests.fixtures.images import noise_image
from tests.fixtures.images import text_part as _text

VISION_KEYS = ("pixel_values", "image_grid_thw")
MERGE = 2  # Qwen2.5-VL merges 2x2 patches into one image token


@pytest.fixture(scope="module")
def processor():
    return build_tiny_vlm_processor()


def _image(seed: int, width: int = 40, height: int = 30) -> Image.Image:
    return noise_image(seed, height, width)


CONVERSATIONS = {
    "system prompt and one image": [
        {"role": "system", "content": "You count shapes."},
        {"role": "user", "content": [_img(_image(1)), _text("How many?")]},
    ],
    "several images in one message": [
        {
            "role": "user",
            "content": [
                _text("Compare "),
                _img(_image(2, 60, 20)),
                _text(" and "),
                _img(_image(3, 14, 90)),
                _img(_image(4)),
            ],
        },
        {"role": "assistant", "content": "The first."},
    ],
    "images in several messages, text between": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [_img(_image(5, 100, 100)), _text("What is it?")]},
        {"role": "assistant", "content": "A square."},
        {"role": "user", "content": "And its colour?"},
        {"role": "assistant", "content": [_text("Red.")]},
        {"role": "user", "content": [_text("Now this one:"), _img(_image(6, 28, 28))]},
    ],
    "an image-only message": [{"role": "user", "content": [_img(_image(7))]}],
}


def _expected(processor, log: list[dict], add_generation_prompt: bool = False) -> dict:
    return processor.apply_chat_template(
        log,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
        add_generation_prompt=add_generation_prompt,
    )


def _vision(log: list[dict], key: str) -> torch.Tensor:
    return torch.cat([m[key].as_tensor() for m in log if key in m])


def _image_count(message: dict) -> int:
    content = message["content"]
    return sum(p["type"] == "image" for p in content) if isinstance(content, list) else 0


@pytest.mark.parametrize("add_generation_prompt", [False, True])
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_token_ids_and_vision_inputs_equal_the_processors_chat_template(
    processor, name, add_generation_prompt
):
    conversation = CONVERSATIONS[name]
    log = get_formatted_message_log(
        conversation, processor, add_generation_prompt=add_generation_prompt
    )
    expected = _expected(processor, conversation, add_generation_prompt)
    assert torch.cat([m["token_ids"] for m in log]).tolist() == expected["input_ids"][0].tolist()
    for key in VISION_KEYS:
        assert torch.equal(_vision(log, key), expected[key])
    image_id = processor.image_token_id
    for message, original in zip(log, conversation):
        assert message["content"] is original["content"]
        assert message["token_ids"].dtype == torch.long
        if not _image_count(message):
            assert not set(VISION_KEYS) & set(message)
            assert image_id not in message["token_ids"].tolist()
            continue
        grid = message["image_grid_thw"]
        assert isinstance(grid, PackedTensor) and len(grid) == 1
        assert grid[0].shape == (_image_count(message), 3)
        placeholders = int((message["token_ids"] == image_id).sum())
        assert placeholders == int(grid[0].prod(dim=1).sum()) // MERGE**2
        assert message["pixel_values"][0].shape == (int(grid[0].prod(dim=1).sum()), 1176)


def test_a_task_prompt_is_applied_to_the_text_part_of_list_content(processor, tmp_path: Path):
    image = _image(8)
    conversation = [{"role": "user", "content": [_img(image), _text("3 circles")]}]
    (tmp_path / "prompt.txt").write_text("Count them: {}", encoding="utf-8")
    spec = TaskDataSpec(task_name="count", prompt_file=tmp_path / "prompt.txt")
    log = get_formatted_message_log(conversation, processor, spec)
    prompted = [{"role": "user", "content": [_img(image), _text("Count them: 3 circles")]}]
    expected = _expected(processor, prompted)
    assert torch.cat([m["token_ids"] for m in log]).tolist() == expected["input_ids"][0].tolist()
    assert log[0]["content"] == prompted[0]["content"]
    assert log[0]["content"][0]["image"] is image
    assert torch.equal(_vision(log, "pixel_values"), expected["pixel_values"])
    assert conversation[0]["content"][1]["text"] == "3 circles"


def test_a_conversation_without_images_equals_the_text_path(processor):
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [_text("Hello"), _text(" there")]},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Bye?"},
    ]
    for add_generation_prompt in (False, True):
        with_processor = get_formatted_message_log(
            conversation, processor, add_generation_prompt=add_generation_prompt
        )
        with_tokenizer = get_formatted_message_log(
            conversation, processor.tokenizer, add_generation_prompt=add_generation_prompt
        )
        assert [list(m) for m in with_processor] == [list(m) for m in with_tokenizer]
        assert [m["token_ids"].tolist() for m in with_processor] == [
            m["token_ids"].tolist() for m in with_tokenizer
        ]


def test_paths_and_bytes_give_the_same_inputs_as_pil_images(processor, tmp_path: Path):
    image = _image(9, 50, 36)
    path = tmp_path / "shape.png"
    image.save(path)
    encoded = io.BytesIO()
    image.save(encoded, format="PNG")
    logs = [
        get_formatted_message_log([{"role": "user", "content": [_img(source)]}], processor)
        for source in (image, str(path), path, encoded.getvalue(), {"bytes": encoded.getvalue()})
    ]
    for log in logs[1:]:
        assert log[0]["token_ids"].tolist() == logs[0][0]["token_ids"].tolist()
        for key in VISION_KEYS:
            assert torch.equal(log[0][key][0], logs[0][0][key][0])


def test_a_missing_image_file_names_the_message_and_part(processor, tmp_path: Path):
    missing = tmp_path / "nowhere.png"
    conversation = [
        {"role": "system", "content": "Look."},
        {"role": "user", "content": [_text("See "), _img(str(missing))]},
    ]
    with pytest.raises(ValueError) as raised:
        get_formatted_message_log(conversation, processor)
    assert str(raised.value) == (
        f"message 1, content part 1: image file {str(missing)!r} does not exist; give an "
        "existing local path (relative paths in a dataset are relative to its data file)."
    )


def test_unreadable_image_bytes_name_the_message_and_part(processor):
    conversation = [{"role": "user", "content": [_img(_image(10)), _img(b"not an image")]}]
    with pytest.raises(
        ValueError,
        match=r"^message 0, content part 1: the 12 bytes given is not a readable image \(Pillow ",
    ):
        get_formatted_message_log(conversation, processor)
    with pytest.raises(ValueError, match=re.escape("give a PNG, JPEG or another format Pillow")):
        get_formatted_message_log(conversation, processor)


# --- loading a processor without torchvision ----------------------------------------------


@pytest.fixture(scope="module")
def tiny_vlm_folder(processor, tmp_path_factory) -> Path:
    """A saved tiny VLM's processor and config (the files load_processor reads)."""
    folder = tmp_path_factory.mktemp("tiny_vlm")
    processor.save_pretrained(folder)
    tiny_vlm_config(processor).save_pretrained(folder)
    return folder


def test_load_processor_loads_a_saved_tiny_vlm(processor, tiny_vlm_folder: Path):
    loaded = load_processor(str(tiny_vlm_folder))
    assert type(loaded).__name__ == "Qwen2_5_VLProcessor"
    conversation = CONVERSATIONS["images in several messages, text between"]
    ours = get_formatted_message_log(conversation, processor, add_generation_prompt=True)
    theirs = get_formatted_message_log(conversation, loaded, add_generation_prompt=True)
    assert [m["token_ids"].tolist() for m in theirs] == [m["token_ids"].tolist() for m in ours]
    for key in VISION_KEYS:
        assert torch.equal(_vision(theirs, key), _vision(ours, key))


@pytest.mark.skipif(torchvision_available(), reason="torchvision is installed here")
def test_without_torchvision_video_input_raises_a_clear_error(tiny_vlm_folder: Path):
    loaded = load_processor(str(tiny_vlm_folder))
    with pytest.raises(ValueError) as raised:
        loaded(
            text=["<|vision_start|><|video_pad|><|vision_end|>"], videos=[np.zeros((2, 28, 28, 3))]
        )
    assert str(raised.value) == (
        "Qwen2_5_VLProcessor was built without a video processor because torchvision is not "
        "installed; video input needs torchvision (a build that matches your torch). Images "
        "work without it."
    )


@pytest.mark.skipif(torchvision_available(), reason="torchvision is installed here")
def test_without_torchvision_auto_processor_cannot_load_the_folder(tiny_vlm_folder: Path):
    """Why load_processor exists: transformers wants a video processor for Qwen-VL, and its
    video processors need torchvision, which has no CPU build."""
    from transformers import AutoProcessor

    with pytest.raises(OSError, match="video processor"):
        AutoProcessor.from_pretrained(str(tiny_vlm_folder))
