"""Judge calls: prompts to the judge's generation backend and its replies back, with the
counts the environment reports.

One :class:`JudgeClient` holds the backend (``HfGeneration`` in this process, whose decode
loop batches the rows of concurrent calls continuously, or ``ServerGeneration``, whose
requests from concurrent calls go out together) and sends every prompt's judgements as rows
of one ``generate_async`` call.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.environments.reward_model.batching import pad_sequences

__all__ = ["JudgeClient", "JudgeCounts", "Reply", "make_backend"]


@dataclass(frozen=True)
class Reply:
    """One judgement: the judge's text, or why there is none (``error``: the prompt was too
    long, or the backend failed); ``truncated`` when it stopped at its token budget."""

    text: str = ""
    error: str | None = None
    truncated: bool = False


@dataclass
class JudgeCounts:
    """What the judge did since the counts were last taken."""

    calls: int = 0
    judgements: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    latencies_s: list[float] = field(default_factory=list)
    failed: int = 0  # judgements the backend could not give
    truncated: int = 0


def make_backend(judge: Any) -> Any:
    """The generation backend of a validated ``judge`` section (``backend`` hf or server)."""
    if judge.backend == "server":
        from envloop.models.generation.server_generation import ServerGeneration

        return ServerGeneration(judge)
    from envloop.models.generation.hf_generation import HfGeneration

    return HfGeneration(judge)


class JudgeClient:
    """Sends judge prompts to ``backend`` (see the module docstring)."""

    def __init__(self, backend: Any, greedy: bool, max_prompt_tokens: int) -> None:
        self.backend, self.greedy, self.max_prompt_tokens = backend, greedy, max_prompt_tokens
        self.tokenizer = backend.tokenizer
        self.counts = JudgeCounts()

    def encode(self, prompt: str) -> list[int]:
        """Token ids of a judge prompt: one user message, the chat template's generation
        prompt after it."""
        messages = [{"role": "user", "content": prompt}]
        text = self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    async def judge(self, prompt: str, n: int) -> list[Reply]:
        """``n`` judgements of ``prompt`` (rows of one backend call), in row order."""
        ids = self.encode(prompt)
        if len(ids) > self.max_prompt_tokens:
            why = (
                f"judge prompt has {len(ids)} tokens, over max_prompt_tokens="
                f"{self.max_prompt_tokens}; raise it or shorten the template"
            )
            return [Reply(error=why)] * n
        input_ids, _ = pad_sequences([ids] * n, self.backend.pad_id)
        data: BatchedDataDict[Any] = BatchedDataDict(
            input_ids=input_ids, input_lengths=torch.full((n,), len(ids), dtype=torch.long)
        )
        replies: list[Reply] = [Reply(error="judge gave no reply")] * n
        started = time.monotonic()
        self.counts.calls += 1
        try:
            async for row, output in self.backend.generate_async(data, greedy=self.greedy):
                replies[row] = self._reply(output)
        except Exception as exc:  # the backend failed: every judgement of this prompt fails
            why = f"judge failed: {type(exc).__name__}: {exc}"
            replies = [r if r.error is None else Reply(error=why) for r in replies]
        self.counts.latencies_s.append(time.monotonic() - started)
        self.counts.judgements += n
        self.counts.prompt_tokens += len(ids) * n
        self.counts.failed += sum(r.error is not None for r in replies)
        self.counts.truncated += sum(r.truncated for r in replies)
        return replies

    def _reply(self, output: Any) -> Reply:
        """A one-row output as a :class:`Reply` (decoded without special tokens)."""
        errors = output.get("generation_error")
        if errors and errors[0] is not None:
            return Reply(error=f"judge failed: {errors[0]}")
        start = int(output["unpadded_sequence_lengths"][0] - output["generation_lengths"][0])
        length = int(output["generation_lengths"][0])
        self.counts.generated_tokens += length
        tokens = output["output_ids"][0, start : start + length].tolist()
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        truncated = output.get("truncated")
        return Reply(text=text, truncated=bool(truncated[0]) if truncated is not None else False)

    def take_counts(self) -> JudgeCounts:
        """The counts so far, then start new ones."""
        counts, self.counts = self.counts, JudgeCounts()
        return counts

    def shutdown(self) -> None:
        self.backend.shutdown()
