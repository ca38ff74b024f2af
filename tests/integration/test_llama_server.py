"""The real llama-server (built by scripts/build_llama_server.sh) serving the bundled policy
converted to GGUF at full precision: prompts go in as token ids and the tokens that come
back are those HfGeneration generates from the same weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.models.bundled import resolve_model
from envloop.models.generation.hf_generation import HfGeneration
from tests.fixtures.llama_server import LlamaServer, converted_gguf

pytestmark = pytest.mark.server
DEMO_DATA = Path(__file__).resolve().parents[2] / "examples" / "demo_data.jsonl"
MAX_NEW_TOKENS = 48


@pytest.fixture(scope="module")
def server():
    running = LlamaServer(converted_gguf(Path(resolve_model("bundled:policy")))).start()
    yield running
    running.stop()


@pytest.fixture(scope="module")
def policy() -> HfGeneration:
    return HfGeneration({"model_name": "bundled:policy", "max_new_tokens": MAX_NEW_TOKENS})


def demo_prompts(tokenizer, count: int) -> list[list[int]]:
    """The first ``count`` math prompts of the demo, rendered by the chat template."""
    rows = [json.loads(line) for line in DEMO_DATA.read_text().splitlines()]
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": row["prompt"]}], add_generation_prompt=True, tokenize=False
        )
        for row in rows
        if row["task"] == "math"
    ][:count]
    return [tokenizer(text, add_special_tokens=False).input_ids for text in texts]


def hf_greedy(policy: HfGeneration, prompt: list[int], budget: int) -> tuple[list[int], bool]:
    batch = BatchedDataDict(
        input_ids=torch.tensor([prompt]), input_lengths=torch.tensor([len(prompt)]),
        max_new_tokens=torch.tensor([budget]),
    )  # fmt: skip
    out = policy.generate(batch, greedy=True)
    end = len(prompt) + int(out["generation_lengths"][0])
    return out["output_ids"][0, len(prompt) : end].tolist(), bool(out["truncated"][0])


def server_greedy(server: LlamaServer, prompt: list[int], budget: int) -> dict:
    return server.post(
        "/completion",
        {"prompt": prompt, "n_predict": budget, "temperature": 0, "return_tokens": True,
         "cache_prompt": False},
    )  # fmt: skip


def test_greedy_tokens_from_token_id_prompts_equal_hf_generation(server, policy):
    prompts = demo_prompts(policy.tokenizer, 8)
    assert len(prompts) == 8
    for prompt in prompts:
        expected, truncated = hf_greedy(policy, prompt, MAX_NEW_TOKENS)
        response = server_greedy(server, prompt, MAX_NEW_TOKENS)
        assert response["tokens"] == expected  # the EOS that ends a reply included
        assert response["stop_type"] == ("limit" if truncated else "eos")


def test_a_budget_ends_the_reply_at_that_many_tokens(server, policy):
    prompt = demo_prompts(policy.tokenizer, 1)[0]
    expected, truncated = hf_greedy(policy, prompt, 5)
    response = server_greedy(server, prompt, 5)
    assert truncated and response["tokens"] == expected and len(expected) == 5
    assert response["stop_type"] == "limit"
