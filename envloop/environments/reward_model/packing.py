"""Sequence packing for reward-model scoring: several conversations in one row.

:func:`plan_packed_rows` groups conversations into rows of at most ``max_tokens`` tokens
with a packing algorithm of :mod:`envloop.data.packing`. :func:`packed_row` lays one row out:
the conversations back to back (then pad tokens up to a multiple of ``round_to``), position
ids restarting at 0 for each, and a block-diagonal causal 4-D additive mask, so every token
attends only to earlier tokens of its own conversation. :func:`score_packed` runs the
model's body on each row and applies its score head at each conversation's own last token,
so a conversation scores what it scores alone (to float rounding).

The model must accept a custom 4-D additive attention mask (transformers' ``eager`` and
``sdpa`` attention do; see :func:`packing_problem`) and have its one-label head as
``model.score`` on top of ``model.base_model``, as transformers' decoder sequence
classifiers (Qwen, Llama, Mistral, ...) do. The mask holds L x L values per row, so keep
``logprob_mb_tokens`` moderate (8192 tokens: 128 MiB in bfloat16).
"""

from __future__ import annotations

from typing import Any

import torch

from envloop.data.packing import pack_sequences
from envloop.environments.reward_model.checks import round_up

PACKABLE_ATTENTION = ("eager", "sdpa")


def plan_packed_rows(
    lengths: list[int],
    max_tokens: int,
    algorithm: str = "modified_first_fit_decreasing",
    round_to: int = 1,
    order: str = "packer",
) -> list[list[int]]:
    """Indices of the conversations in each row; every row's rounded length <= ``max_tokens``.
    ``order="largest_first"`` runs the fullest rows first (scores do not depend on it).

    >>> plan_packed_rows([300, 900, 200, 600], max_tokens=1000, algorithm="first_fit_decreasing")
    [[1], [3, 0], [2]]
    >>> plan_packed_rows([3, 2, 9, 6], 12, "concatenative", order="largest_first")
    [[2], [3], [0, 1]]
    """
    capacity = max_tokens // round_to * round_to  # so a rounded-up row still fits
    rows = pack_sequences(lengths, capacity, algorithm)
    if order == "largest_first":
        rows.sort(key=lambda row: -sum(lengths[i] for i in row))
    return rows


def packed_row(
    sequences: list[list[int]], pad_id: int, round_to: int = 1, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(input_ids [1, L], position_ids [1, L], attention_mask [1, 1, L, L], last [n])`` of
    ``sequences`` packed into one row; ``last`` holds each sequence's last token index. The
    mask is 0 where attention is allowed, else the lowest ``dtype`` value.

    >>> ids, positions, mask, last = packed_row([[5, 6], [7]], pad_id=0, round_to=4)
    >>> ids.tolist(), positions.tolist(), last.tolist()
    ([[5, 6, 7, 0]], [[0, 1, 0, 0]], [1, 2])
    >>> (mask[0, 0] == 0).int().tolist()
    [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]
    """
    lengths = [len(s) for s in sequences]
    padding = round_up(sum(lengths), round_to) - sum(lengths)
    pieces = [*lengths, padding] if padding else lengths
    ids = [token for s in sequences for token in s] + [pad_id] * padding
    segment = torch.repeat_interleave(torch.arange(len(pieces)), torch.tensor(pieces))
    positions = torch.cat([torch.arange(n) for n in pieces])
    causal = torch.ones(len(ids), len(ids), dtype=torch.bool).tril()
    allowed = causal & (segment[:, None] == segment[None, :])
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    last = torch.tensor(lengths).cumsum(0) - 1
    return torch.tensor([ids]), positions[None], mask[None, None], last


def packing_problem(model: Any) -> str | None:
    """Why ``model`` cannot score packed rows exactly, or None when it can."""
    attention = getattr(model.config, "_attn_implementation", None)
    if attention not in PACKABLE_ATTENTION:
        return (
            f"its attention implementation {attention!r} ignores custom 4-D masks (packing "
            f"needs one of {', '.join(PACKABLE_ATTENTION)})"
        )
    if not isinstance(getattr(model, "score", None), torch.nn.Module):
        return f"{type(model).__name__} has no 'score' head on top of its base model"
    return None


@torch.inference_mode()
def score_packed(
    model: Any, sequences: list[list[int]], rows: list[list[int]], pad_id: int, round_to: int = 1
) -> torch.Tensor:
    """Scores [N] float32 of a one-label sequence classifier, one packed row per forward
    pass, in the order of ``sequences``; ``rows`` (from :func:`plan_packed_rows`) must
    cover every index once."""
    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    scores = torch.zeros(len(sequences), dtype=torch.float32)
    for row in rows:
        ids, positions, mask, last = packed_row(
            [sequences[i] for i in row], pad_id, round_to, dtype
        )
        hidden = model.base_model(
            input_ids=ids.to(device),
            position_ids=positions.to(device),
            attention_mask=mask.to(device),
            use_cache=False,
        ).last_hidden_state
        scores[torch.as_tensor(row)] = model.score(hidden[0, last.to(device)])[:, 0].float().cpu()
    return scores
