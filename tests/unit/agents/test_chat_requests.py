from __future__ import annotations

import base64

import pytest

from envloop.agents.chat_requests import BackendSampling, parse_chat_request
from envloop.agents.openai_errors import OpenAIError

USER = [{"role": "user", "content": "hi"}]
SAMPLING = BackendSampling(temperature=0.7, top_p=0.9)


def parsed(**body):
    return parse_chat_request({"messages": USER, **body}, SAMPLING)


def refusal(**body) -> OpenAIError:
    with pytest.raises(OpenAIError) as caught:
        parsed(**body)
    return caught.value


def test_sampling_follows_the_backend_or_is_greedy():
    assert parsed().greedy is False
    assert parsed(temperature=0.7, top_p=0.9).greedy is False
    assert parsed(temperature=0, seed=5, top_p=0.1).greedy is True  # greedy: seed, top_p moot
    assert refusal(temperature=1.0).param == "temperature"
    assert "samples at temperature 0.7" in refusal(temperature=1.0).message
    assert refusal(top_p=1.0).param == "top_p"
    assert refusal(seed=1).param == "seed"


def test_the_options_a_request_may_set():
    request = parsed(
        max_completion_tokens=7, stop="</call>", logprobs=True, stream=True,
        stream_options={"include_usage": True}, parallel_tool_calls=False, model="x", user="u",
    )  # fmt: skip
    assert (request.max_tokens, request.stop, request.logprobs) == (7, ["</call>"], True)
    assert (request.stream, request.include_usage, request.parallel_tool_calls) == (
        True,
        True,
        False,
    )
    assert parsed(max_tokens=3, stop=["a", "b"]).stop == ["a", "b"]


def test_messages_are_read_as_templates_take_them():
    image = base64.b64encode(b"\x89PNG...").decode()
    request = parsed(
        messages=[
            {"role": "developer", "content": [{"type": "text", "text": "Be "},
                                              {"type": "text", "text": "brief."}]},
            {"role": "user", "content": [
                {"type": "text", "text": "What is this?"},
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image}"}},
            ]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "look", "arguments": {"zoom": 2}}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "a cat"},
        ]
    )  # fmt: skip
    system, user, assistant, tool = request.messages
    assert system == {"role": "system", "content": "Be brief."}
    assert user["content"] == [
        {"type": "text", "text": "What is this?"},
        {"type": "image", "image": b"\x89PNG..."},
    ]
    assert assistant["content"] == ""
    assert assistant["tool_calls"][0]["function"] == {"name": "look", "arguments": '{"zoom": 2}'}
    assert tool == {"role": "tool", "content": "a cat", "tool_call_id": "c1"}


def test_tools_and_tool_choice():
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    assert parsed(tools=[tool]).parse_tool_calls is True
    assert parsed(tools=[tool], tool_choice="none").parse_tool_calls is False
    assert parsed().parse_tool_calls is False
    assert refusal(tools=[tool], tool_choice={"type": "function"}).param == "tool_choice"
    assert refusal(tools=[{"type": "retrieval"}]).param == "tools[0]"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "tool", "content": "5"}]}, "messages[0].tool_call_id"),
        (
            {"messages": [{"role": "user", "content": [{"type": "audio"}]}]},
            "messages[0].content[0]",
        ),
        ({"n": 3}, "n"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"logit_bias": {"1": 5}}, "logit_bias"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"stop": [""]}, "stop"),
        ({"stream": "yes"}, "stream"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"frobnicate": 1}, "frobnicate"),
    ],
)
def test_every_refusal_names_the_parameter(body, param):
    assert refusal(**{"messages": USER, **body}).param == param
