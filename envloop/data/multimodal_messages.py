"""Tokenizing message logs that hold images, with a multimodal processor.

The processor's chat template renders the conversation message by message (as for text);
each message's chunk of that text is then tokenized by the processor itself when the
message holds images, which expands every image placeholder to the image's number of
tokens and returns the vision inputs (``pixel_values``, ``image_grid_thw``, ...). The
concatenated ``token_ids`` are those of ``processor.apply_chat_template`` of the whole
conversation with ``tokenize=True``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from envloop.data.interfaces import LLMMessageLogType, TaskDataSpec
from envloop.data.message_tokens import add_bos_eos, templated_chunks
from envloop.data.multimodal_utils import content_images, message_vision_inputs
from envloop.data.tokenization import tokenize_texts

__all__ = ["format_with_processor", "tokenize_with_processor"]


def format_with_processor(
    message_log: LLMMessageLogType,
    processor: Any,
    task_data_spec: TaskDataSpec | None = None,
    add_bos_token: bool = True,
    add_eos_token: bool = True,
    add_generation_prompt: bool = False,
    tools: list[dict[str, Any]] | None = None,
    debug: bool = False,
) -> LLMMessageLogType:
    """``get_formatted_message_log`` for a processor: each message gains ``token_ids``
    (image placeholders expanded) and, when it holds images, its vision inputs, each a
    one-item :class:`~envloop.data.multimodal_utils.PackedTensor`."""
    log, chunks = templated_chunks(
        message_log, processor, task_data_spec, add_generation_prompt, tools, debug
    )
    token_lists, vision = tokenize_with_processor(processor, chunks, [m["content"] for m in log])
    add_bos_eos(
        token_lists, processor.tokenizer, add_bos_token, add_eos_token and not add_generation_prompt
    )
    return [
        {**message, "token_ids": torch.tensor(ids, dtype=torch.long), **inputs}
        for message, ids, inputs in zip(log, token_lists, vision)
    ]


def tokenize_with_processor(
    processor: Any, chunks: Sequence[str], contents: Sequence[Any], where: str = "message"
) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """Token ids of each templated ``chunk`` and the vision inputs of its message's
    ``content`` (``{}`` for a message without images). Text-only chunks are tokenized in
    one batched call; each chunk with images goes through the processor."""
    token_lists = tokenize_texts(processor.tokenizer, list(chunks))
    vision: list[dict[str, Any]] = [{} for _ in chunks]
    for i, (chunk, content) in enumerate(zip(chunks, contents)):
        images = content_images(content, f"{where} {i}")
        if not images:
            continue
        out = processor(text=[chunk], images=images, add_special_tokens=False, return_tensors="pt")
        placeholders = _placeholder_runs(out["input_ids"][0], processor)
        if placeholders is not None and placeholders != len(images):
            raise ValueError(
                f"{where} {i} holds {len(images)} image(s) but the chat template rendered "
                f"{placeholders} image placeholder(s) for it; the template must render one "
                "placeholder per image part."
            )
        token_lists[i] = out["input_ids"][0].tolist()
        vision[i] = message_vision_inputs(processor, out)
    return token_lists, vision


def _placeholder_runs(input_ids: torch.Tensor, processor: Any) -> int | None:
    """How many runs of image tokens ``input_ids`` holds (None: the processor has no
    ``image_token_id``)."""
    image_id = getattr(processor, "image_token_id", None)
    if image_id is None:
        return None
    is_image = (input_ids == image_id).int()
    starts = is_image[1:] > is_image[:-1]
    return int(starts.sum()) + int(is_image[:1].sum())
