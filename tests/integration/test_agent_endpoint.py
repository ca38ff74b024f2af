"""AgentEndpoint over real HTTP on 127.0.0.1, with the official openai SDK as the client and
real tokenizers and tiny models behind it."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

import openai
import pytest
import torch

from envloop.agents import AgentEndpoint
from envloop.data.llm_message_utils import get_formatted_message_log
from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.models.generation.hf_generation import HfGeneration
from envloop.models.generation.interfaces import GenerationInterface
from envloop.models.generation.scripted_generation import ScriptedGeneration


class TokenScript(GenerationInterface):
    """Answers the k-th call with ``scripts[k]`` (token ids, as sampled) and logprob
    ``-(k + 1) / 10`` for every token; records each call's prompt ids."""

    def __init__(self, tokenizer: Any, scripts: list[list[int]]) -> None:
        self.tokenizer, self.scripts = tokenizer, scripts
        self.prompts: list[list[int]] = []

    def generate(self, data, greedy=False):
        ids = data["input_ids"][0, : data["input_lengths"][0]].tolist()
        k = len(self.prompts)
        self.prompts.append(ids)
        generated = self.scripts[k]
        output = torch.tensor([ids + generated])
        logprobs = torch.zeros(output.shape)
        logprobs[0, len(ids) :] = -(k + 1) / 10
        return BatchedDataDict(
            output_ids=output,
            logprobs=logprobs,
            generation_lengths=torch.tensor([len(generated)]),
            unpadded_sequence_lengths=torch.tensor([output.shape[1]]),
        )


def spelled(tokenizer, text: str) -> list[int]:
    """``text`` as one token per character: what a model may sample, though the tokenizer
    itself would merge the characters."""
    return [tokenizer.encode(ch, add_special_tokens=False)[0] for ch in text]


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)


def http_error(url: str, data: bytes | None = None) -> tuple[int, Any]:
    """The status and JSON body of a request the endpoint refuses (plain HTTP)."""
    try:
        urllib.request.urlopen(urllib.request.Request(url, data=data))
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())
    raise AssertionError(f"{url} answered without an error")


def prompt_ids(tokenizer, messages) -> list[int]:
    log = get_formatted_message_log(messages, tokenizer, add_generation_prompt=True)
    return torch.cat([m["token_ids"] for m in log]).tolist()


@pytest.fixture(scope="module")
def hf_policy(untied_policy_dir):
    return HfGeneration({"model_name": str(untied_policy_dir), "max_new_tokens": 12})


