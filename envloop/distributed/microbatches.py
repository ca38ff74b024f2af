"""Micro-batch metadata and iterators of ``BatchedDataDict`` (``MicroBatchMixin``).

``shard_by_batch_size`` with dynamic batching or sequence packing sets three attributes on
each shard; the iterators here walk them:

- ``micro_batch_indices``: per chunk (global batch), ``[start, end]`` row ranges relative to
  that chunk's rows in the shard;
- ``micro_batch_lengths``: per chunk, each micro-batch's sequence length (dynamic batching:
  its padded longest row; packing: its total padded tokens);
- ``elem_counts_per_gb``: per chunk, rows of the shard in that chunk (packing only).

``get_batch(i)`` cuts chunk ``i`` out with its own metadata; the iterators then need exactly
one chunk. ``copy()`` and ``to()`` keep the metadata; ``select_indices``, ``slice``,
``repeat_interleave`` and ``reorder_data`` move rows, so what they return (or leave) has none.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from envloop.distributed.sharding import BatchSplitError

MICRO_BATCH_ATTRIBUTES = ("micro_batch_indices", "micro_batch_lengths", "elem_counts_per_gb")


class MicroBatchMixin:
    """Micro-batch metadata and iteration, mixed into ``BatchedDataDict`` (which provides
    ``slice``, ``size`` and ``truncate_tensors``)."""

    micro_batch_indices: list[list[list[int]]] | None
    micro_batch_lengths: list[list[int]] | None
    elem_counts_per_gb: list[int] | None

    if TYPE_CHECKING:

        def slice(self, start: int, end: int) -> Any: ...

        @property
        def size(self) -> int: ...

    def _clear_micro_batches(self) -> None:
        for name in MICRO_BATCH_ATTRIBUTES:
            setattr(self, name, None)

    def _copy_micro_batches_to(self, other: MicroBatchMixin) -> None:
        for name in MICRO_BATCH_ATTRIBUTES:
            value = getattr(self, name)
            setattr(other, name, _nested_copy(value) if value is not None else None)

    def get_batch(self, batch_idx: int, batch_size: int | None = None) -> Any:
        """Chunk (global batch) ``batch_idx``, carrying its micro-batch metadata.

        With packing metadata (``elem_counts_per_gb``) the chunk's rows are known; otherwise
        rows ``[batch_idx * batch_size, (batch_idx + 1) * batch_size)``.
        """
        counts = self.elem_counts_per_gb
        if counts is not None:
            start = sum(counts[:batch_idx])
            batch = self.slice(start, start + counts[batch_idx])
            batch.elem_counts_per_gb = [counts[batch_idx]]
        elif batch_size is None:
            raise BatchSplitError(
                "get_batch needs batch_size unless the dict carries sequence-packing "
                "metadata (elem_counts_per_gb); pass the per-shard batch size."
            )
        else:
            batch = self.slice(batch_idx * batch_size, (batch_idx + 1) * batch_size)
        if self.micro_batch_indices is not None and self.micro_batch_lengths is not None:
            batch.micro_batch_indices = [_nested_copy(self.micro_batch_indices[batch_idx])]
            batch.micro_batch_lengths = [list(self.micro_batch_lengths[batch_idx])]
        return batch

    def make_microbatch_iterator(self, microbatch_size: int) -> Iterator[Any]:
        """Consecutive slices of ``microbatch_size`` rows (which must divide the batch size)."""
        size = self.size
        if microbatch_size < 1 or size % microbatch_size:
            raise BatchSplitError(
                f"Data dict size ({size}) is not a multiple of the provided microbatch size "
                f"({microbatch_size}). Use a micro-batch size that divides it."
            )
        for start in range(0, size, microbatch_size):
            yield self.slice(start, start + microbatch_size)

    def make_microbatch_iterator_with_dynamic_shapes(self, sequence_dim: int = 1) -> Iterator[Any]:
        """The dynamic-batching micro-batches of this chunk, every tensor cut to the
        micro-batch's length along ``sequence_dim`` ([b, L] -> [b, length])."""
        indices, lengths = self._single_chunk("make_microbatch_iterator_with_dynamic_shapes")
        for (start, end), length in zip(indices, lengths):
            micro_batch = self.slice(start, end)
            micro_batch.truncate_tensors(dim=sequence_dim, truncated_len=length)
            yield micro_batch

    def get_microbatch_iterator_dynamic_shapes_len(self) -> int:
        """How many micro-batches ``make_microbatch_iterator_with_dynamic_shapes`` yields."""
        return len(self._single_chunk("get_microbatch_iterator_dynamic_shapes_len")[0])

    def make_microbatch_iterator_for_packable_sequences(self) -> Iterator[Any]:
        """The sequence-packing micro-batches (bins) of this chunk, rows unpadded-as-stored."""
        indices, _ = self._single_chunk("make_microbatch_iterator_for_packable_sequences")
        for start, end in indices:
            yield self.slice(start, end)

    def get_microbatch_iterator_for_packable_sequences_len(self) -> tuple[int, int]:
        """``(number of bins, largest bin's padded token total)`` of this chunk."""
        indices, lengths = self._single_chunk("get_microbatch_iterator_for_packable_sequences_len")
        return len(indices), max(lengths, default=0)

    def _single_chunk(self, caller: str) -> tuple[list[list[int]], list[int]]:
        indices, lengths = self.micro_batch_indices, self.micro_batch_lengths
        if indices is None or lengths is None or len(indices) != 1:
            chunks = "no" if indices is None else len(indices)
            raise BatchSplitError(
                f"{caller} needs the micro-batch layout of exactly one global batch, but this "
                f"dict has {chunks} (micro_batch_indices). Shard with dynamic_batching_args or "
                "sequence_packing_args, then take one global batch with get_batch(i)."
            )
        return indices[0], lengths[0]


def _nested_copy(value: list) -> list:
    return [_nested_copy(v) if isinstance(v, list) else v for v in value]
