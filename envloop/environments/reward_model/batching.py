"""Batching for reward-model scoring: plan batches, pad them, score, restore input order.

Two plans. Fixed: consecutive chunks of ``batch_size`` in input order. Dynamic: sequences
sorted longest first and packed greedily, each batch holding at most ``batch_size`` rows and
at most ``max_tokens`` padded tokens (rows x its longest sequence rounded up to ``round_to``),
so short conversations are no longer padded to a long neighbour's length. Either way the
scores come back in input order and, thanks to the attention mask and per-row position ids,
do not depend on the plan. (Packed rows: :mod:`reward_model_packing`.)
"""

from __future__ import annotations

from typing import Any

import torch

from envloop.environments.reward_model.checks import round_up


def plan_batches(
    lengths: list[int], batch_size: int, max_tokens: int | None = None, round_to: int = 1
) -> list[list[int]]:
    """Indices of each batch. ``max_tokens=None``: fixed order; else length-sorted packing.

    >>> plan_batches([5, 1, 9, 2], batch_size=2)
    [[0, 1], [2, 3]]
    >>> plan_batches([5, 1, 9, 2], batch_size=3, max_tokens=10)
    [[2], [0, 3], [1]]
    >>> plan_batches([5, 1, 9, 2], batch_size=3, max_tokens=16, round_to=8)
    [[2], [0, 3], [1]]
    """
    if max_tokens is None:
        return [
            list(range(i, min(i + batch_size, len(lengths))))
            for i in range(0, len(lengths), batch_size)
        ]
    batches: list[list[int]] = []
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        current = batches[-1] if batches else []
        # Sorted longest first, so a batch's first row sets its padded length.
        fits = current and len(current) < batch_size
        if fits and (len(current) + 1) * round_up(lengths[current[0]], round_to) <= max_tokens:
            current.append(index)
        else:
            batches.append([index])
    return batches


def pad_sequences(
    sequences: list[list[int]], pad_id: int, side: str = "right", round_to: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` [b, L] and ``attention_mask`` [b, L] (int64), padded on ``side``;
    L is the longest sequence rounded up to a multiple of ``round_to``.

    >>> ids, mask = pad_sequences([[7, 8], [9]], pad_id=0, side="left")
    >>> ids.tolist(), mask.tolist()
    ([[7, 8], [0, 9]], [[1, 1], [0, 1]])
    >>> pad_sequences([[7, 8, 9]], pad_id=0, round_to=4)[0].tolist()
    [[7, 8, 9, 0]]
    """
    longest = round_up(max((len(s) for s in sequences), default=0), round_to)
    ids = torch.full((len(sequences), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sequences), longest), dtype=torch.long)
    for row, seq in enumerate(sequences):
        cols = slice(longest - len(seq), longest) if side == "left" else slice(0, len(seq))
        ids[row, cols] = torch.as_tensor(seq, dtype=torch.long)
        mask[row, cols] = 1
    return ids, mask


@torch.inference_mode()
def score_sequences(
    model: Any,
    sequences: list[list[int]],
    batches: list[list[int]],
    pad_id: int,
    side: str = "right",
    round_to: int = 1,
) -> torch.Tensor:
    """Scores [N] float32 of a one-label sequence classifier, in the order of ``sequences``.

    ``batches`` (from :func:`plan_batches`) must cover every index once; each is padded to
    its longest sequence rounded up to ``round_to``. The model picks each row's last non-pad
    token itself (``config.pad_token_id`` must equal ``pad_id``).
    """
    device = next(model.parameters()).device
    scores = torch.zeros(len(sequences), dtype=torch.float32)
    for batch in batches:
        ids, mask = pad_sequences([sequences[i] for i in batch], pad_id, side, round_to)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = model(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            position_ids=positions.to(device),
        ).logits
        scores[torch.as_tensor(batch)] = logits[:, 0].float().cpu()
    return scores
