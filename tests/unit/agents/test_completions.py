from __future__ import annotations

import json

import torch

from envloop.agents.chat_requests import ChatRequest
from envloop.agents.completions import completion_body, reply_of, stream_events
from envloop.agents.sampling import Sampled
from envloop.agents.tool_calls import HermesToolCallParser


def sampled(texts, eos=True, hit_budget=False):
    n = len(texts)
    return Sampled(
        message={"generation_logprobs": -torch.arange(1, n + 1, dtype=torch.float32) / 4},
        text="".join(texts[:-1] if eos else texts),
        token_texts=list(texts),
        ended_with_eos=eos,
        hit_budget=hit_budget,
        error=None,
    )


def events(completion, request):
    out = list(stream_events(completion, request, "m"))
    assert out[-1] == "data: [DONE]\n\n"
    return [json.loads(e.removeprefix("data: ")) for e in out[:-1]]


def test_a_stop_string_is_cut_from_the_content_and_streamed_token_by_token():
    request = ChatRequest(messages=[], stop=["</call>"], logprobs=True, include_usage=True)
    completion = reply_of(request, sampled(["<call>", "1", "</call>"], eos=False), None, 9)
    assert (completion.content, completion.finish_reason) == ("<call>1", "stop")
    body = completion_body(completion, request, "m")
    assert body["usage"] == {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}
    assert [t["logprob"] for t in body["choices"][0]["logprobs"]["content"]] == [-0.25, -0.5, -0.75]
    chunks = events(completion, request)
    deltas = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]]
    assert deltas == ["", "<call>", "1", "", None]
    assert chunks[-1]["usage"]["total_tokens"] == 12


def test_eos_and_budget_decide_the_finish_reason():
    request = ChatRequest(messages=[])
    assert reply_of(request, sampled(["a", "<eos>"]), None, 1).finish_reason == "stop"
    cut = reply_of(request, sampled(["a", "b"], eos=False, hit_budget=True), None, 1)
    assert (cut.finish_reason, cut.completion_tokens, len(cut.token_texts)) == ("length", 2, 2)
    with_eos = reply_of(request, sampled(["a", "<eos>"]), None, 1)
    assert (with_eos.completion_tokens, with_eos.token_texts) == (2, ["a"])


def test_tool_calls_come_in_one_chunk_and_only_when_asked_for():
    text = ['<tool_call>{"name": "f", "arguments": {}}</tool_call>', "<eos>"]
    parser = HermesToolCallParser()
    asked = reply_of(ChatRequest(messages=[], parse_tool_calls=True), sampled(text), parser, 1)
    assert (asked.content, asked.finish_reason, asked.tool_calls[0].name) == (
        None,
        "tool_calls",
        "f",
    )
    chunks = events(asked, ChatRequest(messages=[]))
    calls = [c["choices"][0]["delta"]["tool_calls"] for c in chunks if "tool_calls" in
             c["choices"][0]["delta"]]  # fmt: skip
    assert calls == [[{"index": 0, **asked.tool_calls[0].as_openai()}]]
    plain = reply_of(ChatRequest(messages=[]), sampled(text), parser, 1)
    assert (plain.content, plain.tool_calls) == (text[0], [])
