"""A row's images as inference servers take them: image spans of a Qwen-VL prompt, images
sent at the size the processor used (so the server embeds the trainer's pixels), and the
request bodies each dialect's source defines for a prompt with images.

vLLM and SGLang do not run here: the SGLang body follows its ``/generate`` (``input_ids``
with one ``<|image_pad|>`` per image and ``image_data``, which its Qwen-VL processor
expands); the llama.cpp body its ``/completion`` prompt object (``prompt_string`` with the
``media_marker`` of ``GET /props``, ``multimodal_data`` in base64), whose answers
tests/integration/test_server_vlm.py checks against a real server.
"""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from PIL import Image

from envloop.models.generation.server_dialects import (
    GenerationRequest,
    LlamaCppDialect,
    Sampling,
    ServerMedia,
    SglangDialect,
    VllmDialect,
)
from envloop.models.generation.server_media import (
    RequestImages,
    VisionTokens,
    image_spans,
    request_images,
)
from envloop.models.tiny_vlm import build_tiny_vlm_processor, tiny_vlm_config
from tests.fixtures.images import noise_image

TOKENS = VisionTokens(start=400, pad=402, end=401, patch_size=14, merge_size=2)
GREEDY = Sampling(1.0, 1.0, None, greedy=True)
MARKER = "<__media_Z6noNp8V3JGMImN5BG6MC7x4W3DegM4h__>"


@pytest.fixture(scope="module")
def processor():
    return build_tiny_vlm_processor()


def decoded(png: bytes) -> Image.Image:
    return Image.open(io.BytesIO(png))


def test_vision_tokens_come_from_a_vlm_config_and_not_a_text_one(processor):
    config = tiny_vlm_config(processor)
    assert VisionTokens.from_config(config) == TOKENS
    assert VisionTokens.from_config(config.text_config) is None


def test_image_spans_are_whole_start_pad_end_runs():
    prompt = [7, 400, 402, 402, 401, 9, 400, 401, 400, 402, 401, 402, 400, 402]
    assert image_spans(prompt, TOKENS) == [(1, 5), (8, 11)]  # not an empty or open span


def test_images_go_at_the_processors_size_and_give_its_pixel_values(processor):
    images = [noise_image(0, 70, 100), noise_image(1, 56, 84)]  # resized / already that size
    out = processor.image_processor(images=images, return_tensors="pt")
    grid = out["image_grid_thw"]
    pads = (grid.prod(-1) // 4).tolist()
    prompt = [5, 400, *[402] * pads[0], 401, 6, 400, *[402] * pads[1], 401, 7]
    sent = request_images(0, prompt, images, grid, TOKENS)
    assert sent.spans == ((1, 3 + pads[0]), (4 + pads[0], 6 + pads[0] + pads[1]))
    received = [decoded(png) for png in sent.png]
    assert [im.size for im in received] == [(112, 56), (84, 56)]
    assert np.array_equal(np.asarray(received[1]), np.asarray(images[1]))  # untouched
    again = processor.image_processor(images=received, return_tensors="pt")
    assert torch.equal(again["pixel_values"], out["pixel_values"])
    assert torch.equal(again["image_grid_thw"], grid)


def test_images_that_do_not_match_the_prompt_name_the_row():
    prompt = [5, 400, 402, 402, 401]
    with pytest.raises(ValueError, match=r"^Row 3 has 1 image\(s\) in its prompt but 2 in its"):
        request_images(3, prompt, [noise_image(0, 28, 28)] * 2, None, TOKENS)
    with pytest.raises(ValueError, match=r"^Row 1 has 1 image\(s\) in its prompt but NoneType"):
        request_images(1, prompt, None, None, TOKENS)
    grid = torch.tensor([[1, 2, 2]])  # one merged patch, but the span holds two pads
    with pytest.raises(ValueError, match=r"^Row 0: an image span of 2 placeholder tokens, but"):
        request_images(0, prompt, [noise_image(0, 28, 28)], grid, TOKENS)


PROMPT = [1, 20, 400, 402, 402, 401, 30, 31, 400, 402, 401, 32]
PNGS = (b"\x89PNG-first", b"\x89PNG-second")
REQUEST = GenerationRequest(PROMPT, 4, None, 7, RequestImages(PNGS, ((2, 6), (8, 11))))


def llamacpp() -> LlamaCppDialect:
    return LlamaCppDialect(decode=lambda ids: "".join(f"<{i}>" for i in ids))


def test_llamacpp_sends_the_text_around_the_images_with_the_servers_marker():
    body = llamacpp().body(REQUEST, GREEDY, ServerMedia(True, MARKER))
    assert body["prompt"] == {
        "prompt_string": f"<1><20>{MARKER}<30><31>{MARKER}<32>",
        "multimodal_data": [base64.b64encode(png).decode() for png in PNGS],
    }
    score = llamacpp().score_body(REQUEST, [50, 51], GREEDY, 4, 0, ServerMedia(True, MARKER))
    assert score["prompt"]["prompt_string"] == f"<1><20>{MARKER}<30><31>{MARKER}<32><50><51>"
    text_only = GenerationRequest(PROMPT, 4, None, 7)
    assert llamacpp().body(text_only, GREEDY, ServerMedia(True, MARKER))["prompt"] == PROMPT
    with pytest.raises(ValueError, match="needs the server's media marker"):
        llamacpp().body(REQUEST, GREEDY, None)


def test_llamacpp_props_say_whether_a_server_takes_images():
    props = {"modalities": {"vision": True, "video": True, "audio": False}, "media_marker": MARKER}
    assert LlamaCppDialect.parse_media(props) == ServerMedia(True, MARKER)
    text = {"modalities": {"vision": False, "video": False, "audio": False}, "media_marker": "m"}
    assert LlamaCppDialect.parse_media(text) == ServerMedia(False, None)


def test_sglang_sends_one_pad_per_image_and_the_images_as_data_uris():
    body = SglangDialect().body(REQUEST, GREEDY)
    assert body["input_ids"] == [1, 20, 400, 402, 401, 30, 31, 400, 402, 401, 32]
    assert body["image_data"] == [
        "data:image/png;base64," + base64.b64encode(png).decode() for png in PNGS
    ]
    assert "image_data" not in SglangDialect().body(GenerationRequest(PROMPT, 4, None, 7), GREEDY)


def test_only_vllm_refuses_images_and_says_what_to_use():
    assert "serve the model with llama.cpp (--mmproj) or SGLang" in VllmDialect.images_refused
    assert SglangDialect.images_refused is None and LlamaCppDialect.images_refused is None
