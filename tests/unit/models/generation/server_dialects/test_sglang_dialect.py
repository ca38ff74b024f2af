"""SGLang's dialect: its request body, and how it reads answers written out here as SGLang's
``/generate`` returns them, fields we ignore included (SGLang does not run on this machine)."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest

from envloop.models.generation.server_dialects import (
    GenerationRequest,
    MalformedReply,
    Reply,
    SglangDialect,
)
from envloop.models.generation.server_dialects.sglang import ROWS_PER_REQUEST
from envloop.models.generation.server_media import RequestImages
from envloop.models.generation.server_routing import ServerSlot
from tests.fixtures.dialect_requests import GREEDY, IM_END, MODEL, REQUEST, SAMPLED, UNFILTERED


def sglang_answer(
    tokens: list[int], logprobs: list[float], finish_reason: dict[str, Any],
    text: str = " Paris.<|im_end|>",
) -> dict[str, Any]:  # fmt: skip
    """SGLang's answer to our body (``return_logprob``, ``logprob_start_len: -1``,
    ``top_logprobs_num: 0``): each output token's ``[logprob, id, None]`` in meta_info."""
    return {
        "text": text,
        "output_ids": tokens,
        "meta_info": {
            "id": "a1b2c3d4e5f60718293a4b5c6d7e8f90",
            "finish_reason": finish_reason,
            "prompt_tokens": 5,
            "weight_version": "default",
            "completion_tokens": len(tokens),
            "cached_tokens": 4,
            "e2e_latency": 0.0417,
            "input_token_logprobs": [],
            "output_token_logprobs": [[lp, t, None] for t, lp in zip(tokens, logprobs)],
        },
    }


SGLANG_EOS = sglang_answer(
    [12095, 13, IM_END], [-0.0123, -0.4051, -0.0002], {"type": "stop", "matched": IM_END}
)


def test_sglang_eos_finish():
    reply = SglangDialect().parse(SGLANG_EOS)
    assert reply == Reply([12095, 13, IM_END], [-0.0123, -0.4051, -0.0002], "eos", 5)


def test_sglang_stop_string_finish():
    payload = sglang_answer(
        [12095, 13, 522, 64, 29], [-0.0123, -0.4051, -1.25, -0.5, -0.003],
        {"type": "stop", "matched": "</a>"}, text=" Paris.</a>",
    )  # fmt: skip
    reply = SglangDialect().parse(payload)
    assert reply == Reply(
        [12095, 13, 522, 64, 29], [-0.0123, -0.4051, -1.25, -0.5, -0.003], "stop", 5
    )


def test_sglang_length_finish():
    payload = sglang_answer(
        [12095, 13, 576], [-0.0123, -0.4051, -2.5], {"type": "length", "length": 3},
        text=" Paris. The",
    )  # fmt: skip
    assert SglangDialect().parse(payload) == Reply(
        [12095, 13, 576], [-0.0123, -0.4051, -2.5], "length", 5
    )


def test_sglang_abort_is_malformed():
    payload = sglang_answer(
        [12095], [-0.0123],
        {"type": "abort", "message": "Abort before prefill", "status_code": 500,
         "err_type": None},
    )  # fmt: skip
    with pytest.raises(MalformedReply, match="expected type 'stop' or 'length'"):
        SglangDialect().parse(payload)


def test_older_sglang_gives_ids_in_the_logprob_entries():
    payload = copy.deepcopy(SGLANG_EOS)
    del payload["output_ids"]
    reply = SglangDialect().parse(payload)
    assert reply == Reply([12095, 13, IM_END], [-0.0123, -0.4051, -0.0002], "eos", 5)


def test_sglang_output_ids_disagreeing_with_the_logprob_entries_are_malformed():
    payload = copy.deepcopy(SGLANG_EOS)
    payload["output_ids"] = [12095, 13]
    with pytest.raises(MalformedReply, match="output_ids and meta_info.output_token_logprobs"):
        SglangDialect().parse(payload)


def test_sglang_logprob_entries_without_ids_are_malformed():
    payload = copy.deepcopy(SGLANG_EOS)
    payload["meta_info"]["output_token_logprobs"] = [[-0.0123], [-0.4051], [-0.0002]]
    with pytest.raises(MalformedReply, match=r"expected \[logprob, id, text\]"):
        SglangDialect().parse(payload)


@pytest.mark.parametrize("value", [float("nan"), None], ids=["nan", "null"])
def test_sglang_logprobs_that_are_not_numbers_are_malformed(value):
    payload = copy.deepcopy(SGLANG_EOS)
    payload["meta_info"]["output_token_logprobs"][2][0] = value
    with pytest.raises(MalformedReply, match=r"^log-probability .* is not a number$"):
        SglangDialect().parse(payload)


