"""Column helpers of ``BatchedDataDict``: batch length of a column, concatenating columns."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

_SUPPORTED = "a list or a torch.Tensor"


def first_column_len(batch: Mapping[str, Any]) -> int:
    """Rows of ``batch`` as its first column tells (0 for no columns)."""
    for key, value in batch.items():
        return batch_len(key, value)
    return 0


def batch_len(key: str, value: Any) -> int:
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            raise ValueError(
                f"BatchedDataDict column {key!r} is a 0-d tensor; columns need a batch dimension."
            )
        return int(value.shape[0])
    if isinstance(value, list):
        return len(value)
    raise unsupported(key, value)


def unsupported(key: str, value: Any) -> TypeError:
    return TypeError(
        f"BatchedDataDict column {key!r} holds a {type(value).__name__}; it must be {_SUPPORTED}."
    )


def concat_column(key: str, values: list[Any], pad_value: int | float) -> Any:
    kinds = {type(v) for v in values}
    if all(isinstance(v, list) for v in values):
        return [item for v in values for item in v]
    if not all(isinstance(v, torch.Tensor) for v in values):
        names = sorted(k.__name__ for k in kinds)
        raise TypeError(f"from_batches: column {key!r} mixes value types {names}; {_SUPPORTED}.")
    dims = {v.dim() for v in values}
    if len(dims) != 1:
        raise ValueError(f"from_batches: column {key!r} mixes tensor ranks {sorted(dims)}.")
    if dims == {1}:
        return torch.cat(values, dim=0)
    trailing = {tuple(v.shape[2:]) for v in values}
    if len(trailing) != 1:
        raise ValueError(
            f"from_batches: column {key!r} has tensors whose dims after the sequence dim "
            f"differ: {sorted(trailing)}; only dim 1 may differ between batches."
        )
    width = max(v.shape[1] for v in values)
    first = values[0]
    out = torch.full(
        (sum(v.shape[0] for v in values), width, *first.shape[2:]),
        pad_value,
        dtype=first.dtype,
        device=first.device,
    )
    row = 0
    for v in values:
        out[row : row + v.shape[0], : v.shape[1]] = v
        row += v.shape[0]
    return out
