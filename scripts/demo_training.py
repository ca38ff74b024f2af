"""The training loop the demo policies share (``train_demo_policy.py``,
``train_demo_vlm_policy.py``): seeded data in, the same optimizer and schedule every time."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch

Batch = TypeVar("Batch")


def train(
    model: Any,
    batch_stream: Iterator[tuple[str, Batch]],
    steps: int,
    lr: float,
    loss_of: Callable[[Batch], torch.Tensor],
    on_log: Callable[[int, dict[str, float]], None],
) -> None:
    """``steps`` steps of AdamW on ``loss_of(batch)`` for the ``(kind, batch)`` pairs of
    ``batch_stream``, with linear warm-up and cosine decay to a tenth of ``lr``, gradients
    clipped to norm 1; ``on_log(step, mean loss per kind)`` every 100 steps and at the end."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.98), weight_decay=0.01)
    warmup = max(steps // 30, 1)

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / (steps - warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    model.train()
    running: dict[str, list[float]] = {}
    for step in range(steps):
        kind, batch = next(batch_stream)
        loss = loss_of(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        running.setdefault(kind, []).append(loss.item())
        if (step + 1) % 100 == 0 or step + 1 == steps:
            on_log(step + 1, {k: sum(v) / len(v) for k, v in running.items()})
            running = {}
    model.eval()
