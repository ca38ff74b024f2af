"""Tokenizing a turn's observations: text-only ones in one batched call, those with image
parts one by one through the processor (which expands their image placeholders and returns
their vision inputs). A bad observation (an unreadable image, images without a processor or
without a chat template to place them) yields an error for its own sample only."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from envloop.data.chat_templates import ObservationRenderer
from envloop.data.multimodal_messages import tokenize_with_processor
from envloop.data.multimodal_utils import has_images, is_processor, text_tokenizer
from envloop.data.tokenization import tokenize_texts
from envloop.experience.turn_steps import observation_text

Tokenized = tuple[list[int], dict[str, Any], str | None]
"""An observation's token ids, its vision inputs ({} without images) and its error (None)."""


def tokenize_observations(
    tokenizer: Any, items: Sequence[tuple[Mapping[str, Any], ObservationRenderer | None, bool]]
) -> list[Tokenized]:
    """Each ``(observation, renderer, response_ended_with_eos)`` tokenized, in order."""
    out: list[Tokenized] = [([], {}, None)] * len(items)
    text_rows, texts = [], []
    for k, (obs, renderer, ended_with_eos) in enumerate(items):
        if has_images(obs["content"]):
            out[k] = _with_images(tokenizer, obs, renderer, ended_with_eos)
            continue
        text_rows.append(k)
        texts.append(observation_text(obs, renderer, ended_with_eos))
    for k, ids in zip(text_rows, tokenize_texts(text_tokenizer(tokenizer), texts)):
        out[k] = (ids, {}, None)
    return out


def _with_images(
    tokenizer: Any, obs: Mapping[str, Any], renderer: ObservationRenderer | None, eos: bool
) -> Tokenized:
    if not is_processor(tokenizer):
        return (
            [],
            {},
            (
                "it holds images but the rollout's tokenizer is not a multimodal processor; pass "
                "the policy's processor (e.g. HfGeneration(...).processor) as the tokenizer"
            ),
        )
    if renderer is None:
        return (
            [],
            {},
            (
                "it holds images, which need observation_format='chat_template' (raw "
                "observations have no template to place the image placeholders)"
            ),
        )
    try:
        text = observation_text(obs, renderer, eos)
        token_lists, visions = tokenize_with_processor(
            tokenizer, [text], [obs["content"]], where="observation"
        )
    except ValueError as exc:
        return [], {}, str(exc)
    return token_lists[0], visions[0], None
