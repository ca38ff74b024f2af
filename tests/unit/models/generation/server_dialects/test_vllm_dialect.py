"""vLLM's dialect: its request body, and how it reads answers written out here as vLLM's
``CompletionResponse`` (0.11, with ``return_token_ids``) returns them, fields we ignore
included (vLLM does not run on this machine)."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest

from envloop.models.generation.server_dialects import (
    GenerationRequest,
    MalformedReply,
    Reply,
    VllmDialect,
)
from envloop.models.generation.server_routing import ServerSlot
from tests.fixtures.dialect_requests import (
    ENDOFTEXT,
    GREEDY,
    IM_END,
    MODEL,
    REQUEST,
    SAMPLED,
    UNFILTERED,
)


def vllm_answer(
    tokens: list[int],
    logprobs: list[float],
    finish_reason: str = "stop",
    stop_reason: Any = None,
    text: str = " Paris.<|im_end|>",
) -> dict[str, Any]:
    """vLLM's answer to our body (``logprobs: 0``, ``return_tokens_as_token_ids`` and
    ``return_token_ids``): one choice, each token written ``token_id:<id>``, the text offsets
    counted in those placeholders, the sampled token its own top log-probability."""
    names = [f"token_id:{t}" for t in tokens]
    offsets = [sum(len(n) for n in names[:i]) for i in range(len(names))]
    return {
        "id": "cmpl-9c1f6e0b2d7a4e3f8b5a1c0d9e8f7a6b",
        "object": "text_completion",
        "created": 1754300142,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "text": text,
                "logprobs": {
                    "text_offset": offsets,
                    "token_logprobs": logprobs,
                    "tokens": names,
                    "top_logprobs": [{n: lp} for n, lp in zip(names, logprobs)],
                },
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
                "token_ids": tokens,
                "prompt_logprobs": None,
                "prompt_token_ids": REQUEST.prompt,
            }
        ],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": {
            "prompt_tokens": 5,
            "total_tokens": 5 + len(tokens),
            "completion_tokens": len(tokens),
            "prompt_tokens_details": None,
        },
        "kv_transfer_params": None,
    }


def old_vllm_answer(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """The same answer from a vLLM before 0.10.2, which has no ``return_token_ids``."""
    payload = vllm_answer(*args, **kwargs)
    del payload["choices"][0]["token_ids"], payload["choices"][0]["prompt_token_ids"]
    return payload


VLLM_EOS = vllm_answer([12095, 13, IM_END], [-0.0123, -0.4051, -0.0002])
VLLM_STOP_STRING = vllm_answer(
    [12095, 13, 522, 64, 29], [-0.0123, -0.4051, -1.25, -0.5, -0.003],
    stop_reason="</a>", text=" Paris.</a>",
)  # fmt: skip
VLLM_LENGTH = vllm_answer(
    [12095, 13, 576, 6722], [-0.0123, -0.4051, -2.5, -0.75], finish_reason="length",
    text=" Paris. The capital",
)  # fmt: skip


def test_vllm_eos_finish():
    reply = VllmDialect(MODEL).parse(VLLM_EOS)
    assert reply == Reply([12095, 13, IM_END], [-0.0123, -0.4051, -0.0002], "eos", 5)


def test_vllm_stop_token_finish_is_eos():
    """An extra EOS of the model's generation config ends with its id as stop_reason."""
    payload = vllm_answer([12095, 13, ENDOFTEXT], [-0.01, -0.4, -0.02], stop_reason=ENDOFTEXT)
    assert VllmDialect(MODEL).parse(payload) == Reply(
        [12095, 13, ENDOFTEXT], [-0.01, -0.4, -0.02], "eos", 5
    )


def test_vllm_stop_string_finish():
    reply = VllmDialect(MODEL).parse(VLLM_STOP_STRING)
    assert reply == Reply(
        [12095, 13, 522, 64, 29], [-0.0123, -0.4051, -1.25, -0.5, -0.003], "stop", 5
    )


def test_vllm_length_finish():
    reply = VllmDialect(MODEL).parse(VLLM_LENGTH)
    assert reply == Reply([12095, 13, 576, 6722], [-0.0123, -0.4051, -2.5, -0.75], "length", 5)


@pytest.mark.parametrize("token_ids", ["absent", None], ids=["absent", "null"])
def test_older_vllm_gives_ids_in_the_token_placeholders(token_ids):
    payload = old_vllm_answer([12095, 13, IM_END], [-0.0123, -0.4051, -0.0002])
    if token_ids is None:
        payload["choices"][0]["token_ids"] = None
    reply = VllmDialect(MODEL).parse(payload)
    assert reply == Reply([12095, 13, IM_END], [-0.0123, -0.4051, -0.0002], "eos", 5)