def test_sglang_sampled_request_body():
    assert SglangDialect().body(REQUEST, SAMPLED) == {
        "input_ids": [785, 6722, 315, 9625, 374],
        "sampling_params": {
            "max_new_tokens": 12,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 20,
            "stop": ["</a>"],
            "no_stop_trim": True,
            "skip_special_tokens": False,
            "sampling_seed": 5,
        },
        "return_logprob": True,
        "logprob_start_len": -1,
        "top_logprobs_num": 0,
        "stream": False,
    }


def test_sglang_greedy_request_body_without_stops():
    request = GenerationRequest(prompt=[785, 6722], budget=3, stops=None, seed=5)
    assert SglangDialect(MODEL).body(request, GREEDY) == {
        "input_ids": [785, 6722],
        "sampling_params": {
            "max_new_tokens": 3,
            "min_p": 0.0,
            "repetition_penalty": 1.0,
            "presence_penalty": 0.0,
            "frequency_penalty": 0.0,
            "temperature": 0.0,
            "top_p": 1.0,
            "top_k": -1,
            "stop": [],
            "no_stop_trim": True,
            "skip_special_tokens": False,
            "sampling_seed": 5,
        },
        "return_logprob": True,
        "logprob_start_len": -1,
        "top_logprobs_num": 0,
        "stream": False,
    }


def test_sglang_top_k_off_and_no_seed():
    request = GenerationRequest(prompt=[785], budget=3, stops=None, seed=None)
    params = SglangDialect().body(request, UNFILTERED)["sampling_params"]
    assert (params["top_k"], params["top_p"], params["temperature"]) == (-1, 0.9, 0.7)
    assert "sampling_seed" not in params


def test_sglang_lists_prompts_each_with_its_own_sampling_params():
    """``GenerateReqInput`` takes ``input_ids`` and ``sampling_params`` as lists, one entry
    per prompt: each prompt keeps the seed (and budget) a request of its own would carry."""
    other = GenerationRequest(prompt=[9625, 374], budget=7, stops=["</a>"], seed=11)
    body = SglangDialect().batch_body([REQUEST, other], SAMPLED)
    alone = [SglangDialect().body(r, SAMPLED) for r in (REQUEST, other)]
    assert body == {
        **alone[0],
        "input_ids": [REQUEST.prompt, other.prompt],
        "sampling_params": [b["sampling_params"] for b in alone],
    }
    assert [p["sampling_seed"] for p in body["sampling_params"]] == [5, 11]
    assert [p["max_new_tokens"] for p in body["sampling_params"]] == [12, 7]


def test_sglang_group_lists_the_prompt_with_consecutive_seeds():
    body = SglangDialect().group_body(REQUEST, 3, SAMPLED)
    assert body["input_ids"] == [REQUEST.prompt] * 3
    assert [p.pop("sampling_seed") for p in body["sampling_params"]] == [5, 6, 7]
    single = SglangDialect().body(REQUEST, SAMPLED)["sampling_params"]
    del single["sampling_seed"]
    assert body["sampling_params"] == [single] * 3
    unseeded = GenerationRequest(REQUEST.prompt, 12, None, None)
    params = SglangDialect().group_body(unseeded, 2, SAMPLED)["sampling_params"]
    assert all("sampling_seed" not in p for p in params)


def test_sglang_answer_to_a_list_is_read_in_order():
    second = sglang_answer([13, IM_END], [-0.5, -0.01], {"type": "stop", "matched": IM_END})
    replies = SglangDialect().parse_group([SGLANG_EOS, second], 2)
    assert [r.tokens for r in replies] == [[12095, 13, IM_END], [13, IM_END]]
    with pytest.raises(MalformedReply, match="^listed 2 prompts, got one answer$"):
        SglangDialect().parse_group(SGLANG_EOS, 2)
    with pytest.raises(MalformedReply, match="^listed 3 prompts, got 2 answers$"):
        SglangDialect().parse_group([SGLANG_EOS, second], 3)


def test_sglang_lists_no_images_and_takes_up_to_its_rows_per_request():
    images = RequestImages(png=(b"\x89PNG",), spans=((1, 3),))
    pictured = GenerationRequest([785, 1, 2, 3, 374], 12, None, 5, images)
    with pytest.raises(ValueError, match="listing several prompts takes no images"):
        SglangDialect().batch_body([REQUEST, pictured], SAMPLED)
    server = ServerSlot("http://127.0.0.1:30000")
    asyncio.run(SglangDialect().start(server, _no_get, vision=False))
    assert server.parallel == ROWS_PER_REQUEST == 16


async def _no_get(url: str) -> Any:
    raise AssertionError(f"SGLang's start-up asks nothing: GET {url}")