def test_greedy_completions_equal_envloop_generation_streamed_or_not(hf_policy):
    tokenizer = hf_policy.tokenizer
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    prompt = prompt_ids(tokenizer, messages)
    own = hf_policy.generate(
        BatchedDataDict(
            input_ids=torch.tensor([prompt]), input_lengths=torch.tensor([len(prompt)])
        ),
        greedy=True,
    )
    n = int(own["generation_lengths"][0])
    own_ids = own["output_ids"][0, len(prompt) : len(prompt) + n].tolist()
    own_text = tokenizer.decode(own_ids[:-1] if own_ids[-1] == tokenizer.eos_token_id else own_ids)
    with AgentEndpoint(hf_policy, tokenizer) as endpoint:
        session = endpoint.open_session("greedy")
        api = client(session.base_url)
        reply = api.chat.completions.create(
            model="tiny", messages=messages, temperature=0, logprobs=True
        )
        stream = api.chat.completions.create(
            model="tiny", messages=messages, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        chunks = list(stream)
    assert reply.choices[0].message.content == own_text
    ended = own_ids[-1] == tokenizer.eos_token_id  # else cut at the backend's max_new_tokens
    assert reply.choices[0].finish_reason == ("stop" if ended else "length")
    assert reply.usage.prompt_tokens == len(prompt) and reply.usage.completion_tokens == n
    content_logprobs = [t.logprob for t in reply.choices[0].logprobs.content]
    expected_logprobs = own["logprobs"][0, len(prompt) : len(prompt) + n].tolist()
    assert content_logprobs == pytest.approx(expected_logprobs[: len(content_logprobs)], abs=1e-4)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == own_text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == (
        reply.choices[0].finish_reason
    )
    assert chunks[-1].usage.total_tokens == len(prompt) + n
    first, second = session.segments[0].message_log[-1], session.segments[1].message_log[-1]
    assert len(session.segments) == 2  # the same messages again: not an extension
    assert first["token_ids"].tolist() == second["token_ids"].tolist() == own_ids


def test_a_three_call_session_records_exactly_the_sampled_tokens(tiny_tokenizer):
    tok = tiny_tokenizer
    eos = tok.eos_token_id
    sampled = [
        spelled(tok, "Let me add <call>2+3</call>"),  # ends at the stop string, no EOS
        [*spelled(tok, "It is 5, so the answer is 5."), eos],
        [*spelled(tok, "You are welcome."), eos],
    ]
    policy = TokenScript(tok, sampled)
    messages = [
        {"role": "system", "content": "You add numbers."},
        {"role": "user", "content": "What is 2 + 3?"},
    ]
    with AgentEndpoint(policy, tok) as endpoint:
        session = endpoint.open_session()
        api = client(session.base_url)
        first = api.chat.completions.create(model="m", messages=messages, stop=["</call>"])
        assert first.choices[0].message.content == "Let me add <call>2+3"
        messages += [first.choices[0].message.model_dump(exclude_none=True)]
        messages += [{"role": "tool", "tool_call_id": "c1", "content": "5"}]
        second = api.chat.completions.create(model="m", messages=messages, stop=["</call>"])
        # the agent trims what it got back: whitespace only, so still the same conversation
        echoed = {"role": "assistant", "content": second.choices[0].message.content + "\n"}
        messages += [echoed, {"role": "user", "content": "Thanks!"}]
        third = api.chat.completions.create(model="m", messages=messages)
    assert third.choices[0].message.content == "You are welcome."
    closing = tok.encode("<|im_end|>", add_special_tokens=False)
    tool_turn = tok.encode("\n<|im_start|>tool\n5<|im_end|>\n<|im_start|>assistant\n")
    user_turn = tok.encode("\n<|im_start|>user\nThanks!<|im_end|>\n<|im_start|>assistant\n")
    prompt = prompt_ids(tok, messages[:2])
    expected = prompt + sampled[0] + closing + tool_turn + sampled[1] + user_turn + sampled[2]
    [segment] = session.segments
    assert segment.token_ids == expected
    assert policy.prompts == [
        prompt,
        prompt + sampled[0] + closing + tool_turn,
        expected[: -len(sampled[2])],
    ]
    log = segment.message_log
    assert torch.cat([m["token_ids"] for m in log]).tolist() == expected
    generated = [m for m in log if "generation_logprobs" in m]
    assert [m["token_ids"].tolist() for m in generated] == sampled
    assert [m["generation_logprobs"].tolist() for m in generated] == [
        pytest.approx([-0.1] * len(sampled[0])),
        pytest.approx([-0.2] * len(sampled[1])),
        pytest.approx([-0.3] * len(sampled[2])),
    ]
    assert [m["role"] for m in log] == [
        "system",
        "user",
        "assistant",
        "tool",
        "assistant",
        "user",
        "assistant",
    ]
    # re-tokenizing the conversation the agent sent would not give these tokens
    assert tok.encode(tok.decode(expected)) != expected


def test_a_history_rewrite_starts_a_segment_of_context(tiny_tokenizer):
    tok = tiny_tokenizer
    replies = iter(["<think>2 and 3</think>It is 5.", "Still 5."])
    policy = ScriptedGeneration(tok, lambda prompt: next(replies))
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    with AgentEndpoint(policy, tok) as endpoint:
        session = endpoint.open_session()
        api = client(session.base_url)
        first = api.chat.completions.create(model="m", messages=messages)
        # the agent strips the reasoning from the history it sends back
        messages += [{"role": "assistant", "content": "It is 5."}]
        messages += [{"role": "user", "content": "Sure?"}]
        api.chat.completions.create(model="m", messages=messages)
    assert first.choices[0].message.content == "<think>2 and 3</think>It is 5."
    start, rewrite = session.segments
    assert (start.reason, start.sampled_turns) == ("start", 1)
    assert (
        rewrite.reason == "rewrite: messages[1] (assistant) differs from what the conversation held"
    )
    assert [(m["role"], "generation_logprobs" in m) for m in rewrite.message_log] == [
        ("user", False),
        ("assistant", False),  # the rewritten turn is context, not trainable
        ("user", False),
        ("assistant", True),
    ]
    sampled = [*tok.encode("Still 5."), tok.eos_token_id]
    assert rewrite.token_ids == prompt_ids(tok, messages) + sampled
    assert start.token_ids[-len(tok.encode("<think>2 and 3</think>It is 5.")) - 1 :] == (
        [*tok.encode("<think>2 and 3</think>It is 5."), tok.eos_token_id]
    )


ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {"type": "object", "properties": {"a": {}, "b": {}}},
    },
}


