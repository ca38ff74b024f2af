"""AgentEndpoint in front of a tiny vision-language policy: images sent as data URLs through
the openai SDK are recorded with their vision inputs, and greedy responses equal envloop's
own generation."""

from __future__ import annotations

import base64
import io

import openai
import pytest
import torch

from envloop.agents import AgentEndpoint
from envloop.data.llm_message_utils import get_formatted_message_log
from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.experience.sample_vision import SampleVision
from envloop.models.generation.hf_generation import HfGeneration
from envloop.models.tiny_vlm import save_tiny_vlm
from tests.fixtures.images import image_part, noise_image, text_part


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    folder = save_tiny_vlm(tmp_path_factory.mktemp("tiny_vlm"))
    return HfGeneration({"model_name": str(folder), "max_new_tokens": 6})


def data_url(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def own_greedy(policy, messages):
    """envloop's own greedy generation for ``messages``: prompt ids and sampled ids."""
    log = get_formatted_message_log(messages, policy.processor, add_generation_prompt=True)
    vision = SampleVision(1)
    vision.reset(0, log)
    prompt = torch.cat([m["token_ids"] for m in log])
    out = policy.generate(
        BatchedDataDict(
            input_ids=prompt[None], input_lengths=torch.tensor([len(prompt)]),
            **vision.columns([0]),
        ),
        greedy=True,
    )  # fmt: skip
    n = int(out["generation_lengths"][0])
    return prompt.tolist(), out["output_ids"][0, len(prompt) : len(prompt) + n].tolist()


def test_images_are_recorded_with_their_vision_inputs_token_for_token(policy):
    first, second = noise_image(0, 60, 90), noise_image(1, 28, 56)
    messages = [
        {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(first)}},
            {"type": "text", "text": "Look."}]},
    ]  # fmt: skip
    with AgentEndpoint(policy, policy.processor) as endpoint:
        session = endpoint.open_session()
        api = openai.OpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
        reply = api.chat.completions.create(model="m", messages=messages, temperature=0)
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "user", "content": [
            {"type": "text", "text": "And this?"},
            {"type": "image_url", "image_url": {"url": data_url(second)}}]})  # fmt: skip
        api.chat.completions.create(model="m", messages=messages, temperature=0)
    own_messages = [{"role": "user", "content": [image_part(first), text_part("Look.")]}]
    prompt, sampled = own_greedy(policy, own_messages)
    text = policy.processor.tokenizer
    eos = text.eos_token_id
    assert reply.choices[0].message.content == text.decode([t for t in sampled if t != eos])
    [segment] = session.segments
    log = segment.message_log
    assert torch.cat([m["token_ids"] for m in log[:1]]).tolist() == prompt
    assert log[1]["token_ids"].tolist() == sampled
    assert [m["role"] for m in log] == ["user", "assistant", "user", "assistant"]
    assert segment.token_ids[: len(prompt) + len(sampled)] == prompt + sampled
    vision = SampleVision(1)
    vision.reset(0, log)
    [grids] = vision.columns([0])["image_grid_thw"].tensors
    assert grids.shape[0] == 2  # both images' inputs are kept
    assert [image.size for image in vision.images[0]] == [(90, 60), (56, 28)]
