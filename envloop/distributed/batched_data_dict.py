"""``BatchedDataDict``: a dict of per-sample columns that share the batch dimension."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Generic, TypeVar

import torch

DictT = TypeVar("DictT", bound=Mapping[str, Any])

_SUPPORTED = "a list or a torch.Tensor"


class BatchedDataDict(dict, Generic[DictT]):
    """A ``dict`` of ``key -> list | Tensor`` whose values share the leading (batch) dimension.

    The type parameter names the TypedDict describing the columns, e.g.
    ``BatchedDataDict[GenerationOutputSpec]``; it is for readers and type checkers only.

    >>> b = BatchedDataDict({"x": torch.tensor([1, 2, 3]), "name": ["a", "b", "c"]})
    >>> b.size
    3
    >>> b.select_indices([2, 0])["name"]
    ['c', 'a']
    >>> b.slice(1, 3)["x"].tolist()
    [2, 3]
    """

    @property
    def size(self) -> int:
        """The batch size; 0 for an empty dict. Raises if columns disagree."""
        sizes = {key: _batch_len(key, value) for key, value in self.items()}
        if not sizes:
            return 0
        first_key, first = next(iter(sizes.items()))
        for key, n in sizes.items():
            if n != first:
                raise ValueError(
                    f"BatchedDataDict columns disagree on batch size: {first_key!r} has "
                    f"{first}, {key!r} has {n}. Every column must have one entry per sample."
                )
        return first

    def copy(self) -> BatchedDataDict[DictT]:
        """A new dict holding the same value objects (a shallow copy)."""
        return type(self)(self)

    def get_dict(self) -> dict[str, Any]:
        """The columns as a plain ``dict``."""
        return dict(self)

    def select_indices(self, indices: Sequence[int] | torch.Tensor) -> BatchedDataDict[DictT]:
        """Rows ``indices`` (a list or 1-D integer tensor), in that order; repeats allowed."""
        if isinstance(indices, torch.Tensor):
            if indices.dim() != 1:
                raise ValueError(
                    f"select_indices takes a 1-D index tensor, got shape {tuple(indices.shape)}."
                )
            index_list = indices.tolist()
            index_tensor = indices.long()
        else:
            index_list = list(indices)
            index_tensor = torch.as_tensor(index_list, dtype=torch.long)
        out: BatchedDataDict[DictT] = type(self)()
        for key, value in self.items():
            if isinstance(value, torch.Tensor):
                # Advanced indexing (not index_select) so negative indices mean what they
                # mean for list columns.
                out[key] = value[index_tensor.to(value.device)]
            elif isinstance(value, list):
                out[key] = [value[i] for i in index_list]
            else:
                raise _unsupported(key, value)
        return out

    def slice(self, start: int, end: int) -> BatchedDataDict[DictT]:
        """Rows ``start:end`` (views of tensors, new lists)."""
        out: BatchedDataDict[DictT] = type(self)()
        for key, value in self.items():
            _batch_len(key, value)
            out[key] = value[start:end]
        return out

    def repeat_interleave(self, num_repeats: int) -> BatchedDataDict[DictT]:
        """Each row repeated ``num_repeats`` times in place (``a a b b``), e.g. for GRPO groups.

        List entries are deep-copied per repeat, so repeated samples never share mutable state.
        """
        if num_repeats < 1:
            raise ValueError(f"repeat_interleave needs num_repeats >= 1, got {num_repeats}.")
        out: BatchedDataDict[DictT] = type(self)()
        for key, value in self.items():
            if isinstance(value, torch.Tensor):
                out[key] = value.repeat_interleave(num_repeats, dim=0)
            elif isinstance(value, list):
                out[key] = [copy.deepcopy(item) for item in value for _ in range(num_repeats)]
            else:
                raise _unsupported(key, value)
        return out

    def shard_by_batch_size(
        self, shards: int, batch_size: int | None = None
    ) -> list[BatchedDataDict[DictT]]:
        """Split into ``shards`` contiguous, near-equal parts (the first ones get the remainder).

        With ``batch_size``, the batch is first cut into chunks of ``batch_size`` rows (the size
        must divide evenly), and each chunk is sharded; shard ``s`` holds its part of every
        chunk, in order. Shards may be empty when there are more shards than rows.
        """
        if shards < 1:
            raise ValueError(f"shard_by_batch_size needs shards >= 1, got {shards}.")
        total = self.size
        if batch_size is None:
            return [self.select_indices(idx) for idx in _contiguous_parts(range(total), shards)]
        if batch_size < 1 or total % batch_size != 0:
            raise ValueError(
                f"shard_by_batch_size: batch_size={batch_size} must be >= 1 and divide the "
                f"batch size {total}."
            )
        per_shard: list[list[int]] = [[] for _ in range(shards)]
        for start in range(0, total, batch_size):
            chunk = range(start, start + batch_size)
            for shard, part in zip(per_shard, _contiguous_parts(chunk, shards)):
                shard.extend(part)
        return [self.select_indices(idx) for idx in per_shard]

    @classmethod
    def from_batches(
        cls,
        batches: Sequence[Mapping[str, Any]],
        pad_value_dict: Mapping[str, int | float] | None = None,
    ) -> BatchedDataDict[Any]:
        """Concatenate batches along the batch dimension.

        Lists concatenate; 1-D tensors concatenate; 2-D and higher tensors are right-padded
        along dim 1 to the longest, with ``pad_value_dict[key]`` (default 0).

        >>> a = {"ids": torch.tensor([[1, 2]]), "n": [2]}
        >>> b = {"ids": torch.tensor([[3, 4, 5]]), "n": [3]}
        >>> BatchedDataDict.from_batches([a, b], {"ids": -1})["ids"].tolist()
        [[1, 2, -1], [3, 4, 5]]
        """
        pad_values = dict(pad_value_dict or {})
        if not batches:
            return cls()
        keys = list(batches[0].keys())
        for i, batch in enumerate(batches):
            if set(batch.keys()) != set(keys):
                missing = sorted(set(keys) ^ set(batch.keys()))
                raise ValueError(
                    f"from_batches: batch {i} does not have the same keys as batch 0 "
                    f"(differing keys: {missing}). Every batch needs every key."
                )
            sizes = {key: _batch_len(key, batch[key]) for key in keys}
            if len(set(sizes.values())) > 1:
                raise ValueError(f"from_batches: batch {i} has mismatched column sizes {sizes}.")
        out: BatchedDataDict[Any] = cls()
        for key in keys:
            out[key] = _concat_column(
                key, [batch[key] for batch in batches], pad_values.get(key, 0)
            )
        return out

    def to(self, device: str | torch.device) -> BatchedDataDict[DictT]:
        """Move every tensor to ``device`` in place; returns self for chaining."""
        for key, value in self.items():
            if isinstance(value, torch.Tensor):
                self[key] = value.to(device)
        return self


def _batch_len(key: str, value: Any) -> int:
    if isinstance(value, torch.Tensor):
        if value.dim() == 0:
            raise ValueError(
                f"BatchedDataDict column {key!r} is a 0-d tensor; columns need a batch dimension."
            )
        return int(value.shape[0])
    if isinstance(value, list):
        return len(value)
    raise _unsupported(key, value)


def _unsupported(key: str, value: Any) -> TypeError:
    return TypeError(
        f"BatchedDataDict column {key!r} holds a {type(value).__name__}; it must be {_SUPPORTED}."
    )


def _contiguous_parts(indices: Iterable[int], parts: int) -> list[list[int]]:
    items = list(indices)
    base, extra = divmod(len(items), parts)
    out, start = [], 0
    for p in range(parts):
        end = start + base + (1 if p < extra else 0)
        out.append(items[start:end])
        start = end
    return out


def _concat_column(key: str, values: list[Any], pad_value: int | float) -> Any:
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
    width = max(v.shape[1] for v in values)
    padded = [
        torch.nn.functional.pad(
            v, (0, 0) * (v.dim() - 2) + (0, width - v.shape[1]), value=pad_value
        )
        if v.shape[1] < width
        else v
        for v in values
    ]
    return torch.cat(padded, dim=0)