@pytest.mark.parametrize(
    ("template", "response"),
    [
        ("chatml", 'Adding.\n<tool_call>{"name": "add", "arguments": {"a":2, "b":3}}</tool_call>'),
        ("llama3", '<|python_tag|>{"name": "add", "parameters": {"a": 2, "b": 3}}'),
    ],
)  # fmt: skip
def test_tool_calls_are_parsed_in_the_template_s_format(
    template, response, tiny_tokenizer, llama3_tokenizer
):
    tok = {"chatml": tiny_tokenizer, "llama3": llama3_tokenizer}[template]
    policy = ScriptedGeneration(tok, lambda prompt: response)
    messages = [{"role": "user", "content": "2 + 3?"}]
    with AgentEndpoint(policy, tok) as endpoint:
        api = client(endpoint.open_session().base_url)
        reply = api.chat.completions.create(model="m", messages=messages, tools=[ADD_TOOL])
        chunks = list(
            api.chat.completions.create(model="m", messages=messages, tools=[ADD_TOOL], stream=True)
        )
        plain = api.chat.completions.create(model="m", messages=messages, tool_choice="none",
                                            tools=[ADD_TOOL])  # fmt: skip
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == ("Adding." if template == "chatml" else None)
    [call] = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("add", {"a": 2, "b": 3})
    streamed = [c.choices[0].delta.tool_calls for c in chunks if c.choices]
    [[streamed_call]] = [calls for calls in streamed if calls]
    assert (streamed_call.function.name, json.loads(streamed_call.function.arguments)) == (
        "add",
        {"a": 2, "b": 3},
    )
    assert plain.choices[0].message.tool_calls is None
    assert plain.choices[0].message.content == response


@pytest.mark.parametrize(
    ("arguments", "param", "fragment"),
    [
        ({"temperature": 0.5}, "temperature", "samples at temperature 1.0"),
        ({"n": 2}, "n", "one choice per request"),
        ({"seed": 3}, "seed", "cannot be honoured"),
        ({"top_logprobs": 2, "logprobs": True}, "top_logprobs", "only the sampled token"),
        ({"tool_choice": "required", "tools": [ADD_TOOL]}, "tool_choice", "constrained"),
        ({"extra_body": {"best_of": 2}}, "best_of", "Unrecognized request argument"),
        ({"max_tokens": 0}, "max_tokens", "integer >= 1"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role", "one of"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {
            "url": "https://example.com/a.png"}}]}]}, "messages[0].content[0]", "data URL"),
    ],
)  # fmt: skip
def test_bad_requests_get_the_openai_error_shape(tiny_tokenizer, arguments, param, fragment):
    policy = ScriptedGeneration(tiny_tokenizer, lambda prompt: "4")
    request = {"model": "m", "messages": [{"role": "user", "content": "2 + 2?"}], **arguments}
    with AgentEndpoint(policy, tiny_tokenizer) as endpoint:
        session = endpoint.open_session()
        with pytest.raises(openai.BadRequestError) as caught:
            client(session.base_url).chat.completions.create(**request)
    assert caught.value.status_code == 400
    body = caught.value.body
    assert set(body) == {"message", "type", "param", "code"}
    assert (body["type"], body["param"]) == ("invalid_request_error", param)
    assert fragment in body["message"]
    assert session.request_errors == [body["message"]] and session.segments == []


def test_errors_beyond_the_request_parameters(tiny_tokenizer):
    policy = ScriptedGeneration(tiny_tokenizer, lambda prompt: "4")
    messages = [{"role": "user", "content": "2 + 2? " * 40}]
    with AgentEndpoint(policy, tiny_tokenizer, max_seq_len=64) as endpoint:
        with pytest.raises(openai.BadRequestError) as too_long:
            client(endpoint.open_session().base_url).chat.completions.create(
                model="m", messages=messages
            )
        with pytest.raises(openai.NotFoundError) as no_session:
            client(endpoint.base_url.replace("/v1", "/s/nobody/v1")).models.list()
        raw = http_error(f"{endpoint.base_url}/chat/completions", b"{not json")
        missing = http_error(f"{endpoint.base_url}/embeddings")
        models = client(endpoint.base_url).models.list()
        unrecorded = client(endpoint.base_url).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "2 + 2?"}]
        )
        sessions = dict(endpoint.service.sessions)
    assert too_long.value.body["code"] == "context_length_exceeded"
    assert "max_seq_len) is 64" in too_long.value.body["message"]
    assert no_session.value.body["code"] == "session_not_found"
    assert raw[0] == 400 and "not valid JSON" in raw[1]["error"]["message"]
    assert missing[0] == 404 and missing[1]["error"]["type"] == "not_found_error"
    assert [m.id for m in models.data] == ["envloop-policy"]
    assert unrecorded.choices[0].message.content == "4"
    assert [len(s.segments) for s in sessions.values()] == [0]  # only the refused session
