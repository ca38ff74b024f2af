"""AgentEndpoint in front of ServerGeneration (a real llama-server serving the bundled
policy): what the openai SDK gets is what ServerGeneration generates, and a session's
tokens are exactly what the server sampled."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
import torch

from envloop.agents import AgentEndpoint
from envloop.data.llm_message_utils import get_formatted_message_log
from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.models.bundled import resolve_model
from envloop.models.generation.server_generation import ServerGeneration
from tests.fixtures.llama_server import LlamaServer, converted_gguf

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def policy():
    server = LlamaServer(converted_gguf(Path(resolve_model("bundled:policy")))).start()
    backend = ServerGeneration(
        {"base_urls": [server.url], "dialect": "llamacpp", "tokenizer": "bundled:policy",
         "max_new_tokens": 32}
    )  # fmt: skip
    yield backend
    backend.shutdown()
    server.stop()


def test_a_server_backed_session_is_token_exact(policy):
    tokenizer = policy.tokenizer
    messages = [{"role": "user", "content": "What is 37 + 48?"}]
    log = get_formatted_message_log(messages, tokenizer, add_generation_prompt=True)
    prompt = torch.cat([m["token_ids"] for m in log])
    own = policy.generate(
        BatchedDataDict(input_ids=prompt[None], input_lengths=torch.tensor([len(prompt)])),
        greedy=True,
    )
    n = int(own["generation_lengths"][0])
    own_ids = own["output_ids"][0, len(prompt) : len(prompt) + n].tolist()
    with AgentEndpoint(policy, tokenizer, max_seq_len=256) as endpoint:
        session = endpoint.open_session()
        api = openai.OpenAI(base_url=session.base_url, api_key="unused", max_retries=0)
        first = api.chat.completions.create(model="m", messages=messages, temperature=0)
        messages += [first.choices[0].message.model_dump(exclude_none=True)]
        messages += [{"role": "user", "content": "Environment: incorrect"}]
        api.chat.completions.create(model="m", messages=messages, temperature=0)
    eos = tokenizer.eos_token_id
    assert first.choices[0].message.content == tokenizer.decode([t for t in own_ids if t != eos])
    [segment] = session.segments
    sampled = [m["token_ids"].tolist() for m in segment.message_log if "generation_logprobs" in m]
    assert sampled[0] == own_ids
    turn = tokenizer.encode(
        "\n<|im_start|>user\nEnvironment: incorrect<|im_end|>\n<|im_start|>assistant\n"
    )
    assert segment.token_ids == prompt.tolist() + own_ids + turn + sampled[1]