def test_vllm_token_ids_disagreeing_with_the_placeholders_are_malformed():
    payload = copy.deepcopy(VLLM_EOS)
    payload["choices"][0]["token_ids"] = [12095, 14, IM_END]
    with pytest.raises(MalformedReply, match="token_ids and logprobs.tokens disagree"):
        VllmDialect(MODEL).parse(payload)


def test_vllm_without_placeholders_names_return_tokens_as_token_ids():
    payload = old_vllm_answer([12095, 13, IM_END], [-0.0123, -0.4051, -0.0002])
    payload["choices"][0]["logprobs"]["tokens"] = [" Paris", ".", "<|im_end|>"]
    with pytest.raises(MalformedReply) as error:
        VllmDialect(MODEL).parse(payload)
    assert str(error.value) == (
        "logprobs.tokens holds ' Paris', not 'token_id:<id>': the server ignored "
        "return_tokens_as_token_ids (vLLM >= 0.5.0 honours it)"
    )


def test_vllm_without_logprobs_is_malformed():
    payload = copy.deepcopy(VLLM_EOS)
    payload["choices"][0]["logprobs"] = None
    with pytest.raises(MalformedReply, match="'logprobs' missing or not a dict"):
        VllmDialect(MODEL).parse(payload)


def test_vllm_fewer_logprobs_than_tokens_are_malformed():
    payload = copy.deepcopy(VLLM_EOS)
    del payload["choices"][0]["logprobs"]["token_logprobs"][-1]
    with pytest.raises(MalformedReply, match="^3 token ids but 2 log-probabilities$"):
        VllmDialect(MODEL).parse(payload)


@pytest.mark.parametrize("value", [float("nan"), None, "-0.4"], ids=["nan", "null", "string"])
def test_vllm_logprobs_that_are_not_numbers_are_malformed(value):
    payload = copy.deepcopy(VLLM_EOS)
    payload["choices"][0]["logprobs"]["token_logprobs"][1] = value
    with pytest.raises(MalformedReply, match=r"^log-probability .* is not a number$"):
        VllmDialect(MODEL).parse(payload)


@pytest.mark.parametrize("finish_reason", ["abort", None])
def test_vllm_other_finish_reasons_are_malformed(finish_reason):
    payload = vllm_answer([12095], [-0.0123], finish_reason=finish_reason)
    with pytest.raises(MalformedReply, match="expected 'stop' or 'length'"):
        VllmDialect(MODEL).parse(payload)


def test_vllm_sampled_request_body():
    assert VllmDialect(MODEL).body(REQUEST, SAMPLED) == {
        "prompt": [785, 6722, 315, 9625, 374],
        "max_tokens": 12,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 20,
        "stop": ["</a>"],
        "include_stop_str_in_output": True,
        "skip_special_tokens": False,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
        "return_token_ids": True,
        "stream": False,
        "seed": 5,
        "model": MODEL,
    }


def test_vllm_greedy_request_body_without_model_or_stops():
    request = GenerationRequest(prompt=[785, 6722], budget=3, stops=None, seed=5)
    assert VllmDialect(None).body(request, GREEDY) == {
        "prompt": [785, 6722],
        "max_tokens": 3,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": -1,
        "stop": [],
        "include_stop_str_in_output": True,
        "skip_special_tokens": False,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
        "return_token_ids": True,
        "stream": False,
        "seed": 5,
    }


def test_vllm_top_k_off_and_no_seed():
    request = GenerationRequest(prompt=[785], budget=3, stops=None, seed=None)
    body = VllmDialect(MODEL).body(request, UNFILTERED)
    assert (body["top_k"], body["top_p"], body["temperature"]) == (-1, 0.9, 0.7)
    assert "seed" not in body


def test_vllm_start_takes_the_first_listed_model_when_none_is_set():
    asked = []

    async def get_json(url: str) -> Any:
        asked.append(url)
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}, {"id": "other"}]}

    dialect = VllmDialect()
    asyncio.run(dialect.start(ServerSlot("http://a:8000"), get_json, vision=False))
    asyncio.run(dialect.start(ServerSlot("http://b:8000"), get_json, vision=False))
    assert asked == ["http://a:8000/v1/models"]  # the second server: the name is known
    assert dialect.model == MODEL and dialect.body(REQUEST, SAMPLED)["model"] == MODEL


def test_vllm_start_with_a_model_asks_nothing():
    async def get_json(url: str) -> Any:
        raise AssertionError(url)

    dialect = VllmDialect("served")
    asyncio.run(dialect.start(ServerSlot("http://a:8000"), get_json, vision=False))
    assert dialect.model == "served"


def test_vllm_start_with_an_empty_listing_says_to_set_model():
    async def get_json(url: str) -> Any:
        return {"object": "list", "data": []}

    with pytest.raises(RuntimeError, match="lists no model; set model to the served model's"):
        asyncio.run(VllmDialect().start(ServerSlot("http://a:8000"), get_json, vision=False))
