from __future__ import annotations

import json

import pytest

from envloop.agents.tool_calls import (
    HermesToolCallParser,
    Llama3ToolCallParser,
    tool_call_parser,
)


def calls_of(parsed):
    return [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


def test_hermes_parses_every_block_and_keeps_the_text_around_them():
    text = (
        "I will add, then negate.\n"
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
        '<tool_call>{"name": "neg", "arguments": {"x": 3}}</tool_call>'
    )
    parsed = HermesToolCallParser().parse(text)
    assert parsed.content == "I will add, then negate."
    assert calls_of(parsed) == [("add", {"a": 1, "b": 2}), ("neg", {"x": 3})]
    assert len({c.id for c in parsed.tool_calls}) == 2


def test_hermes_response_of_calls_only_has_no_content():
    parsed = HermesToolCallParser().parse('<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert (parsed.content, calls_of(parsed)) == (None, [("f", {})])


@pytest.mark.parametrize(
    "text",
    [
        "no calls here",
        '<tool_call>{"name": "f", "arguments": </tool_call>',  # broken JSON
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": "f"',  # never closed
    ],
)
def test_hermes_leaves_a_response_without_valid_calls_as_content(text):
    parsed = HermesToolCallParser().parse(text)
    assert (parsed.content, parsed.tool_calls) == (text, [])


def test_llama3_parses_json_calls_with_or_without_the_python_tag():
    one = Llama3ToolCallParser().parse('{"name": "add", "parameters": {"a": 1}}')
    assert (one.content, calls_of(one)) == (None, [("add", {"a": 1})])
    two = Llama3ToolCallParser().parse(
        '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "neg", "arguments": {}}'
    )
    assert calls_of(two) == [("add", {"a": 1}), ("neg", {})]


@pytest.mark.parametrize(
    "text", ["The answer is {4}.", '{"name": "add", "parameters": {"a": 1}} and more', '{"x": 1}']
)
def test_llama3_leaves_text_that_is_not_only_calls_as_content(text):
    parsed = Llama3ToolCallParser().parse(text)
    assert (parsed.content, parsed.tool_calls) == (text, [])


def test_the_parser_follows_the_chat_template_unless_named(tiny_tokenizer, llama3_tokenizer):
    assert tool_call_parser(tiny_tokenizer).name == "hermes"
    assert tool_call_parser(llama3_tokenizer).name == "llama3"
    assert tool_call_parser(tiny_tokenizer, "llama3").name == "llama3"
    with pytest.raises(ValueError, match="Unknown tool_call_format 'xml'; known: hermes, llama3"):
        tool_call_parser(tiny_tokenizer, "xml")
