"""A session: one agent run's requests, recorded token for token as trajectory segments.

Within a session, a request whose messages are the previous request's messages, then the
response it got, then new messages, *extends* the current segment: the prompt is the
segment's tokens so far (the exact sampled ids included) plus the new messages' tokens.
Any other request (a compacted context, stripped reasoning, an edited tool result, other
tools) is a *rewrite*: it starts a new segment whose prompt is the whole conversation
rendered afresh, all of it context.

Messages are compared by role, text, images, tool calls (function name and arguments as
JSON values; ids are the endpoint's own and are not compared) and ``tool_call_id``. Texts
that differ only in whitespace (any amount, anywhere) count as equal: an agent that trims
or re-indents what it got back extends its segment, and the recorded tokens stay exactly
what was sampled.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from envloop.agents.prompt_tokens import Chunk, continuation_chunks, prompt_chunks

__all__ = ["Segment", "Session", "TurnPlan"]


@dataclass
class Segment:
    """One stretch of a session whose tokens only ever grew.

    Attributes:
        index: 0 for the session's first segment, then 1, 2, ... per rewrite.
        reason: ``"start"``, or ``"rewrite: <what differed>"``.
        message_log: the envloop message log: each message ``role``, ``content``,
            ``token_ids`` [n] int64; sampled turns (role ``assistant``) also
            ``generation_logprobs`` [n] float32 and ``generation_policy_versions`` [n]
            int32. Everything else (prompts, tool results, rewritten history) is context.
        token_ids: the concatenation of every message's ``token_ids``, as a list.
        tools: the tool definitions the segment's requests gave.
        history: the conversation an extending request starts with: the last request's
            messages and the response it got, as the API carries them.
        ended_with_eos: whether the last sampled turn ended with EOS.
        sampled_turns: responses sampled in this segment.
        sampled_tokens: tokens sampled in this segment.
        prompt_tokens: tokens of the segment's first prompt.
    """

    index: int
    reason: str
    message_log: list[dict[str, Any]] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
    ended_with_eos: bool = False
    sampled_turns: int = 0
    sampled_tokens: int = 0
    prompt_tokens: int = 0


@dataclass
class TurnPlan:
    """What one request adds, before its response is sampled: the segment it extends
    (None: a new one, for ``reason``), its new context messages and the whole prompt."""

    segment: Segment | None
    reason: str
    context: list[Chunk]
    prompt_ids: list[int]
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None

    def trajectory_so_far(self) -> list[dict[str, Any]]:
        """The messages of the prompt: the extended segment's log and the new context."""
        earlier = self.segment.message_log if self.segment is not None else []
        return [*earlier, *(message for message, _ in self.context)]


class Session:
    """One agent run's recorded conversation; its requests are served one at a time.

    Args:
        session_id: the name in the session's URL.
        base_url: ``http://127.0.0.1:<port>/s/<session_id>/v1``.
    """

    def __init__(self, session_id: str, base_url: str) -> None:
        self.id, self.base_url = session_id, base_url
        self.segments: list[Segment] = []
        self.request_errors: list[str] = []
        """The message of every request of this session the endpoint refused."""
        self.requests = 0
        self._lock: asyncio.Lock | None = None

    @property
    def lock(self) -> asyncio.Lock:
        """Serializes the session's requests (made on the endpoint's event loop)."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    def plan(
        self,
        tokenizer: Any,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
    ) -> TurnPlan:
        """The tokens the request with ``messages`` and ``tools`` is prompted with."""
        current = self.segments[-1] if self.segments else None
        difference = _difference(current, messages, tools)
        if current is not None and difference is None:
            new = messages[len(current.history) :]
            context = continuation_chunks(
                tokenizer, current.history[:-1], new, tools, current.ended_with_eos
            )
            prompt = current.token_ids + [t for _, ids in context for t in ids]
            return TurnPlan(current, "", context, prompt, messages, tools)
        context = prompt_chunks(tokenizer, messages, tools)
        prompt = [t for _, ids in context for t in ids]
        reason = "start" if current is None else f"rewrite: {difference}"
        return TurnPlan(None, reason, context, prompt, messages, tools)

    def record(
        self, plan: TurnPlan, sampled: dict[str, Any], reply: dict[str, Any], eos: bool
    ) -> Segment:
        """Add ``plan``'s context and the ``sampled`` assistant message (with
        ``token_ids`` and ``generation_logprobs``) to the trajectory; ``reply`` is the
        message the agent got back (``role``, ``content``, ``tool_calls``)."""
        segment = plan.segment
        if segment is None:
            segment = Segment(len(self.segments), plan.reason, tools=plan.tools)
            segment.prompt_tokens = len(plan.prompt_ids)
            self.segments.append(segment)
        for message, ids in plan.context:
            segment.message_log.append(
                {**message, "token_ids": torch.tensor(ids, dtype=torch.long)}
            )
        segment.message_log.append(sampled)
        segment.token_ids = plan.prompt_ids + sampled["token_ids"].tolist()
        segment.history = [*plan.messages, reply]
        segment.ended_with_eos = eos
        segment.sampled_turns += 1
        segment.sampled_tokens += len(sampled["token_ids"])
        return segment


def _difference(
    segment: Segment | None, messages: Sequence[dict[str, Any]], tools: Any
) -> str | None:
    """Why ``messages`` do not extend ``segment`` (None: they do)."""
    if segment is None:
        return "no segment yet"
    if _tools_key(tools) != _tools_key(segment.tools):
        return "the tool definitions changed"
    history = segment.history
    if len(messages) < len(history):
        return f"{len(messages)} messages, fewer than the {len(history)} of the conversation so far"
    for i, (old, new) in enumerate(zip(history, messages)):
        if _message_key(old) != _message_key(new):
            return f"messages[{i}] ({new.get('role')}) differs from what the conversation held"
    return None


def _message_key(message: dict[str, Any]) -> tuple[Any, ...]:
    calls = tuple(
        (c["function"]["name"], _json_value(c["function"].get("arguments")))
        for c in message.get("tool_calls") or ()
    )
    return (
        message.get("role"),
        _content_key(message.get("content")),
        calls,
        message.get("tool_call_id"),
    )


def _content_key(content: Any) -> Any:
    if content is None or isinstance(content, str):
        return "".join((content or "").split())
    return tuple(
        ("text", "".join(p["text"].split())) if p["type"] == "text" else ("image", p["image"])
        for p in content
    )


def _json_value(arguments: Any) -> str:
    try:
        return json.dumps(json.loads(arguments), sort_keys=True)
    except (TypeError, json.JSONDecodeError):
        return str(arguments)


def _tools_key(tools: Any) -> str:
    return json.dumps(tools, sort_keys=True)
