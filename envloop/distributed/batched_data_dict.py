"""``BatchedDataDict``: a dict of per-sample columns that share the batch dimension.

Sharding plans live in ``sharding`` and micro-batch iteration in ``microbatches``; this
module holds the dict and its row and column operations.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Generic, TypeVar, overload

import torch
from typing_extensions import Self

from envloop.distributed.columns import (
    batch_len,
    concat_column,
    deepcopy_sharing_images,
    first_column_len,
    unsupported,
)
from envloop.distributed.media_sharing import NATIVE_MULTIMODAL_KEYS, prepare_media_sharing
from envloop.distributed.microbatches import MicroBatchMixin
from envloop.distributed.model_inputs import (
    OPTIONAL_MODEL_INPUT_KEYS,
    PIXEL_DTYPE_CAST_KEYS,
    multimodal_inputs,
)
from envloop.distributed.packed_tensor import PackedTensor
from envloop.distributed.sharding import (
    BatchSplitError,
    DynamicBatchingArgs,
    SequencePackingArgs,
    ShardPlan,
    check_split,
    dynamic_plan,
    packing_plan,
    plain_plan,
)

__all__ = [
    "BatchSplitError",
    "BatchedDataDict",
    "DynamicBatchingArgs",
    "MissingKeyError",
    "SequencePackingArgs",
    "SlicedDataDict",
]

DictT = TypeVar("DictT", bound=Mapping[str, Any])


class MissingKeyError(KeyError, ValueError):
    """``from_batches``: a non-empty batch lacks a key another batch has (also a ValueError)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class BatchedDataDict(MicroBatchMixin, dict, Generic[DictT]):
    """A ``dict`` of ``key -> list | Tensor | PackedTensor`` whose values share the leading
    (batch) dimension.

    A ``PackedTensor`` column holds one item per sample (e.g. a sample's image patches,
    None for a sample without images); row operations move its items without copying them.

    The type parameter names the TypedDict describing the columns, e.g.
    ``BatchedDataDict[GenerationOutputSpec]``; it is for readers and type checkers only.
    ``data`` is the dict itself (the published class wrapped a ``UserDict``), and shards
    made for dynamic batching or sequence packing carry micro-batch metadata (see
    ``envloop.distributed.microbatches``).

    >>> b = BatchedDataDict({"x": torch.tensor([1, 2, 3]), "name": ["a", "b", "c"]})
    >>> b.size
    3
    >>> b.select_indices([2, 0])["name"]
    ['c', 'a']
    >>> b.slice(1, 3)["x"].tolist()
    [2, 3]
    """

    ADDITIONAL_OPTIONAL_KEY_TENSORS: ClassVar[list[str]] = list(OPTIONAL_MODEL_INPUT_KEYS)
    """Per-token tensors that ``get_multimodal_dict`` returns beside the PackedTensors."""
    _PIXEL_DTYPE_CAST_KEYS = PIXEL_DTYPE_CAST_KEYS

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._clear_micro_batches()

    @property
    def data(self) -> Self:
        """The dict itself, for code written against the published ``UserDict`` version."""
        return self

    @property
    def size(self) -> int:
        """The batch size; 0 for an empty dict. Raises ``BatchSplitError`` if columns disagree."""
        return self._checked_size()

    def __repr__(self) -> str:
        """One line per column: its type and shape, never its values (a batch of message
        logs formats to megabytes; ``asyncio.run`` formats its result's repr on some Python
        versions). ``dict(batch)`` shows the values.

        >>> pixels = PackedTensor([torch.zeros(4, 6), None], dim_to_pack=0)
        >>> BatchedDataDict({"x": torch.zeros(2, 3), "name": ["a", "b"], "pixels": pixels})
        BatchedDataDict(
          x: Tensor[2, 3] float32,
          name: list[2],
          pixels: PackedTensor[2, 1 present] float32,
        )
        """
        if not self:
            return "BatchedDataDict()"
        lines = [f"  {key}: {_column_summary(value)}," for key, value in self.items()]
        return "BatchedDataDict(\n" + "\n".join(lines) + "\n)"

    def copy(self) -> Self:
        """A new dict holding the same value objects (a shallow copy) and micro-batch metadata."""
        out = type(self)(self)
        self._copy_micro_batches_to(out)
        return out

    def get_dict(self) -> dict[str, Any]:
        """The columns as a plain ``dict``."""
        return dict(self)

    def get_multimodal_dict(
        self,
        as_tensors: bool = False,
        device: str | torch.device | None = None,
        pixel_dtype: torch.dtype | None = None,
    ) -> dict[str, Any]:
        """The multimodal model inputs: every ``PackedTensor`` column (packed into one tensor,
        ``as_tensor(device)``, if ``as_tensors``; e.g. ``pixel_values`` [sum of patches, D])
        and the ``token_type_ids`` / ``mm_token_type_ids`` [B, L] tensors if present.

        ``pixel_dtype`` casts ``pixel_values`` and ``pixel_values_videos`` (each stored
        segment once). With ``as_tensors``, deduplicated coupled columns (``pixel_values``
        and ``image_grid_thw``, ...) must agree in segments per row (``ValueError``).

        >>> b = BatchedDataDict({"input_ids": torch.zeros(2, 3, dtype=torch.long),
        ...     "pixel_values": PackedTensor([torch.ones(4, 6), torch.ones(2, 6)], 0)})
        >>> {k: tuple(v.shape) for k, v in b.get_multimodal_dict(as_tensors=True).items()}
        {'pixel_values': (6, 6)}
        """
        return multimodal_inputs(self, as_tensors, device, pixel_dtype)

    def select_indices(self, indices: Sequence[int] | torch.Tensor) -> Self:
        """Rows ``indices`` (a list or 1-D integer tensor), in that order; repeats allowed.

        The result has no micro-batch metadata (rows moved)."""
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
        out = type(self)()
        for key, value in self.items():
            if isinstance(value, torch.Tensor):
                # Advanced indexing (not index_select) so negative indices mean what they
                # mean for list columns.
                out[key] = value[index_tensor.to(value.device)]
            elif isinstance(value, list):
                out[key] = [value[i] for i in index_list]
            elif isinstance(value, PackedTensor):
                out[key] = value.slice(index_list)
            else:
                raise unsupported(key, value)
        return out

    def slice(self, start: int, end: int) -> Self:
        """Rows ``start:end`` (views of tensors, new lists and PackedTensors of the same
        items), without micro-batch metadata."""
        out = type(self)()
        for key, value in self.items():
            batch_len(key, value)
            if isinstance(value, PackedTensor):
                out[key] = value.slice(slice(start, end))
            else:
                out[key] = value[start:end]
        return out

    def repeat_interleave(self, num_repeats: int, *, share_immutable_media: bool = False) -> Self:
        """Each row repeated ``num_repeats`` times in place (``a a b b``), e.g. for GRPO groups.

        Tensor columns are repeated along dim 0; list entries are deep-copied per repeat, so
        repeated samples never share mutable state, media included (as published).

        ``share_immutable_media=True``: the repeats share their media instead (the lists,
        dicts and messages around it are still copied, so repeats can diverge). Every
        ``PackedTensor`` in the rows gets deduplication enabled (in place; its rows do not
        change), so the repeats hold the same tensor objects and flattening, sharding and
        joining their logs keep one stored copy per image; raw media leaves are shared where
        a row names them as media (under ``vllm_images`` / ``vllm_videos`` /
        ``vllm_audios`` / ``vllm_content``, or in image, video and audio content parts), and
        so are PIL images and encoded image buffers anywhere in the rows. Use it for GRPO
        groups of vision-language prompts: a group of ``n`` then holds each image once.

        Raises ``NotImplementedError`` for a ``PackedTensor`` column, as published.

        >>> pixels = PackedTensor(torch.ones(4, 3), dim_to_pack=0)
        >>> logs = [[{"role": "user", "pixel_values": pixels}], [{"role": "user"}]]
        >>> plain = BatchedDataDict({"message_log": logs}).repeat_interleave(2)
        >>> plain["message_log"][1][0]["pixel_values"][0] is pixels[0]
        False
        >>> shared = BatchedDataDict({"message_log": logs}).repeat_interleave(
        ...     2, share_immutable_media=True)
        >>> shared["message_log"][1] is shared["message_log"][0]
        False
        >>> shared["message_log"][1][0]["pixel_values"][0] is pixels[0]
        True
        """
        if num_repeats < 1:
            raise ValueError(f"repeat_interleave needs num_repeats >= 1, got {num_repeats}.")
        packed = [key for key, value in self.items() if isinstance(value, PackedTensor)]
        if packed:
            raise NotImplementedError(
                f"PackedTensor does not currently support repeat_interleave (column "
                f"{packed[0]!r}). Keep vision inputs in the message logs (one PackedTensor per "
                "message, as get_formatted_message_log stores them) and repeat the batch with "
                "share_immutable_media=True, or repeat the column's rows yourself: "
                f"batch[{packed[0]!r}].repeat_interleave(n) shares their tensors."
            )
        out = type(self)()
        for key, value in self.items():
            if isinstance(value, torch.Tensor):
                out[key] = value.repeat_interleave(num_repeats, dim=0)
            elif isinstance(value, list):
                out[key] = [
                    repeat
                    for item in value
                    for repeat in _repeated(
                        item, num_repeats, share_immutable_media, key in NATIVE_MULTIMODAL_KEYS
                    )
                ]
            else:
                raise unsupported(key, value)
        return out

    @overload
    def shard_by_batch_size(
        self,
        shards: int,
        batch_size: int | None = None,
        allow_uneven_shards: bool = False,
        dynamic_batching_args: None = None,
        sequence_packing_args: None = None,
    ) -> list[BatchedDataDict[Any]]: ...

    @overload
    def shard_by_batch_size(
        self,
        shards: int,
        batch_size: int | None = None,
        allow_uneven_shards: bool = False,
        *,
        dynamic_batching_args: DynamicBatchingArgs,
        sequence_packing_args: None = None,
    ) -> tuple[list[BatchedDataDict[Any]], list[int]]: ...

    @overload
    def shard_by_batch_size(
        self,
        shards: int,
        batch_size: int | None = None,
        allow_uneven_shards: bool = False,
        dynamic_batching_args: None = None,
        *,
        sequence_packing_args: SequencePackingArgs,
    ) -> tuple[list[BatchedDataDict[Any]], list[int]]: ...

    def shard_by_batch_size(
        self,
        shards: int,
        batch_size: int | None = None,
        allow_uneven_shards: bool = False,
        dynamic_batching_args: DynamicBatchingArgs | None = None,
        sequence_packing_args: SequencePackingArgs | None = None,
    ) -> list[BatchedDataDict[Any]] | tuple[list[BatchedDataDict[Any]], list[int]]:
        """Split into ``shards`` parts (e.g. one per data-parallel rank).

        The batch is cut into chunks of ``batch_size`` rows (default: the whole batch; it
        must divide the batch size) and each chunk into ``shards`` contiguous parts; shard
        ``s`` holds part ``s`` of every chunk, in chunk order. ``batch_size`` must be a
        multiple of ``shards`` unless ``allow_uneven_shards`` (then ``batch_size`` must be
        None): shards hold ``ceil(size / shards)`` rows, the last ones fewer or none.
        Problems raise ``BatchSplitError`` (a ``ValueError`` and ``AssertionError``).

        With ``dynamic_batching_args`` or ``sequence_packing_args`` (not both) the rows are
        regrouped per chunk (see ``envloop.distributed.sharding``), every shard carries its
        micro-batch metadata, and the result is ``(shards, sorted_indices)``.

        >>> b = BatchedDataDict({"id": [0, 0, 1, 1, 2, 2, 3, 3]})
        >>> [s["id"] for s in b.shard_by_batch_size(shards=2)]
        [[0, 0, 1, 1], [2, 2, 3, 3]]
        >>> [s["id"] for s in b.shard_by_batch_size(shards=2, batch_size=4)]
        [[0, 0, 2, 2], [1, 1, 3, 3]]
        >>> [s["id"] for s in b.slice(0, 5).shard_by_batch_size(2, allow_uneven_shards=True)]
        [[0, 0, 1], [1, 2]]
        """
        if dynamic_batching_args is not None and sequence_packing_args is not None:
            raise BatchSplitError(
                "dynamic_batching_args and sequence_packing_args cannot be passed together; "
                "pass one of them."
            )
        total = self._checked_size()
        chunk = check_split(total, shards, batch_size, allow_uneven_shards)
        if dynamic_batching_args is None and sequence_packing_args is None:
            return self._shards(plain_plan(total, shards, chunk))
        if allow_uneven_shards:
            raise BatchSplitError(
                "allow_uneven_shards cannot be combined with dynamic batching or sequence "
                "packing: every shard needs the same micro-batch layout. Use a batch size "
                "that is a multiple of shards."
            )
        if dynamic_batching_args is not None:
            args: Any = dynamic_batching_args
            plan = dynamic_plan(self._lengths(args), shards, chunk, self._input_width(args), args)
        else:
            args = sequence_packing_args
            plan = packing_plan(self._lengths(args), shards, chunk, args)
        return self._shards(plan), plan.sorted_indices

    def chunk(self, rank: int, chunks: int) -> SlicedDataDict:
        """Part ``rank`` of ``chunks`` equal contiguous parts (tensors copied).

        >>> BatchedDataDict({"x": [1, 2, 3, 4, 5, 6]}).chunk(rank=2, chunks=3)["x"]
        [5, 6]
        """
        total = self._checked_size()
        if chunks < 1 or total % chunks:
            raise BatchSplitError(
                f"batch size ({total}) is not a multiple of chunks ({chunks}); use a chunk "
                "count that divides it."
            )
        if not 0 <= rank < chunks:
            raise BatchSplitError(f"rank must be in [0, {chunks}), got {rank}.")
        n = total // chunks
        return SlicedDataDict(self.select_indices(range(rank * n, (rank + 1) * n)))

    def reorder_data(self, reorded_indices: Sequence[int]) -> None:
        """Undo a permutation, in place: row ``j`` moves to position ``reorded_indices[j]``.

        Given the ``sorted_indices`` of ``shard_by_batch_size`` (packing), the shards passed
        through ``from_batches`` return to the original row order. Micro-batch metadata is
        cleared, since rows move.

        >>> b = BatchedDataDict({"x": ["c", "a", "b"]})
        >>> b.reorder_data([2, 0, 1])
        >>> b["x"]
        ['a', 'b', 'c']
        """
        total = self._checked_size()
        positions = [int(i) for i in reorded_indices]
        if sorted(positions) != list(range(total)):
            raise BatchSplitError(
                f"reorder_data needs a permutation of range({total}) (e.g. the sorted_indices "
                f"shard_by_batch_size returned), got {positions[:10]}"
                f"{'...' if len(positions) > 10 else ''}."
            )
        source = [0] * total
        for row, position in enumerate(positions):
            source[position] = row
        self.update(self.select_indices(source))
        self._clear_micro_batches()

    def truncate_tensors(self, dim: int, truncated_len: int) -> None:
        """Cut every tensor with more than ``dim`` dims to at most ``truncated_len`` along
        ``dim``, in place (views); other columns (lists, ``PackedTensor`` per-sample inputs
        such as image patches, which are not per-token) are left alone."""
        for key, value in list(self.items()):
            if isinstance(value, torch.Tensor) and value.dim() > dim:
                self[key] = value.narrow(dim, 0, min(truncated_len, value.shape[dim]))

    @classmethod
    def from_batches(
        cls,
        batches: Sequence[Mapping[str, Any]],
        pad_value_dict: Mapping[str, int | float] | None = None,
        *,
        allow_missing_packed_tensors: bool = False,
    ) -> Self:
        """Concatenate batches along the batch dimension.

        Lists concatenate; 1-D tensors concatenate; 2-D and higher tensors are right-padded
        along dim 1 (the sequence dim: [B, S], [B, S, K], [B, S, L, K]) to the longest, with
        ``pad_value_dict[key]`` (default 0); ``PackedTensor`` values concatenate their items
        (``PackedTensor.concat``). A key must have one kind of value in every non-empty batch
        (``TypeError`` naming the key otherwise).

        Keys: the result has every key of any batch. An empty batch (0 rows, or no keys) may
        lack keys and adds nothing to them; a non-empty batch lacking a key another batch
        has raises ``MissingKeyError`` (a ``KeyError`` and ``ValueError``) naming the key and
        the batches. A batch's row count is read from its first column. Values of empty
        batches are only used for a key no non-empty batch has (keeping its dtype/shape).

        >>> a = {"ids": torch.tensor([[1, 2]]), "n": [2]}
        >>> b = {"ids": torch.tensor([[3, 4, 5]]), "n": [3]}
        >>> BatchedDataDict.from_batches([a, b], {"ids": -1})["ids"].tolist()
        [[1, 2, -1], [3, 4, 5]]
        """
        pad_values = dict(pad_value_dict or {})
        rows = [first_column_len(batch) for batch in batches]
        keys = list(dict.fromkeys(key for batch in batches for key in batch))
        if allow_missing_packed_tensors:
            batches = _fill_missing_packed(batches, keys, rows)
        for key in keys:
            missing = [i for i, batch in enumerate(batches) if key not in batch and rows[i]]
            if missing:
                raise MissingKeyError(
                    f"from_batches: key {key!r} is missing from non-empty batches {missing}. "
                    "Every non-empty batch needs every key (only empty batches may omit keys); "
                    f"add {key!r} to those batches or drop it from the others."
                    + _packed_hint(key, batches)
                )
        for i, batch in enumerate(batches):
            sizes = {key: batch_len(key, value) for key, value in batch.items()}
            if len(set(sizes.values())) > 1:
                raise ValueError(
                    f"from_batches: batch {i} has mismatched column sizes {sizes} (inconsistent "
                    "logical row counts); give every column of a batch one entry per row."
                )
        out = cls()
        for key in keys:
            ids = [i for i, (b, n) in enumerate(zip(batches, rows)) if key in b and n]
            ids = ids or [i for i, b in enumerate(batches) if key in b]
            values = [batches[i][key] for i in ids]
            out[key] = concat_column(key, values, pad_values.get(key, 0), ids)
        return out

    def to(self, device: str | torch.device) -> Self:
        """Move every tensor and ``PackedTensor`` to ``device`` in place; returns self."""
        for key, value in self.items():
            if isinstance(value, (torch.Tensor, PackedTensor)):
                self[key] = value.to(device)
        return self

    def _checked_size(self) -> int:
        sizes = {key: batch_len(key, value) for key, value in self.items()}
        if not sizes:
            return 0
        first_key, first = next(iter(sizes.items()))
        for key, n in sizes.items():
            if n != first:
                raise BatchSplitError(
                    f"Batch sizes are not the same across the rollout batch: {first_key!r} has "
                    f"{first}, {key!r} has {n}. Every column must have one entry per sample."
                )
        return first

    def _lengths(self, args: Mapping[str, Any]) -> list[int]:
        key = args["input_lengths_key"]
        if key not in self:
            raise KeyError(
                f"input_lengths_key {key!r} is not a column of this batch (columns: "
                f"{sorted(self)}); set input_lengths_key to the [B] column of lengths."
            )
        lengths = self[key]
        if isinstance(lengths, PackedTensor):
            raise TypeError(
                f"input_lengths_key {key!r} is a PackedTensor column (per-sample items such "
                "as images); set input_lengths_key to the [B] column of lengths."
            )
        values = lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths
        return [int(n) for n in values]

    def _input_width(self, args: Mapping[str, Any]) -> int:
        key = args["input_key"]
        value = self.get(key)
        if not isinstance(value, torch.Tensor) or value.dim() < 2:
            got = "missing" if value is None else _column_summary(value)
            raise TypeError(
                f"input_key {key!r} must be the [B, L] tensor column of token ids, got {got}; "
                "set input_key to that column."
            )
        return int(value.shape[1])

    def _shards(self, plan: ShardPlan) -> list[BatchedDataDict[Any]]:
        shards: list[BatchedDataDict[Any]] = []
        for s, rows in enumerate(plan.rows):
            shard = SlicedDataDict(self.select_indices(rows))
            if plan.micro_batch_indices is not None and plan.micro_batch_lengths is not None:
                shard.micro_batch_indices = plan.micro_batch_indices[s]
                shard.micro_batch_lengths = plan.micro_batch_lengths[s]
            if plan.elem_counts_per_gb is not None:
                shard.elem_counts_per_gb = plan.elem_counts_per_gb[s]
            shards.append(shard)
        return shards


