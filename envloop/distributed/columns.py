"""Column helpers of ``BatchedDataDict``: batch length of a column, concatenating columns,
and the deep copy of list entries that keeps image data shared
(``repeat_interleave(..., share_immutable_media=True)``)."""

from __future__ import annotations

import copy
import sys
from collections.abc import Mapping
from typing import Any

import torch

from envloop.distributed.packed_tensor import PackedTensor, common_dim_to_pack

_SUPPORTED = "a list, a torch.Tensor or a PackedTensor"


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
    if isinstance(value, (list, PackedTensor)):
        return len(value)
    raise unsupported(key, value)


def unsupported(key: str, value: Any) -> TypeError:
    return TypeError(
        f"BatchedDataDict column {key!r} holds a {type(value).__name__}; it must be {_SUPPORTED}."
    )


def deepcopy_sharing_images(
    item: Any, times: int, also_shared: Mapping[int, Any] | None = None
) -> list[Any]:
    """``times`` deep copies of ``item`` that share its image data: PIL images and encoded
    image buffers (``bytearray``, ``memoryview``; ``bytes`` are immutable and never copied)
    found in its dicts, lists and tuples are not copied, nor are the tensors of its
    deduplicated ``PackedTensor`` values (``PackedTensor.__deepcopy__``). Everything else
    (e.g. ``token_ids``, the content lists holding the images) is copied. ``also_shared``:
    more objects not to copy (id -> object, as ``media_sharing.prepare_media_sharing``
    gives)."""
    shared = {id(data): data for data in _image_data(item)}
    shared.update(also_shared or {})
    return [copy.deepcopy(item, dict(shared)) for _ in range(times)]


def _image_data(item: Any) -> list[Any]:
    """The PIL images and byte buffers held in ``item``'s nested dicts, lists and tuples."""
    pil = sys.modules.get("PIL.Image")  # not imported: no PIL image can exist
    kinds = (bytearray, memoryview) if pil is None else (bytearray, memoryview, pil.Image)
    found, stack = [], [item]
    while stack:
        value = stack.pop()
        if isinstance(value, kinds):
            found.append(value)
        elif isinstance(value, Mapping):
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
    return found


def concat_column(
    key: str, values: list[Any], pad_value: int | float, batch_ids: list[int] | None = None
) -> Any:
    """``key``'s values (one per batch; ``batch_ids`` their batch indices, for errors) joined."""
    kinds = {type(v) for v in values}
    if all(isinstance(v, list) for v in values):
        return [item for v in values for item in v]
    if any(isinstance(v, PackedTensor) for v in values):
        return _concat_packed(key, values, batch_ids or list(range(len(values))))
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


def _concat_packed(key: str, values: list[Any], batch_ids: list[int]) -> PackedTensor:
    """``PackedTensor.concat`` of one key's batches; every batch must hold a PackedTensor."""
    others = [i for i, v in enumerate(values) if not isinstance(v, PackedTensor)]
    if others:
        names = sorted({type(values[i]).__name__ for i in others})
        raise TypeError(
            f"from_batches: column {key!r} is a PackedTensor in some batches and a "
            f"{' / '.join(names)} in batches {[batch_ids[i] for i in others]}. Give it as a "
            "PackedTensor in every batch; a batch whose samples lack this input holds "
            "PackedTensor([None] * rows, dim_to_pack)."
        )
    common_dim_to_pack(values, key)
    return PackedTensor.concat(values)
