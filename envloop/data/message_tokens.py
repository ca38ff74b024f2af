"""A message log's chat-templated token ids, message by message, as plain lists.

This is the torch-free core of :func:`envloop.data.llm_message_utils.get_formatted_message_log`
(which wraps each list in a tensor), so prompt lengths can be measured before torch is
imported (``envloop run`` checks them against ``rollout.max_seq_len`` in about a second).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from envloop.data.chat_templates import render_chat
from envloop.data.tokenization import tokenize_texts

if TYPE_CHECKING:
    from envloop.data.interfaces import TaskDataSpec

MessageLog = list[dict[str, Any]]


def message_token_ids(
    message_log: Sequence[Mapping[str, Any]],
    tokenizer: Any,
    task_data_spec: TaskDataSpec | None = None,
    add_bos_token: bool = True,
    add_eos_token: bool = True,
    add_generation_prompt: bool = False,
    tools: list[dict[str, Any]] | None = None,
    debug: bool = False,
) -> tuple[MessageLog, list[list[int]]]:
    """The log as templated (``task_data_spec.prompt`` applied to the first user message)
    and each message's token ids: its part of the templated conversation, so that their
    concatenation is the whole conversation tokenized. The arguments are those of
    ``get_formatted_message_log``, which documents them. (With a processor, image parts
    render as the template's placeholders, not expanded; ``multimodal_messages`` expands them.)
    """
    log, chunks = templated_chunks(
        message_log, tokenizer, task_data_spec, add_generation_prompt, tools, debug
    )
    text = text_only_tokenizer(tokenizer)
    token_lists = tokenize_texts(text, chunks)
    add_bos_eos(token_lists, text, add_bos_token, add_eos_token and not add_generation_prompt)
    return log, token_lists


def templated_chunks(
    message_log: Sequence[Mapping[str, Any]],
    tokenizer: Any,
    task_data_spec: TaskDataSpec | None = None,
    add_generation_prompt: bool = False,
    tools: list[dict[str, Any]] | None = None,
    debug: bool = False,
) -> tuple[MessageLog, list[str]]:
    """The log as templated and each message's chunk of the templated conversation's text."""
    log = with_task_prompt(message_log, task_data_spec)
    texts = [
        render_chat(tokenizer, log[: i + 1], add_generation_prompt and i == len(log) - 1, tools)
        for i in range(len(log))
    ]
    deltas = _prefix_deltas(texts)
    if debug:
        _print_turns(log, deltas, texts[-1] if texts else "")
    return log, deltas


def text_only_tokenizer(tokenizer_or_processor: Any) -> Any:
    """The text tokenizer of a multimodal processor, or the tokenizer itself."""
    if hasattr(tokenizer_or_processor, "image_processor"):
        return tokenizer_or_processor.tokenizer
    return tokenizer_or_processor


def with_task_prompt(
    message_log: Sequence[Mapping[str, Any]], spec: TaskDataSpec | None
) -> MessageLog:
    """``message_log`` with ``spec.prompt`` applied to the first user message's content."""
    out = [dict(message) for message in message_log]
    prompt = getattr(spec, "prompt", None)
    first_user = next((i for i, m in enumerate(out) if m.get("role") == "user"), None)
    if prompt and first_user is not None:
        content = out[first_user]["content"]
        if isinstance(content, list):  # multimodal parts: format the text parts
            out[first_user]["content"] = [
                {**part, "text": prompt.format(part["text"])}
                if isinstance(part, Mapping) and part.get("type") == "text"
                else part
                for part in content
            ]
        else:
            out[first_user]["content"] = prompt.format(content)
    return out


def _print_turns(log: MessageLog, chunks: list[str], whole: str) -> None:
    """The ``debug`` output: each turn's templated chunk."""
    rule = "=" * 80
    print(f"\n{rule}\nDEBUG: Individual message turns from apply_chat_template\n{rule}")
    for i, (message, chunk) in enumerate(zip(log, chunks)):
        print(f"\n[Turn {i + 1}/{len(log)}] Role: {message['role']}\n{'-' * 40}")
        print(f"Extracted message chunk:\n{chunk!r}\nRaw text (len={len(chunk)}):\n{chunk}")
        print("-" * 40)
    print(f"\n{rule}\nDEBUG: Complete formatted conversation:\n{'-' * 80}\n{whole}\n{rule}\n")


def _prefix_deltas(texts: list[str]) -> list[str]:
    deltas, previous = [], ""
    for i, text in enumerate(texts):
        if not text.startswith(previous):
            raise ValueError(
                f"The chat template renders messages[:{i}] as text that is not a prefix of its "
                f"rendering of messages[:{i + 1}], so per-message token_ids cannot be exact. "
                "This happens with templates that rewrite earlier turns (e.g. strip reasoning); "
                "tokenize such logs as one message instead."
            )
        deltas.append(text[len(previous) :])
        previous = text
    return deltas


def add_bos_eos(token_lists: list[list[int]], tokenizer: Any, bos: bool, eos: bool) -> None:
    if not token_lists:
        return
    bos_id, eos_id = getattr(tokenizer, "bos_token_id", None), tokenizer.eos_token_id
    if bos and bos_id is not None and token_lists[0][:1] != [bos_id]:
        token_lists[0].insert(0, bos_id)
    if eos and eos_id is not None and eos_id not in token_lists[-1]:
        token_lists[-1].append(eos_id)