class SlicedDataDict(BatchedDataDict[Any]):
    """A shard or chunk of a larger batch (what ``shard_by_batch_size`` and ``chunk`` return);
    a distinct type for readers and type checkers, otherwise a ``BatchedDataDict``."""


def _fill_missing_packed(
    batches: Sequence[Mapping[str, Any]], keys: list[str], rows: list[int]
) -> list[Mapping[str, Any]]:
    """``batches`` with each ``PackedTensor`` key (one that is a PackedTensor in every
    batch holding it) added, as rows without that input, to the non-empty batches lacking
    it."""
    filled: list[Mapping[str, Any]] = list(batches)
    for key in keys:
        present = [b[key] for b in batches if key in b]
        if not all(isinstance(v, PackedTensor) for v in present):
            continue
        for i, batch in enumerate(filled):
            if key not in batch and rows[i]:
                filled[i] = {**batch, key: PackedTensor.empty_rows_like(present[0], rows[i])}
    return filled


def _packed_hint(key: str, batches: Sequence[Mapping[str, Any]]) -> str:
    """How to fill a missing PackedTensor column, if ``key`` is one in some batch."""
    if any(isinstance(b.get(key), PackedTensor) for b in batches):
        return (
            f" {key!r} is a PackedTensor: a batch whose samples lack it holds "
            "PackedTensor([None] * rows, dim_to_pack), or pass "
            "allow_missing_packed_tensors=True."
        )
    return ""


