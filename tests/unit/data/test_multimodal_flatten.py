"""Flattening tokenized message logs that hold images (tiny Qwen2.5-VL processor, real PIL
images): each sample's vision inputs become one PackedTensor item, aligned with its sample,
equal to what the processor gives for the whole conversations."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from envloop.data.llm_message_utils import (
    batched_message_log_to_flat_message,
    get_formatted_message_log,
    message_log_to_flat_messages,
)
from envloop.data.multimodal_utils import PackedTensor
from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.models.tiny_vlm import build_tiny_vlm_processor
from tests.fixtures.images import image_part as _image_part
from tests.fixtures.images import noise_image
from tests.fixtures.images import text_part as _text

VISION_KEYS = ("pixel_values", "image_grid_thw")


@pytest.fixture(scope="module")
def processor():
    return build_tiny_vlm_processor()


def _image(seed: int, width: int = 40, height: int = 30) -> Image.Image:
    return noise_image(seed, height, width)


def _conversation(images: list[list[Image.Image]], tag: str) -> list[dict]:
    """User turns holding ``images[k]`` each, with assistant text replies between them."""
    log: list[dict] = [{"role": "system", "content": f"Sample {tag}."}]
    for k, turn_images in enumerate(images):
        parts = [_image_part(im) for im in turn_images] + [_text(f"turn {k} of {tag}?")]
        log.append({"role": "user", "content": parts})
        log.append({"role": "assistant", "content": f"reply {k}"})
    return log


def _images(log: list[dict]) -> list[Image.Image]:
    parts = [p for m in log if isinstance(m["content"], list) for p in m["content"]]
    return [p["image"] for p in parts if p["type"] == "image"]


def _expected(processor, logs: list[list[dict]]) -> dict:
    """The processor on the whole templated conversations (all their images, in order)."""
    texts = [processor.apply_chat_template(log, tokenize=False) for log in logs]
    images = [image for log in logs for image in _images(log)]
    return processor(text=texts, images=images or None, return_tensors="pt", padding=True)


def test_a_log_flattens_to_one_item_of_its_images_in_message_order(processor):
    images = [[_image(1), _image(2, 60, 20)], [], [_image(3, 14, 90)]]
    log = get_formatted_message_log(_conversation(images, "a"), processor)
    flat = message_log_to_flat_messages(log)
    expected = _expected(processor, [_conversation(images, "a")])
    assert flat["token_ids"].tolist() == expected["input_ids"][0].tolist()
    for key in VISION_KEYS:
        assert isinstance(flat[key], PackedTensor) and len(flat[key]) == 1
        assert torch.equal(flat[key][0], expected[key])
        per_message = [m[key][0] for m in log if key in m]
        assert len(per_message) == 2  # the two user turns with images
        assert torch.equal(flat[key][0], torch.cat(per_message))
    assert flat["role"] == [m["role"] for m in log]
    assert flat["content"][1][0]["image"] is images[0][0]


def test_a_log_with_one_image_message_keeps_its_tensor(processor):
    log = get_formatted_message_log(_conversation([[_image(4)]], "b"), processor)
    flat = message_log_to_flat_messages(log)
    assert flat["pixel_values"][0] is log[1]["pixel_values"][0]


def test_a_text_only_log_has_no_vision_keys(processor):
    log = get_formatted_message_log(_conversation([[], []], "c"), processor)
    flat = message_log_to_flat_messages(log)
    assert not set(VISION_KEYS) & set(flat)


def test_the_batch_has_one_image_item_per_sample_equal_to_the_processor(processor):
    images = [[[_image(5), _image(6, 28, 28)]], [[]], [[_image(7, 50, 50)], [_image(8)]]]
    conversations = [_conversation(im, str(i)) for i, im in enumerate(images)]
    logs = [get_formatted_message_log(c, processor) for c in conversations]
    flat, lengths = batched_message_log_to_flat_message(
        logs, {"token_ids": processor.tokenizer.pad_token_id}, make_sequence_length_divisible_by=8
    )
    expected = _expected(processor, conversations)
    masks = expected["attention_mask"].bool()
    rows = [ids[mask].tolist() for ids, mask in zip(expected["input_ids"], masks)]
    assert lengths.tolist() == [len(r) for r in rows]
    assert flat["token_ids"].shape == (3, -(-max(map(len, rows)) // 8) * 8)
    assert [flat["token_ids"][i, :n].tolist() for i, n in enumerate(lengths)] == rows
    for key in VISION_KEYS:
        packed = flat[key]
        assert isinstance(packed, PackedTensor) and len(packed) == 3
        assert packed[1] is None
        assert torch.equal(packed.as_tensor(), expected[key])
        for i in (0, 2):
            assert torch.equal(packed[i], _expected(processor, [conversations[i]])[key])


def test_vision_keys_never_widen_the_padded_tokens(processor):
    # 64 patches of 1176 values: far more rows than tokens, yet L is the longest token row.
    logs = [get_formatted_message_log(_conversation([[_image(9, 112, 112)]], "d"), processor)]
    logs.append(get_formatted_message_log(_conversation([], "e"), processor))
    flat, lengths = batched_message_log_to_flat_message(logs)
    assert flat["pixel_values"][0].shape[0] == 64
    assert (
        flat["token_ids"].shape[1]
        == max(lengths.tolist())
        == len(torch.cat([m["token_ids"] for m in logs[0]]))
    )


def test_a_flat_batch_keeps_images_aligned_through_batch_operations(processor):
    counts = [0, 1, 2, 0]
    conversations = [
        _conversation([[_image(10 * i + j) for j in range(n)]], str(i))
        for i, n in enumerate(counts)
    ]
    logs = [get_formatted_message_log(c, processor) for c in conversations]
    flat, _ = batched_message_log_to_flat_message(logs)
    flat["sample"] = list(range(4))
    per_sample = [flat["pixel_values"][i] for i in range(4)]
    picked = flat.select_indices([2, 3, 1])
    vision = {key: picked.pop(key) for key in VISION_KEYS}  # a batch refuses to repeat these
    repeated = picked.repeat_interleave(2, share_immutable_media=True)
    repeated.update({key: value.repeat_interleave(2) for key, value in vision.items()})
    joined = BatchedDataDict.from_batches([repeated, flat.slice(0, 2)])
    assert joined["sample"] == [2, 2, 3, 3, 1, 1, 0, 1]
    for row, sample in enumerate(joined["sample"]):
        assert joined["pixel_values"][row] is per_sample[sample]
        content = joined["content"][row]  # per message; repeats are deep copies
        assert content[0] == f"Sample {sample}."
        assert len(_images([{"content": c} for c in content])) == counts[sample]
        originals = _images(conversations[sample])
        assert all(a is b for a, b in zip(_images([{"content": c} for c in content]), originals))
    assert joined["content"][0] is not joined["content"][1]


@settings(max_examples=15, deadline=None)
@given(
    image_counts=st.lists(
        st.lists(st.integers(0, 2), min_size=1, max_size=2), min_size=1, max_size=4
    ),
    sizes=st.lists(st.tuples(st.integers(8, 80), st.integers(8, 80)), min_size=16, max_size=16),
    seed=st.integers(0, 2**16),
)
def test_each_samples_image_data_is_its_own(processor, image_counts, sizes, seed):
    shapes, seeds = iter(sizes), itertools.count(seed)
    images = [
        [[_image(next(seeds), *next(shapes)) for _ in range(n)] for n in turns]
        for turns in image_counts
    ]
    conversations = [_conversation(im, str(i)) for i, im in enumerate(images)]
    logs = [get_formatted_message_log(c, processor) for c in conversations]
    flat, lengths = batched_message_log_to_flat_message(logs)
    has_images = [sum(map(len, im)) > 0 for im in images]
    if not any(has_images):
        assert not set(VISION_KEYS) & set(flat)
        return
    for key in VISION_KEYS:
        assert len(flat[key]) == len(logs)
        for i, conversation in enumerate(conversations):
            if not has_images[i]:
                assert flat[key][i] is None
                continue
            assert torch.equal(flat[key][i], _expected(processor, [conversation])[key])
        assert torch.equal(flat[key].as_tensor(), _expected(processor, conversations)[key])
    assert lengths.tolist() == [sum(len(m["token_ids"]) for m in log) for log in logs]


# --- deduplicated media (repeat_interleave(..., share_immutable_media=True)) ---------------


def _grpo_logs(processor, share: bool) -> list[list[dict]]:
    """2 image prompts x 3 generations; generation 1 of each adds a second user turn with
    an image of its own (taken from a separately formatted conversation)."""
    prompts = [get_formatted_message_log(_conversation([[_image(40 + p)]], str(p)), processor)
               for p in range(2)]  # fmt: skip
    batch = BatchedDataDict({"message_log": prompts})
    logs = batch.repeat_interleave(3, share_immutable_media=share)["message_log"]
    for p in range(2):
        turns = get_formatted_message_log(
            _conversation([[_image(40 + p)], [_image(50 + p, 28, 56)]], f"{p}b"), processor
        )
        logs[3 * p + 1].extend(turns[2:])  # the reply and the turn with the new image
    return logs


def test_plain_repeats_store_each_generations_copy_of_the_prompt_image(processor):
    logs = _grpo_logs(processor, share=False)  # repeats copy the tensors, as published
    flat, _ = batched_message_log_to_flat_message(logs)
    for key in VISION_KEYS:
        packed = flat[key]
        assert len(packed) == 6 and len(packed.tensors) == 6 + 2
        assert packed.logical_segment_counts_by_row() == [1, 2, 1, 1, 2, 1]
        copied = [torch.cat([m[key][0] for m in log if key in m]) for log in logs]
        assert torch.equal(packed.as_tensor(), torch.cat(copied))


def test_a_prompt_image_is_stored_once_for_all_its_generations_and_turns(processor):
    logs = _grpo_logs(processor, share=True)
    flat, _ = batched_message_log_to_flat_message(logs)
    for key in VISION_KEYS:
        packed = flat[key]
        assert packed.deduplication_enabled and len(packed) == 6
        assert len(packed.tensors) == 2 + 2  # two prompt images, two second-turn images
        assert packed.logical_segment_counts_by_row() == [1, 2, 1, 1, 2, 1]
        copied = [torch.cat([m[key][0] for m in log if key in m]) for log in logs]
        for row in range(6):  # each row reads as its own images concatenated
            assert torch.equal(packed[row], copied[row])
        assert torch.equal(packed.as_tensor(), torch.cat(copied))
    inputs = flat.get_multimodal_dict(as_tensors=True)
    assert torch.equal(
        inputs["image_grid_thw"],
        torch.cat([m["image_grid_thw"][0] for log in logs for m in log if "image_grid_thw" in m]),
    )
    for shard in flat.shard_by_batch_size(2):  # prompt 0 / prompt 1
        assert len(shard["pixel_values"].tensors) == 2


def test_flattening_can_treat_every_value_as_deduplicated(processor):
    logs = _grpo_logs(processor, share=False)  # repeats copy the tensors, no provenance
    plain, _ = batched_message_log_to_flat_message(logs)
    shared, _ = batched_message_log_to_flat_message(logs, deduplicate_multimodal_data=True)
    for key in VISION_KEYS:
        assert shared[key].deduplication_enabled and len(shared[key].tensors) == 6 + 2
        assert shared[key].logical_segment_counts_by_row() == [1, 2, 1, 1, 2, 1]
        assert torch.equal(shared[key].as_tensor(), plain[key].as_tensor())
    assert not any(
        m[k].deduplication_enabled for log in logs for m in log for k in VISION_KEYS if k in m
    )
    deduplicated = BatchedDataDict({"message_log": logs[:1]}).repeat_interleave(
        1, share_immutable_media=True
    )["message_log"]
    two_turns = get_formatted_message_log(
        _conversation([[_image(70)], [_image(71)]], "x"), processor
    )
    mixed, _ = batched_message_log_to_flat_message(
        [*deduplicated, two_turns], deduplicate_multimodal_data=True
    )
    assert mixed["pixel_values"].logical_segment_counts_by_row() == [1, 2]


def test_deduplicated_and_multi_row_plain_media_in_one_batch_are_refused(processor):
    prompt = get_formatted_message_log(_conversation([[_image(60)]], "a"), processor)
    shared = BatchedDataDict({"message_log": [prompt]}).repeat_interleave(
        1, share_immutable_media=True
    )["message_log"][0]
    two_turns = get_formatted_message_log(
        _conversation([[_image(61)], [_image(62)]], "b"), processor
    )
    with pytest.raises(AssertionError) as raised:
        batched_message_log_to_flat_message([shared, two_turns])
    assert isinstance(raised.value, ValueError)
    assert str(raised.value) == (
        "flattened_concat requires one logical row per input: 'pixel_values' is deduplicated "
        "in samples [0], but sample 1 holds it as 2 plain rows (one per message or image), "
        "which deduplicated rows cannot be aligned with. Enable deduplication on every "
        "message's 'pixel_values' (PackedTensor.enable_deduplication(), or "
        "BatchedDataDict.repeat_interleave(..., share_immutable_media=True)) so each "
        "conversation's media is one row."
    )
    one_turn = get_formatted_message_log(_conversation([[_image(63)]], "c"), processor)
    flat, _ = batched_message_log_to_flat_message([shared, one_turn])  # one plain row: fine
    assert flat["pixel_values"].logical_segment_counts_by_row() == [1, 1]


# --- errors --------------------------------------------------------------------------------


def _ids(n: int) -> torch.Tensor:
    return torch.arange(n)


def _one(item: torch.Tensor, dim: int = 0) -> PackedTensor:
    return PackedTensor([item], dim_to_pack=dim)


def test_a_packed_key_stored_otherwise_in_another_message_names_the_key():
    log = [
        {"role": "user", "token_ids": _ids(2), "pixel_values": _one(torch.ones(2, 3))},
        {"role": "user", "token_ids": _ids(1), "pixel_values": torch.ones(1, 3)},
    ]
    with pytest.raises(TypeError) as raised:
        message_log_to_flat_messages(log)
    assert str(raised.value) == (
        "Packed multimodal key 'pixel_values' also contains non-packed values: ['Tensor'] "
        "(message 1 of the log; other messages hold PackedTensors). Store 'pixel_values' (a "
        "vision input) as a PackedTensor in every message that has it, as "
        "get_formatted_message_log does."
    )


def test_a_packed_key_stored_otherwise_in_another_sample_names_the_key():
    logs = [
        [{"role": "user", "token_ids": _ids(2), "pixel_values": _one(torch.ones(2, 3))}],
        [{"role": "user", "token_ids": _ids(1)}],
        [{"role": "user", "token_ids": _ids(1), "pixel_values": "not packed"}],
    ]
    with pytest.raises(TypeError) as raised:
        batched_message_log_to_flat_message(logs)
    assert str(raised.value) == (
        "Packed multimodal key 'pixel_values' also contains non-packed values: ['list'] "
        "(samples [2]; other samples hold PackedTensors). Store 'pixel_values' as a "
        "PackedTensor in every message that has it."
    )


@pytest.mark.parametrize("across", ["messages", "samples"])
def test_packed_items_of_different_widths_raise_naming_the_key(across):
    a = {"role": "user", "token_ids": _ids(1), "pixel_values": _one(torch.ones(2, 3))}
    b = {"role": "user", "token_ids": _ids(1), "pixel_values": _one(torch.ones(2, 4))}
    logs = [[a, b]] if across == "messages" else [[a], [b]]
    message = "tensors for key='pixel_values' must have the same shape after dim 0"
    with pytest.raises(RuntimeError, match=message):
        batched_message_log_to_flat_message(logs)


def test_packed_items_along_different_dims_raise_naming_the_key():
    a = {"role": "user", "pixel_values": _one(torch.ones(2, 3))}
    b = {"role": "user", "pixel_values": _one(torch.ones(2, 3), dim=1)}
    with pytest.raises(ValueError, match=r"for key 'pixel_values' are packed along different"):
        message_log_to_flat_messages([a, b])
    with pytest.raises(ValueError, match=r"for key 'pixel_values' are packed along different"):
        batched_message_log_to_flat_message([[a], [b]])


def test_a_batch_without_token_tensors_still_packs_its_vision_inputs():
    pixels = torch.ones(2, 3)
    logs = [[{"role": "user", "pixel_values": _one(pixels)}], [{"role": "user"}]]
    flat, lengths = batched_message_log_to_flat_message(logs)
    assert lengths.tolist() == []
    assert flat["role"] == ["user", "user"]
    assert flat["pixel_values"][0] is pixels and flat["pixel_values"][1] is None
