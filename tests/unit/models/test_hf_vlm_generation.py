"""HfGeneration with vision-language models: images go to the model with their prompt, and
each reported logprob is that of a teacher-forced pass with the same images."""

from __future__ import annotations

import pytest
import torch

from envloop.data.llm_message_utils import (
    batched_message_log_to_flat_message,
    get_formatted_message_log,
)
from envloop.data.multimodal_utils import PackedTensor
from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.models.generation.hf_generation import HfGeneration
from tests.fixtures.images import noise_image
from tests.fixtures.tiny_vlms import SAVERS

pytestmark = pytest.mark.slow

TEMPERATURE = 1.3


@pytest.fixture(scope="module", params=sorted(SAVERS))
def vlm_policy(request, tmp_path_factory):
    folder = SAVERS[request.param](tmp_path_factory.mktemp(request.param))
    return HfGeneration(
        {
            "model_name": str(folder),
            "max_new_tokens": 8,
            "temperature": TEMPERATURE,
            "micro_batch_size": 2,  # later rows join a running batch
            "seed": 1,
        }
    )


def prompt_batch(processor, pad_id: int) -> tuple[BatchedDataDict, list[list[dict]]]:
    contents = [
        [{"type": "image", "image": noise_image(0, 64, 96)}, {"type": "text", "text": "How?"}],
        "A prompt without images.",
        [
            {"type": "image", "image": noise_image(1, 32, 32)},
            {"type": "text", "text": "and"},
            {"type": "image", "image": noise_image(2, 96, 40)},
        ],
        [{"type": "text", "text": "Last:"}, {"type": "image", "image": noise_image(3, 48, 48)}],
    ]
    logs = [
        get_formatted_message_log(
            [{"role": "system", "content": "Look closely."}, {"role": "user", "content": c}],
            processor,
            add_generation_prompt=True,
        )
        for c in contents
    ]
    flat, lengths = batched_message_log_to_flat_message(logs, pad_value_dict={"token_ids": pad_id})
    data = BatchedDataDict(
        input_ids=flat["token_ids"],
        input_lengths=lengths,
        pixel_values=flat["pixel_values"],
        image_grid_thw=flat["image_grid_thw"],
    )
    return data, logs


def reference_logprobs(model, ids: torch.Tensor, vision: dict) -> torch.Tensor:
    """Logprobs of ids[1:] at TEMPERATURE in one full forward pass (the model's own
    positions), with the row's images."""
    if vision:
        vision = {**vision, "mm_token_type_ids": (ids == model.config.image_token_id).int()}
    with torch.no_grad():
        logits = model(input_ids=ids, **vision).logits[0].float()
    logprobs = torch.log_softmax(logits[:-1] / TEMPERATURE, dim=-1)
    return logprobs.gather(-1, ids[0, 1:, None]).squeeze(-1)


@pytest.mark.parametrize("greedy", [True, False])
def test_logprobs_equal_a_teacher_forced_pass_with_the_same_images(vlm_policy, greedy):
    data, _ = prompt_batch(vlm_policy.processor, vlm_policy.pad_id)
    out = vlm_policy.generate(data, greedy=greedy)
    assert out["generation_lengths"].tolist() == [8, 8, 8, 8] or greedy is False
    for row in range(4):
        n, k = int(data["input_lengths"][row]), int(out["generation_lengths"][row])
        ids = out["output_ids"][row, : n + k][None]
        assert torch.equal(ids[0, :n], data["input_ids"][row, :n])
        vision = {
            key: data[key][row]
            for key in ("pixel_values", "image_grid_thw")
            if data[key][row] is not None
        }
        expected = reference_logprobs(vlm_policy.model, ids, vision)[n - 1 :]
        torch.testing.assert_close(out["logprobs"][row, n : n + k], expected, atol=1e-4, rtol=0)


def test_a_row_generates_the_same_tokens_alone_and_in_a_batch(vlm_policy):
    data, _ = prompt_batch(vlm_policy.processor, vlm_policy.pad_id)
    batched = vlm_policy.generate(data, greedy=True)
    for row in range(4):
        alone = vlm_policy.generate(data.select_indices([row]), greedy=True)
        n = int(data["input_lengths"][row])
        k = int(batched["generation_lengths"][row])
        assert (
            alone["output_ids"][0, n : n + k].tolist()
            == batched["output_ids"][row, n : n + k].tolist()
        )


def test_images_need_the_placeholders_they_were_tokenized_with(vlm_policy):
    data, _ = prompt_batch(vlm_policy.processor, vlm_policy.pad_id)
    swapped = data.copy()
    grids = data["image_grid_thw"]
    swapped["image_grid_thw"] = PackedTensor([grids[3], grids[1], grids[2], grids[0]], 0)
    with pytest.raises(
        ValueError, match=r"^Row 0 holds \d+ image placeholder tokens but its images need"
    ):
        vlm_policy.generate(swapped)
    short = data.copy()
    short["pixel_values"] = data["pixel_values"].slice([0, 1, 2])
    with pytest.raises(ValueError, match="Vision column 'pixel_values' has 3 items for 4 prompts"):
        vlm_policy.generate(short)


def test_a_text_model_refuses_images_and_has_no_processor(tiny_policy_dir, vlm_policy):
    text_policy = HfGeneration({"model_name": str(tiny_policy_dir), "max_new_tokens": 2})
    assert text_policy.processor is None
    data, _ = prompt_batch(vlm_policy.processor, vlm_policy.pad_id)
    data["input_ids"] = data["input_ids"].clamp(max=len(text_policy.tokenizer) - 1)
    with pytest.raises(ValueError, match=r"vision columns \['image_grid_thw', 'pixel_values'\]"):
        text_policy.generate(data)


def test_a_vision_language_model_needs_a_processor(vlm_policy, tiny_policy_dir):
    with pytest.raises(
        ValueError, match="is a vision-language model, so HfGeneration needs its processor"
    ):
        HfGeneration(
            {"model_name": vlm_policy.config.model_name, "tokenizer_name": str(tiny_policy_dir)}
        )