def _column_summary(value: Any) -> str:
    """``Tensor[2, 3] float32``, ``list[4]``, ``PackedTensor[3, 2 present] float32``, or the
    type name of anything else."""
    if isinstance(value, torch.Tensor):
        return f"Tensor[{', '.join(map(str, value.shape))}]{_dtype_device(value)}"
    if isinstance(value, list):
        return f"list[{len(value)}]"
    if isinstance(value, PackedTensor):
        present = sum(n > 0 for n in value.logical_segment_counts_by_row())
        stored = [t for t in value.tensors if t is not None]
        dtype = _dtype_device(stored[0]) if stored else ""
        return f"PackedTensor[{len(value)}, {present} present]{dtype}"
    return type(value).__name__


def _dtype_device(tensor: torch.Tensor) -> str:
    dtype = str(tensor.dtype).removeprefix("torch.")
    device = "" if tensor.device.type == "cpu" else f" {tensor.device}"
    return f" {dtype}{device}"


def _repeated(item: Any, times: int, share_media: bool, in_media: bool) -> list[Any]:
    """``times`` deep copies of ``item``; sharing its media with ``share_media``
    (``in_media``: every leaf of ``item`` is media, its column being a native media key)."""
    if not share_media:
        return [copy.deepcopy(item) for _ in range(times)]
    return deepcopy_sharing_images(item, times, prepare_media_sharing(item, in_media))
