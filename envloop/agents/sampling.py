"""One response sampled from a ``GenerationInterface`` for one prompt, cut as the rollout
engines cut responses (:func:`envloop.experience.turn_steps.split_responses`)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import torch

from envloop.data.multimodal_utils import text_tokenizer
from envloop.data.tokenization import decode_texts
from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.experience.turn_steps import Responses, assistant_message, split_responses
from envloop.models.generation.interfaces import GenerationInterface

__all__ = ["Sampled", "sample_response"]


@dataclass
class Sampled:
    """A sampled response.

    Attributes:
        message: the trajectory's assistant message (``token_ids`` [n] int64,
            ``generation_logprobs`` [n] float32, ``generation_policy_versions`` [n] int32).
        text: the response decoded (a final EOS dropped, a stop string kept).
        token_texts: each sampled token decoded on its own (n of them).
        ended_with_eos: the last token is EOS.
        hit_budget: the response stopped at a token cap (the request's, the context's or
            the backend's own), not at EOS or a stop string.
        error: the backend's ``generation_error`` for this prompt (None: it generated).
    """

    message: dict[str, Any]
    text: str
    token_texts: list[str]
    ended_with_eos: bool
    hit_budget: bool
    error: str | None


async def sample_response(
    policy: GenerationInterface,
    tokenizer: Any,
    prompt_ids: list[int],
    budget: int,
    stop: list[str] | None,
    greedy: bool,
    sample_id: str,
    vision: dict[str, Any] | None = None,
) -> Sampled:
    """Sample one response to ``prompt_ids`` of at most ``budget`` tokens (``vision``: the
    prompt's vision columns, one-row ``PackedTensor`` values and ``images``, as
    ``GenerationDatumSpec`` describes them). A backend that
    overrides ``generate_async`` is awaited on the calling event loop (its rows join its
    running batch); any other backend's ``generate`` runs on a worker thread."""
    data: BatchedDataDict[Any] = BatchedDataDict(
        input_ids=torch.tensor([prompt_ids], dtype=torch.long),
        input_lengths=torch.tensor([len(prompt_ids)], dtype=torch.long),
        stop_strings=[stop],
        max_new_tokens=torch.tensor([budget], dtype=torch.long),
        sample_ids=[sample_id],
        **(vision or {}),
    )
    output: Any = None
    if type(policy).generate_async is GenerationInterface.generate_async:
        output = await asyncio.to_thread(policy.generate, data, greedy)
    else:
        async for _, row in policy.generate_async(data, greedy=greedy):
            output = row
        if output is None:
            raise RuntimeError(f"{type(policy).__name__}.generate_async yielded no row.")
    responses = split_responses(output, data["input_lengths"], data["max_new_tokens"], tokenizer)
    truncated = output.get("truncated")
    capped = truncated is not None and bool(truncated[0])
    return _sampled(responses, tokenizer, budget, stop, capped)


def _sampled(
    responses: Responses, tokenizer: Any, budget: int, stop: list[str] | None, capped: bool
) -> Sampled:
    """``capped``: the backend reports the response cut at a token cap (its own or
    ``budget``)."""
    ids = responses.token_ids[0]
    text = responses.texts[0]
    eos = responses.ended_with_eos[0]
    stopped = eos or any(text.endswith(s) for s in stop or ())
    token_texts = decode_texts(text_tokenizer(tokenizer), [[t] for t in ids.tolist()])
    return Sampled(
        message=assistant_message(text, ids, responses.logprobs[0], responses.versions[0]),
        text=text,
        token_texts=token_texts,
        ended_with_eos=eos,
        hit_budget=not stopped and (capped or len(ids) >= budget),
        error=responses.errors[0],
    )
