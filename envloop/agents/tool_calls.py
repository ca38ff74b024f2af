"""Tool calls parsed out of a model's text, one parser per template family's format.

- ``hermes`` (Hermes, Qwen 2.5/3, and the many templates that copied them): each call is
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; the text around the calls is
  the message's content.
- ``llama3`` (Llama 3.1-3.3 JSON tool calling): the whole response is one JSON object
  ``{"name": ..., "parameters": {...}}`` (or several separated by ``;``), optionally after
  ``<|python_tag|>``; such a response has no content.

:func:`tool_call_parser` picks the parser from the chat template (or by name). A response
whose calls are not valid JSON is left as content, with no tool calls, as vLLM's parsers do.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "TOOL_CALL_FORMATS",
    "HermesToolCallParser",
    "Llama3ToolCallParser",
    "ParsedResponse",
    "ToolCall",
    "tool_call_parser",
]


@dataclass(frozen=True)
class ToolCall:
    """One call: the function's ``name`` and its ``arguments`` as a JSON string."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_openai(self) -> dict[str, Any]:
        """The call as the API's message ``tool_calls`` entry."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ParsedResponse:
    """A response split into its ``content`` (None when only calls remain) and calls."""

    content: str | None
    tool_calls: list[ToolCall]


class HermesToolCallParser:
    """``<tool_call>{json}</tool_call>`` blocks.

    >>> parsed = HermesToolCallParser().parse(
    ...     'Let me add.\\n<tool_call>\\n{"name": "add", "arguments": {"a": 1}}\\n</tool_call>')
    >>> parsed.content, parsed.tool_calls[0].name, parsed.tool_calls[0].arguments
    ('Let me add.', 'add', '{"a": 1}')
    """

    name = "hermes"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def parse(self, text: str) -> ParsedResponse:
        calls = []
        for body in self._BLOCK.findall(text):
            call = _call_from_json(body, ("arguments", "parameters"))
            if call is None:
                return ParsedResponse(text, [])
            calls.append(call)
        if not calls:
            return ParsedResponse(text, [])
        content = self._BLOCK.sub("", text).strip()
        return ParsedResponse(content or None, calls)


class Llama3ToolCallParser:
    """A response that is JSON calls: ``{"name", "parameters"}`` objects joined by ``;``.

    >>> parsed = Llama3ToolCallParser().parse(
    ...     '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "neg", '
    ...     '"parameters": {}}')
    >>> parsed.content, [(c.name, c.arguments) for c in parsed.tool_calls]
    (None, [('add', '{"a": 1}'), ('neg', '{}')])
    >>> Llama3ToolCallParser().parse("The answer is 4.").tool_calls
    []
    """

    name = "llama3"

    def parse(self, text: str) -> ParsedResponse:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return ParsedResponse(text, [])
        calls, decoder, position = [], json.JSONDecoder(), 0
        while position < len(body):
            try:
                value, end = decoder.raw_decode(body, position)
            except json.JSONDecodeError:
                return ParsedResponse(text, [])
            call = _call_from_value(value, ("parameters", "arguments"))
            if call is None:
                return ParsedResponse(text, [])
            calls.append(call)
            position = end
            while position < len(body) and body[position] in " \t\r\n;":
                position += 1
        return ParsedResponse(None, calls)


ToolCallParser = HermesToolCallParser | Llama3ToolCallParser
TOOL_CALL_FORMATS: dict[str, type[HermesToolCallParser] | type[Llama3ToolCallParser]] = {
    "hermes": HermesToolCallParser,
    "llama3": Llama3ToolCallParser,
}
"""Each tool-call format by name."""


def tool_call_parser(tokenizer: Any, name: str | None = None) -> ToolCallParser:
    """The parser named ``name``, or (None) the one the chat template's format implies:
    ``llama3`` for a template with ``<|python_tag|>`` or Llama 3 headers
    (``<|start_header_id|>``), ``hermes`` otherwise (``<tool_call>`` and ChatML templates).

    >>> tool_call_parser(None, "llama3").name
    'llama3'
    >>> tool_call_parser(None, "mistral")
    Traceback (most recent call last):
    ...
    ValueError: Unknown tool_call_format 'mistral'; known: hermes, llama3.
    """
    if name is not None:
        if name not in TOOL_CALL_FORMATS:
            raise ValueError(
                f"Unknown tool_call_format {name!r}; known: {', '.join(TOOL_CALL_FORMATS)}."
            )
        return TOOL_CALL_FORMATS[name]()
    template = str(getattr(getattr(tokenizer, "tokenizer", tokenizer), "chat_template", "") or "")
    if "<tool_call>" not in template and (
        "<|python_tag|>" in template or "<|start_header_id|>" in template
    ):
        return Llama3ToolCallParser()
    return HermesToolCallParser()


def _call_from_json(text: str, argument_keys: tuple[str, ...]) -> ToolCall | None:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    return _call_from_value(value, argument_keys)


def _call_from_value(value: Any, argument_keys: tuple[str, ...]) -> ToolCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments: Any = next((value[k] for k in argument_keys if k in value), {})
    if isinstance(arguments, str):
        return ToolCall(value["name"], arguments)
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))
