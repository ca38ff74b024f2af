"""``envloop run`` with an image dataset, before Ray: the policy must take images, every bad
image is named, and prompts are tokenized (and their lengths checked) by the processor."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from envloop.config.errors import ConfigError
from envloop.data.message_tokens import message_token_ids
from envloop.data.multimodal_utils import is_processor
from envloop.models.generation.hf_generation import HfGeneration
from envloop.models.tiny_vlm import save_tiny_vlm
from envloop.run.config import RunConfig
from envloop.run.preflight import prepare_inputs
from envloop.run.runner import engine_tokenizer, make_policy

IMAGES = "data.columns.images: column 'image' holds images"
FIX = "or set data.columns.images: null for text-only prompts"


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory):
    return save_tiny_vlm(tmp_path_factory.mktemp("tiny_vlm") / "vlm")


@pytest.fixture
def image_data(tmp_path):
    """Three rows: one image (28x28: 1 token), two images (28x28 and 56x56: 1 + 4 tokens),
    none."""
    (tmp_path / "imgs").mkdir()
    Image.new("RGB", (28, 28), (255, 0, 0)).save(tmp_path / "imgs" / "small.png")
    Image.new("RGB", (56, 56), (0, 0, 255)).save(tmp_path / "imgs" / "large.png")
    rows = [
        {"prompt": "How many?", "image": "imgs/small.png", "ground_truth": "1"},
        {"prompt": "Which is larger?", "image": ["imgs/small.png", "imgs/large.png"],
         "ground_truth": "blue"},
        {"prompt": "No picture.", "image": [], "ground_truth": "0"},
    ]  # fmt: skip
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def run_config(data_path, policy, **rollout) -> RunConfig:
    return RunConfig.from_mapping({
        "policy": policy,
        "data": {"path": str(data_path), "columns": {"task": None, "images": "image"}},
        "envs": {"count": {"name": "vlm"}},
        "rollout": {"generations_per_prompt": 2, **rollout},
    })  # fmt: skip


def flat(token_ids: list[list[int]]) -> list[int]:
    """A prompt's token ids, its messages' lists joined."""
    return [t for ids in token_ids for t in ids]


def problems_of(config: RunConfig) -> list[str]:
    with pytest.raises(ConfigError) as info:
        prepare_inputs(config)
    return info.value.problems


def test_image_prompts_are_tokenized_by_the_policy_processor(vlm_dir, image_data):
    config = run_config(image_data, {"model_name": str(vlm_dir)})
    inputs = prepare_inputs(config)
    processor = inputs.tokenizer
    assert is_processor(processor)
    assert [s.idx for s in inputs.samples] == [0, 1, 2]
    for sample, ids in zip(inputs.samples, inputs.token_ids):
        expected = processor.apply_chat_template(
            [sample.messages], tokenize=True, add_generation_prompt=True, return_dict=True
        )
        assert flat(ids) == expected["input_ids"][0]
    image_tokens = [flat(ids).count(processor.image_token_id) for ids in inputs.token_ids]
    assert image_tokens == [1, 1 + 4, 0]
    batch = inputs.rollout_batch(config)
    assert batch["idx"] == [0, 0, 1, 1, 2, 2]
    grids = [m["image_grid_thw"].as_tensor().tolist() for m in batch["message_log"][2]]
    assert grids == [[[1, 2, 2], [1, 4, 4]]]
    assert (
        batch["message_log"][3][0]["pixel_values"][0]
        is (batch["message_log"][2][0]["pixel_values"][0])
    )  # the two generations of a prompt share its image data
    policy = make_policy(config.policy)
    try:
        assert type(engine_tokenizer(policy)) is type(processor)
        assert engine_tokenizer(policy) is policy.processor
    finally:
        policy.shutdown()


def test_the_length_check_counts_each_image_token(vlm_dir, image_data):
    inputs = prepare_inputs(run_config(image_data, {"model_name": str(vlm_dir)}))
    lengths = [len(flat(ids)) for ids in inputs.token_ids]
    processor = inputs.tokenizer
    text_lengths = [  # the template's one placeholder per image, not expanded
        len(flat(message_token_ids(s.messages, processor, add_generation_prompt=True)[1]))
        for s in inputs.samples
    ]
    assert [n - t for n, t in zip(lengths, text_lengths)] == [0, 3, 0]  # 5 tokens for 2 images
    longest = lengths[1]
    config = run_config(image_data, {"model_name": str(vlm_dir)}, max_seq_len=longest - 1)
    assert problems_of(config) == [
        f"rollout.max_seq_len: {longest - 1} is smaller than 1 prompt (row 1: {longest} tokens); "
        f"set rollout.max_seq_len to at least {longest} plus room for the responses, or "
        "shorten those prompts"
    ]


def test_a_text_only_policy_is_named_with_the_image_column(tiny_policy_dir, vlm_dir, image_data):
    config = run_config(image_data, {"model_name": str(tiny_policy_dir)})
    assert problems_of(config) == [
        f"{IMAGES}, but policy.model_name '{tiny_policy_dir}' is not a vision-language model "
        f"(its config has no vision part); name one (e.g. Qwen/Qwen2.5-VL-3B-Instruct), {FIX}"
    ]
    policy = {"model_name": str(vlm_dir), "tokenizer_name": str(tiny_policy_dir)}
    [problem] = problems_of(run_config(image_data, policy))
    assert problem.startswith(
        f"{IMAGES}, but policy.tokenizer_name '{tiny_policy_dir}' has no image processor ("
    )
    assert problem.endswith(
        "); point it at the vision-language model's folder or hub id (preprocessor_config.json "
        f"and the tokenizer), {FIX}"
    )
    server = {"backend": "server", "base_urls": ["http://127.0.0.1:1"], "tokenizer": "t"}
    assert problems_of(run_config(image_data, server)) == [
        f"{IMAGES}, but policy.dialect 'vllm' cannot send them: vLLM's /v1/completions takes "
        "no images with a token-id prompt (its /inference/v1/generate needs features rendered "
        "by /v1/chat/completions/render, which envloop does not do yet); serve the model with "
        f"llama.cpp (--mmproj) or SGLang; {FIX}"
    ]
    llamacpp = {**server, "dialect": "llamacpp", "tokenizer": str(tiny_policy_dir)}
    [problem] = problems_of(run_config(image_data, llamacpp))
    assert problem.startswith(
        f"{IMAGES}, but policy.tokenizer '{tiny_policy_dir}' is not a vision-language model"
    )


def test_bad_images_are_all_named_before_anything_loads_the_model(vlm_dir, image_data):
    image_data.write_text(
        json.dumps({"prompt": "a", "image": "imgs/small.png", "ground_truth": "1"}) + "\n"
        + json.dumps({"prompt": "b", "image": "imgs/gone.png", "ground_truth": "1"}) + "\n"
        + json.dumps({"prompt": "c", "image": 7, "ground_truth": "1"}) + "\n"
    )  # fmt: skip
    folder = image_data.parent
    assert problems_of(run_config(image_data, {"model_name": str(vlm_dir)})) == [
        "row 1 (line 2 of d.jsonl): image 'imgs/gone.png' (column 'image', "
        f"data.columns.images): image file '{folder}/imgs/gone.png' does not exist; give an "
        "existing local path (relative paths in a dataset are relative to its data file).",
        "row 2 (line 3 of d.jsonl): image 7 (column 'image', data.columns.images): an image "
        'must be a PIL image, a local file path, encoded bytes or a {"bytes": ..., "path": ...} '
        "dict, got int.",
    ]


def test_a_policy_without_a_processor_cannot_run_an_image_dataset(tiny_policy_dir, image_data):
    from envloop.run.runner import _check_takes_images

    config = run_config(image_data, {"model_name": str(tiny_policy_dir)})
    policy = HfGeneration(config.policy)
    try:
        assert engine_tokenizer(policy) is policy.tokenizer and policy.processor is None
        with pytest.raises(ConfigError) as info:
            _check_takes_images(config, policy)
    finally:
        policy.shutdown()
    assert info.value.problems == [
        f"{IMAGES}, but the policy (policy.backend: hf) loaded without an image processor; "
        "name a vision-language model, or set data.columns.images: null"
    ]
