"""The JSON the endpoint answers with: a ``chat.completion`` object, or the
``chat.completion.chunk`` events of a streamed one (as the OpenAI API shapes them)."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from envloop.agents.chat_requests import ChatRequest
from envloop.agents.sampling import Sampled
from envloop.agents.tool_calls import ParsedResponse, ToolCall

__all__ = ["Completion", "completion_body", "reply_of", "stream_events"]


@dataclass
class Completion:
    """A sampled response as the agent gets it.

    Attributes:
        content: the text (a final EOS and a stop string dropped, tool calls taken out).
        tool_calls: the calls parsed from the text.
        finish_reason: ``stop``, ``length`` or ``tool_calls``.
        token_texts: each token of ``content``'s span decoded (a final EOS left out).
        logprobs: their log-probabilities.
        prompt_tokens: tokens of the prompt.
        completion_tokens: tokens sampled (EOS included).
    """

    content: str | None
    tool_calls: list[ToolCall]
    finish_reason: str
    token_texts: list[str]
    logprobs: list[float]
    prompt_tokens: int
    completion_tokens: int


def reply_of(request: ChatRequest, sampled: Sampled, parser: Any, prompt_tokens: int) -> Completion:
    """What the agent gets for ``sampled``: the stop string that ended it cut off, its
    tool calls parsed (when the request allows them)."""
    text, stopped = sampled.text, sampled.ended_with_eos
    for stop in request.stop or ():
        if not sampled.ended_with_eos and text.endswith(stop):
            text, stopped = text[: -len(stop)], True
            break
    parsed = parser.parse(text) if request.parse_tool_calls else ParsedResponse(text, [])
    calls = parsed.tool_calls if request.parallel_tool_calls else parsed.tool_calls[:1]
    reason = "tool_calls" if calls else ("length" if sampled.hit_budget and not stopped else "stop")
    n = len(sampled.token_texts) - (1 if sampled.ended_with_eos else 0)
    logprobs = sampled.message["generation_logprobs"][:n].tolist()
    return Completion(
        content=parsed.content,
        tool_calls=calls,
        finish_reason=reason,
        token_texts=sampled.token_texts[:n],
        logprobs=logprobs,
        prompt_tokens=prompt_tokens,
        completion_tokens=len(sampled.token_texts),
    )


def reply_message(completion: Completion) -> dict[str, Any]:
    """The assistant message as the API carries it (what an agent sends back)."""
    message: dict[str, Any] = {"role": "assistant", "content": completion.content}
    if completion.tool_calls:
        message["tool_calls"] = [c.as_openai() for c in completion.tool_calls]
    return message


def completion_body(completion: Completion, request: ChatRequest, model: str) -> dict[str, Any]:
    """The ``chat.completion`` object."""
    return {
        "id": _completion_id(),
        "object": "chat.completion",
        "created": int(time.time()),
        "model": request.model or model,
        "choices": [
            {
                "index": 0,
                "message": reply_message(completion),
                "logprobs": _logprobs(completion) if request.logprobs else None,
                "finish_reason": completion.finish_reason,
            }
        ],
        "usage": _usage(completion),
    }


def stream_events(completion: Completion, request: ChatRequest, model: str) -> Iterator[str]:
    """The server-sent events of a streamed completion: a role chunk, one content chunk
    per token (with its log-probability when asked), one chunk with the tool calls, the
    finish chunk, a usage chunk when ``stream_options.include_usage``, then ``[DONE]``."""
    head = {
        "id": _completion_id(),
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": request.model or model,
    }

    def event(delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> str:
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return f"data: {json.dumps({**head, 'choices': [choice]})}\n\n"

    yield event({"role": "assistant", "content": ""})
    if completion.tool_calls:
        if completion.content:
            yield event({"content": completion.content})
        calls = [{"index": k, **c.as_openai()} for k, c in enumerate(completion.tool_calls)]
        yield event({"tool_calls": calls})
    else:
        entries = _logprobs(completion)["content"]
        for piece, entry in zip(_pieces(completion), entries):
            yield event(
                {"content": piece}, logprobs={"content": [entry]} if request.logprobs else None
            )
    yield event({}, completion.finish_reason)
    if request.include_usage:
        yield f"data: {json.dumps({**head, 'choices': [], 'usage': _usage(completion)})}\n\n"
    yield "data: [DONE]\n\n"


def _pieces(completion: Completion) -> list[str]:
    """``content`` cut at token boundaries: one piece per token, concatenating to it."""
    content = completion.content or ""
    pieces, position = [], 0
    for text in completion.token_texts:
        end = min(position + len(text), len(content))
        if content[position:end] != text[: end - position]:  # a token split inside a char
            return [content] + [""] * (len(completion.token_texts) - 1)
        pieces.append(content[position:end])
        position = end
    if pieces:
        pieces[-1] += content[position:]
    return pieces


def _logprobs(completion: Completion) -> dict[str, Any]:
    return {
        "content": [
            {"token": text, "logprob": lp, "bytes": list(text.encode()), "top_logprobs": []}
            for text, lp in zip(completion.token_texts, completion.logprobs)
        ]
    }


def _usage(completion: Completion) -> dict[str, int]:
    return {
        "prompt_tokens": completion.prompt_tokens,
        "completion_tokens": completion.completion_tokens,
        "total_tokens": completion.prompt_tokens + completion.completion_tokens,
    }


def _completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex[:24]}"
