"""A policy that replays scripted text, tokenized for real: for testing environments and engines.

It behaves like a model at the token level: it honours per-sample stop strings (cutting
the response right after the first one), appends EOS otherwise, and respects per-sample
token budgets; generation costs nothing, so rollouts driven by it measure the engine alone.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.models.generation.interfaces import (
    GenerationDatumSpec,
    GenerationInterface,
    GenerationOutputSpec,
)
from envloop.models.generation.policy_versions import next_policy_version


class ScriptedGeneration(GenerationInterface):
    """Responds to each prompt with ``respond(prompt_text)``.

    Args:
        tokenizer: tokenizes responses; its ``pad_token_id`` pads and ``eos_token_id`` ends
            responses not stopped by a stop string.
        respond: maps the decoded prompt (the whole conversation so far) to response text.
        logprob: the log-probability reported for every generated token.

    ``calls`` records each ``generate`` call's stop strings, for tests.

    Its "weights" are the script: :meth:`update_weights` takes a new ``respond`` function,
    and every token it generates from then on carries the new policy version in
    ``policy_versions``.
    """

    def __init__(
        self, tokenizer: Any, respond: Callable[[str], str], logprob: float = -1.0
    ) -> None:
        self.tokenizer = tokenizer
        self.logprob = logprob
        self.calls: list[list[list[str] | None]] = []
        self._script = (respond, 0)  # replaced whole, so a call reads a matching pair

    @property
    def respond(self) -> Callable[[str], str]:
        """The current script: decoded prompt -> response text."""
        return self._script[0]

    @property
    def policy_version(self) -> int:
        return self._script[1]

    def update_weights(self, weights: Any, *, version: int | None = None) -> int:
        """Respond with ``weights`` (a function: decoded prompt -> response text) from now
        on, as policy version ``version`` (None: the next one)."""
        if not callable(weights):
            raise TypeError(
                f"ScriptedGeneration.update_weights takes the new respond function (decoded "
                f"prompt -> response text), got {type(weights).__name__}."
            )
        self._script = (weights, next_policy_version(self._script[1], version))
        return self._script[1]

    def generate(
        self, data: BatchedDataDict[GenerationDatumSpec], greedy: bool = False
    ) -> BatchedDataDict[GenerationOutputSpec]:
        respond, version = self._script  # the weights of this whole call
        input_ids, lengths = data["input_ids"], data["input_lengths"].tolist()
        n = len(lengths)
        stop_strings = data.get("stop_strings") or [None] * n
        budgets = data.get("max_new_tokens")
        budget_list = budgets.tolist() if budgets is not None else [None] * n
        self.calls.append(list(stop_strings))
        prompts = self.tokenizer.batch_decode(
            [row[:length] for row, length in zip(input_ids.tolist(), lengths)],
            skip_special_tokens=False,
        )
        texts = [_cut_at_stop(respond(p), s) for p, s in zip(prompts, stop_strings)]
        encoded = self.tokenizer([t for t, _ in texts], add_special_tokens=False)["input_ids"]
        generated, truncated = [], []
        for ids, (_, stopped), budget in zip(encoded, texts, budget_list):
            ids = ids if stopped else [*ids, self.tokenizer.eos_token_id]
            truncated.append(budget is not None and len(ids) > budget)
            generated.append(ids[:budget] if budget is not None else ids)
        return self._pack(input_ids, lengths, generated, truncated, version)

    def _pack(
        self,
        input_ids: torch.Tensor,
        lengths: list[int],
        generated: list[list[int]],
        truncated: list[bool],
        version: int,
    ) -> BatchedDataDict[GenerationOutputSpec]:
        gen_lengths = [len(g) for g in generated]
        width = max([a + b for a, b in zip(lengths, gen_lengths)], default=0)
        output_ids = torch.full((len(lengths), width), self.tokenizer.pad_token_id)
        logprobs = torch.zeros((len(lengths), width), dtype=torch.float32)
        for i, (length, ids) in enumerate(zip(lengths, generated)):
            output_ids[i, :length] = input_ids[i, :length]
            output_ids[i, length : length + len(ids)] = torch.tensor(ids, dtype=torch.long)
            logprobs[i, length : length + len(ids)] = self.logprob
        gen = torch.tensor(gen_lengths, dtype=torch.long)
        positions = torch.arange(width)
        starts = torch.tensor(lengths, dtype=torch.long)[:, None]
        generated_at = (positions >= starts) & (positions < starts + gen[:, None])
        versions = generated_at.to(torch.int32) * version
        return BatchedDataDict(
            output_ids=output_ids,
            logprobs=logprobs,
            policy_versions=versions,
            generation_lengths=gen,
            unpadded_sequence_lengths=torch.tensor(lengths, dtype=torch.long) + gen,
            truncated=torch.tensor(truncated, dtype=torch.bool),
        )


def _cut_at_stop(text: str, stop_strings: list[str] | None) -> tuple[str, bool]:
    """``text`` up to and including its earliest stop string, and whether one was found.

    >>> _cut_at_stop("a <call>1+1</call> tail", ["</call>"])
    ('a <call>1+1</call>', True)
    >>> _cut_at_stop("no stop", ["</call>"])
    ('no stop', False)
    """
    ends = [text.find(s) + len(s) for s in stop_strings or () if s in text]
    return (text[: min(ends)], True) if ends else (text, False)
