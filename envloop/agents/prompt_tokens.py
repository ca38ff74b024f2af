"""The tokens a request adds to a session: a whole prompt, or what follows sampled tokens.

A session's tokens are never re-tokenized. A segment's first request is rendered with the
chat template (messages, tool definitions, generation prompt) and tokenized message by
message (:func:`prompt_chunks`). A later request that extends the conversation adds only
its new messages: the template's rendering of what follows an assistant turn
(:func:`continuation_chunks`: the turn's closing, unless the sampled tokens already ended
with EOS, the new messages and the next generation prompt), found by rendering the
conversation with a marker in place of the sampled turn's text, so whatever the template
does to past assistant turns (stripping reasoning, re-rendering tool calls) never touches
the sampled tokens.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Sequence
from typing import Any

from envloop.agents.openai_errors import OpenAIError
from envloop.data.message_tokens import add_bos_eos, text_only_tokenizer
from envloop.data.multimodal_messages import tokenize_with_processor
from envloop.data.multimodal_utils import is_processor
from envloop.data.tokenization import tokenize_texts

__all__ = ["Chunk", "continuation_chunks", "prompt_chunks", "template_messages"]

Chunk = tuple[dict[str, Any], list[int]]
"""A message for the trajectory (``role``, ``content``, and vision inputs for a message
with images when the tokenizer is a multimodal processor) and its token ids."""

_MARK = "\x00envloop-sampled-turn\x00"


def template_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` as chat templates read them: tool call arguments as objects (templates
    ``tojson`` them), other keys as the API sent them.

    >>> template_messages([{"role": "assistant", "content": "", "tool_calls": [{"id": "c",
    ...     "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]}]
    ... )[0]["tool_calls"][0]["function"]["arguments"]
    {'x': 1}
    """
    out = []
    for message in messages:
        message = dict(message)
        if message.get("tool_calls"):
            message["tool_calls"] = [_call_with_object_arguments(c) for c in message["tool_calls"]]
        out.append(message)
    return out


def prompt_chunks(
    tokenizer: Any, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[Chunk]:
    """Each message of a segment's first request and its token ids (the last with the
    generation prompt); their concatenation is the templated conversation tokenized. A
    template that rewrites earlier turns once later ones follow gives one ``context``
    message holding the whole prompt."""
    rendered = [
        _render(tokenizer, messages[: k + 1], tools, k == len(messages) - 1)
        for k in range(len(messages))
    ]
    deltas = _prefix_deltas(rendered)
    logged = [{"role": m["role"], "content": m["content"]} for m in messages]
    if deltas is None:
        deltas, logged = [rendered[-1]], [_context(rendered[-1], messages)]
    chunks = _tokenized(tokenizer, deltas, logged)
    add_bos_eos([ids for _, ids in chunks], text_only_tokenizer(tokenizer), bos=True, eos=False)
    return chunks


def continuation_chunks(
    tokenizer: Any,
    history: Sequence[dict[str, Any]],
    new_messages: Sequence[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    ended_with_eos: bool,
) -> list[Chunk]:
    """The tokens that follow a sampled assistant turn: ``history`` (the conversation
    before it) continued by the turn, then ``new_messages``, then the generation prompt.
    The first chunk opens with the turn's closing (less the EOS the sampled tokens already
    hold). No new messages: one ``context`` message with the closing and generation prompt.
    """
    base = [*history, {"role": "assistant", "content": _MARK}]
    if new_messages:
        last = len(new_messages) - 1
        tails = [
            _after_mark(_render(tokenizer, [*base, *new_messages[: k + 1]], tools, k == last))
            for k in range(len(new_messages))
        ]
        logged = [{"role": m["role"], "content": m["content"]} for m in new_messages]
    else:
        tails = [_after_mark(_render(tokenizer, base, tools, True))]
        logged = [{"role": "context", "content": ""}]
    deltas = _prefix_deltas(tails)
    if deltas is None:
        deltas, logged = [tails[-1]], [_context(tails[-1], new_messages)]
    eos = text_only_tokenizer(tokenizer).eos_token or ""
    if ended_with_eos and eos and deltas[0].startswith(eos):
        deltas[0] = deltas[0][len(eos) :]
    return _tokenized(tokenizer, deltas, logged)


def _tokenized(tokenizer: Any, chunks: list[str], logged: list[dict[str, Any]]) -> list[Chunk]:
    """Each templated chunk's token ids, its message (with its vision inputs, each a
    one-item ``PackedTensor``, when it holds images and ``tokenizer`` is a processor)."""
    if not is_processor(tokenizer):
        return list(zip(logged, tokenize_texts(tokenizer, chunks)))
    contents = [m["content"] for m in logged]
    try:
        token_lists, vision = tokenize_with_processor(tokenizer, chunks, contents, "messages")
    except ValueError as error:
        raise OpenAIError(f"The images could not be read: {error}", param="messages") from None
    return [({**m, **inputs}, ids) for m, ids, inputs in zip(logged, token_lists, vision)]


def _context(text: str, messages: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One message holding a whole templated ``text`` (and the images of ``messages``)."""
    images = [
        part for m in messages if isinstance(m["content"], list)
        for part in m["content"] if part["type"] == "image"
    ]  # fmt: skip
    return {
        "role": "context",
        "content": [{"type": "text", "text": text}, *images] if images else text,
    }


def _render(
    tokenizer: Any,
    messages: Sequence[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool,
) -> str:
    if not is_processor(tokenizer) and any(isinstance(m.get("content"), list) for m in messages):
        raise OpenAIError(
            "This endpoint serves a text-only policy: its tokenizer has no image processor, "
            "so image parts cannot be read. Send text content only, or serve a "
            "vision-language policy with its processor as the tokenizer.",
            param="messages",
        )
    if not getattr(text_only_tokenizer(tokenizer), "chat_template", None):
        raise OpenAIError(
            "The policy's tokenizer has no chat template, so chat messages cannot be "
            "rendered; serve a policy whose tokenizer has one.",
            status=500,
            type="server_error",
        )
    extra = {} if tools is None else {"tools": tools}
    try:
        text = tokenizer.apply_chat_template(
            template_messages(messages),
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **extra,
        )
    except Exception as error:
        raise OpenAIError(
            f"The policy's chat template could not render these messages: "
            f"{type(error).__name__}: {error}",
            param="messages",
        ) from None
    return str(text)


def _after_mark(text: str) -> str:
    if text.count(_MARK) != 1:
        raise OpenAIError(
            "The policy's chat template does not render an assistant message's content "
            "verbatim, so the tokens that follow a sampled turn cannot be found.",
            status=500,
            type="server_error",
        )
    return text[text.index(_MARK) + len(_MARK) :]


def _prefix_deltas(texts: list[str]) -> list[str] | None:
    """Each text less the one before it; None when one is not a prefix of the next."""
    deltas, previous = [], ""
    for text in texts:
        if not text.startswith(previous):
            return None
        deltas.append(text[len(previous) :])
        previous = text
    return deltas


def _call_with_object_arguments(call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call.get("function") or {})
    with contextlib.suppress(TypeError, json.JSONDecodeError):  # else rendered as a string
        function["arguments"] = json.loads(function.get("arguments") or "{}")
    return {**call, "function": function}
