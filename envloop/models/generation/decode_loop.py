"""A token-by-token decode loop over a KV cache for one micro-batch of prompts.

Prompts are left-padded inside the loop (position ids come from the attention mask, so
padding changes nothing), one token per unfinished sample is chosen per step, and samples
that finish are dropped from the batch and from the cache.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from envloop.models.generation.sampling import choose_tokens, sampling_logprobs
from envloop.models.generation.stop_strings import stop_string_hits


@dataclass(frozen=True)
class DecodeSettings:
    """How tokens are chosen and when a sample stops."""

    temperature: float
    """Logits are divided by it before filtering."""
    top_k: int | None
    """Keep the ``top_k`` most likely tokens; None keeps all."""
    top_p: float
    """Keep the smallest most-likely set with at least this probability mass."""
    greedy: bool
    """Take the argmax of the filtered distribution instead of sampling from it."""
    eos_ids: frozenset[int]
    """Token ids that end a sample (kept in its output)."""
    pad_id: int
    """Token id used for left padding."""


@dataclass
class SampleResult:
    """What one sample generated."""

    tokens: list[int] = field(default_factory=list)
    """Generated token ids, an ending EOS included."""
    logprobs: list[float] = field(default_factory=list)
    """Log-probability of each generated token (see ``sampling_logprobs``)."""
    truncated: bool = False
    """True when the sample stopped at its token budget rather than at EOS or a stop string."""


@torch.no_grad()
def decode(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[torch.Tensor],
    budgets: Sequence[int],
    stop_strings: Sequence[list[str] | None],
    settings: DecodeSettings,
    generator: torch.Generator | None,
    on_step: Callable[[int], None] | None = None,
) -> list[SampleResult]:
    """Generate for each 1-D prompt until EOS, one of its stop strings, or its budget.

    A budget of 0 yields no tokens (and ``truncated=True``). ``on_step``, when given, is
    called after every step with the number of tokens it generated (one per unfinished
    sample).
    """
    results = [SampleResult(truncated=budget == 0) for budget in budgets]
    active = [i for i, budget in enumerate(budgets) if budget > 0]
    if not active:
        return results
    input_ids, mask = _left_pad([prompts[i] for i in active], settings.pad_id, model.device)
    cache = DynamicCache(config=model.config)
    logits = _next_token_logits(model, input_ids, mask, cache)
    while True:
        logprobs = sampling_logprobs(logits, settings.temperature, settings.top_k, settings.top_p)
        tokens, token_logprobs = choose_tokens(logprobs, settings.greedy, generator)
        _append(results, active, tokens, token_logprobs)
        if on_step is not None:
            on_step(len(active))
        finished = _finished(results, active, budgets, stop_strings, settings.eos_ids, tokenizer)
        keep = [k for k, done in enumerate(finished) if not done]
        if not keep:
            return results
        if len(keep) < len(active):
            index = torch.tensor(keep, device=mask.device)
            cache.batch_select_indices(index)
            mask, tokens = mask[index], tokens[index]
            active = [active[k] for k in keep]
        mask = torch.cat([mask, mask.new_ones(len(active), 1)], dim=1)
        logits = _next_token_logits(model, tokens.unsqueeze(-1), mask, cache)


def _left_pad(
    prompts: Sequence[torch.Tensor], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids [b, W] and attention mask [b, W] (1 at real tokens)."""
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = prompt
        mask[row, width - len(prompt) :] = 1
    return input_ids.to(device), mask.to(device)


def _next_token_logits(
    model: Any, input_ids: torch.Tensor, mask: torch.Tensor, cache: DynamicCache
) -> torch.Tensor:
    """Logits [b, V] after ``input_ids`` [b, n], the last n columns of ``mask``; fills ``cache``."""
    positions = (mask.cumsum(dim=-1) - 1).clamp(min=0)[:, -input_ids.shape[1] :]
    out = model(
        input_ids=input_ids,
        attention_mask=mask,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    return out.logits[:, -1, :]


def _append(
    results: list[SampleResult],
    active: list[int],
    tokens: torch.Tensor,
    token_logprobs: torch.Tensor,
) -> None:
    for sample, token, logprob in zip(active, tokens.tolist(), token_logprobs.tolist()):
        results[sample].tokens.append(token)
        results[sample].logprobs.append(logprob)


def _finished(
    results: list[SampleResult],
    active: list[int],
    budgets: Sequence[int],
    stop_strings: Sequence[list[str] | None],
    eos_ids: frozenset[int],
    tokenizer: Any,
) -> list[bool]:
    """Per active sample, whether its newest token ended it; marks budget stops truncated."""
    done = [results[i].tokens[-1] in eos_ids for i in active]
    check = [k for k, i in enumerate(active) if stop_strings[i] and not done[k]]
    if check:
        tokens = [results[active[k]].tokens for k in check]
        stops = [stop_strings[active[k]] or [] for k in check]
        for k, hit in zip(check, stop_string_hits(tokenizer, tokens, stops)):
            done[k] = hit
    for k, i in enumerate(active):
        if not done[k] and len(results[i].tokens) >= budgets[i]:
            done[k] = results[i].truncated = True
    return done
