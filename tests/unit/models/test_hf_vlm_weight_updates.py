"""HfGeneration.update_weights with vision-language models: a save_pretrained folder of the
same architecture loads (Qwen2.5-VL's saved key names differ from its modules'), and rows
with images that are in flight switch weights where the update lands, each token's logprob
that of its version's weights with the row's images (see test_hf_weight_updates for what
``keep`` and ``recompute`` mean for the KV cache)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForImageTextToText, DynamicCache

from envloop.data.llm_message_utils import (
    batched_message_log_to_flat_message,
    get_formatted_message_log,
)
from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.models.generation.decode_loop import cache_keyword
from envloop.models.generation.hf_generation import HfGeneration
from tests.fixtures.images import noise_image
from tests.fixtures.tiny_vlms import SAVERS

pytestmark = pytest.mark.slow

BUDGET = 6
SPLIT = 3  # the update lands after this many decode steps


@pytest.fixture(scope="module", params=sorted(SAVERS))
def folders(request, tmp_path_factory):
    """The old and the new weights of one tiny VLM family (seeds 0 and 1)."""
    root = tmp_path_factory.mktemp(request.param)
    return SAVERS[request.param](root / "old", seed=0), SAVERS[request.param](root / "new", seed=1)


def prompt_batch(processor, pad_id: int) -> BatchedDataDict:
    """Three prompts: one image, no image, two images."""
    contents = [
        [{"type": "image", "image": noise_image(0, 64, 96)}, {"type": "text", "text": "How?"}],
        "A prompt without images.",
        [
            {"type": "image", "image": noise_image(1, 32, 32)},
            {"type": "text", "text": "and"},
            {"type": "image", "image": noise_image(2, 96, 40)},
        ],
    ]
    logs = [
        get_formatted_message_log(
            [{"role": "user", "content": content}], processor, add_generation_prompt=True
        )
        for content in contents
    ]
    flat, lengths = batched_message_log_to_flat_message(logs, pad_value_dict={"token_ids": pad_id})
    return BatchedDataDict(
        input_ids=flat["token_ids"],
        input_lengths=lengths,
        pixel_values=flat["pixel_values"],
        image_grid_thw=flat["image_grid_thw"],
    )


def row_vision(data: BatchedDataDict, row: int) -> dict[str, torch.Tensor]:
    keys = ("pixel_values", "image_grid_thw")
    return {key: data[key][row] for key in keys if data[key][row] is not None}


def gathered(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[:, None])[:, 0]


@torch.no_grad()
def forced(model, ids: torch.Tensor, start: int, vision: dict) -> torch.Tensor:
    """Teacher-forced logprobs of ids[0, start:] ([1, L] ids), one pass with the images."""
    types = {"mm_token_type_ids": (ids == model.config.image_token_id).int()} if vision else {}
    logits = model(input_ids=ids, **vision, **types).logits[0]
    return gathered(logits[start - 1 : -1], ids[0, start:])


@torch.no_grad()
def continued(old, new, ids: torch.Tensor, cached: int, vision: dict) -> torch.Tensor:
    """Logprobs of ids[0, cached + 1:] from ``new`` on top of ``old``'s KV cache of
    ids[0, :cached] (prefilled with the images); both at the rotary positions of one pass
    over the whole sequence."""
    types = (ids == old.config.image_token_id).int()
    positions, _ = old.model.get_rope_index(
        ids, mm_token_type_ids=types, image_grid_thw=vision.get("image_grid_thw")
    )
    cache = DynamicCache(config=old.config)
    extra = {**vision, "mm_token_type_ids": types[:, :cached]} if vision else {}
    key = cache_keyword(type(old))  # as the decode loop passes it
    old(
        input_ids=ids[:, :cached], position_ids=positions[..., :cached], **{key: cache},
        use_cache=True, **extra,
    )  # fmt: skip
    logits = new(
        input_ids=ids[:, cached:-1], position_ids=positions[..., cached:-1], **{key: cache},
        use_cache=True,
    ).logits[0]  # fmt: skip
    return gathered(logits, ids[0, cached + 1 :])


@pytest.mark.parametrize("mode", ["keep", "recompute"])
def test_rows_with_images_switch_to_a_saved_folders_weights_where_the_update_lands(folders, mode):
    old_folder, new_folder = folders
    gen = HfGeneration(
        {"model_name": str(old_folder), "max_new_tokens": BUDGET, "kv_cache_on_update": mode}
    )
    old = AutoModelForImageTextToText.from_pretrained(old_folder).eval()
    new = AutoModelForImageTextToText.from_pretrained(new_folder).eval()
    steps: list[int] = []

    def on_step(tokens: int) -> None:
        steps.append(tokens)
        if len(steps) == SPLIT:
            assert gen.update_weights(str(new_folder)) == 1

    gen.on_decode_step = on_step
    data = prompt_batch(gen.processor, gen.pad_id)
    out = gen.generate(data, greedy=True)

    for key, tensor in new.state_dict().items():
        assert torch.equal(gen.model.state_dict()[key], tensor), key
    old_tokens = SPLIT + 1 if mode == "keep" else SPLIT
    for row in range(data.size):
        n, k = int(data["input_lengths"][row]), int(out["generation_lengths"][row])
        ids, vision = out["output_ids"][row : row + 1, : n + k], row_vision(data, row)
        assert k == BUDGET
        assert out["policy_versions"][row, n : n + k].tolist() == [0] * old_tokens + [1] * (
            BUDGET - old_tokens
        )
        logprobs = out["logprobs"][row, n : n + k]
        expected_old = forced(old, ids, n, vision)[:old_tokens]
        torch.testing.assert_close(logprobs[:old_tokens], expected_old, atol=1e-4, rtol=0)
        teacher_forced_new = forced(new, ids, n, vision)[old_tokens:]
        expected_new = teacher_forced_new
        if mode == "keep":  # the new weights on the old weights' cache: tell them apart
            expected_new = continued(old, new, ids, n + SPLIT, vision)
            assert (expected_new - teacher_forced_new).abs().max() > 1e-3
        torch.testing.assert_close(logprobs[old_tokens:], expected_new, atol=1e-4, rtol=0)
