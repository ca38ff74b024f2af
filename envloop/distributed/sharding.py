"""Row plans for ``BatchedDataDict.shard_by_batch_size``: which rows go to which shard.

Pure functions on sizes and lengths; ``BatchedDataDict`` turns a ``ShardPlan`` into shards.
Three modes, as in the published interface:

- plain: the batch is cut into chunks of ``batch_size`` rows (one optimizer step each) and
  every chunk into ``shards`` contiguous parts; shard ``s`` holds part ``s`` of every chunk.
- dynamic batching (``DynamicBatchingArgs``): inside each chunk, rows are sorted by length
  and dealt round-robin to the shards, so position ``p`` holds similar lengths on every
  shard; micro-batches then grow while ``rows * longest (rounded)`` fits the token budget,
  with the same boundaries on every shard.
- sequence packing (``SequencePackingArgs``): each chunk's lengths are packed into bins of
  at most ``max_tokens_per_microbatch`` tokens (a multiple of ``shards`` bins), dealt
  round-robin to the shards; each bin is one micro-batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, TypedDict

from typing_extensions import NotRequired

from envloop.distributed.bin_packing import pack_sequences


class BatchSplitError(ValueError, AssertionError):
    """A batch cannot be split as asked (sizes that do not divide, columns that disagree, ...).

    It is a ``ValueError``; it is also an ``AssertionError`` because the published
    interface asserted these conditions, so ported ``except AssertionError`` code still works.
    """


class DynamicBatchingArgs(TypedDict):
    """Micro-batches of varying row count under a token budget (``shard_by_batch_size``).

    Attributes:
        max_tokens_per_microbatch: rows x padded length of a micro-batch stays within this.
        sequence_length_round: a micro-batch's length is rounded up to a multiple of this.
        input_key: the [B, L] column whose width caps the rounded length.
        input_lengths_key: the [B] column of per-row lengths.
    """

    max_tokens_per_microbatch: int
    sequence_length_round: int
    input_key: str
    input_lengths_key: str


class SequencePackingArgs(TypedDict):
    """Micro-batches that are bins of packed sequences (``shard_by_batch_size``).

    Attributes:
        max_tokens_per_microbatch: a bin's total (padded) length stays within this.
        input_key: the [B, L] column of token ids.
        input_lengths_key: the [B] column of per-row lengths.
        algorithm: a packing algorithm name (see ``envloop.distributed.bin_packing``).
        sequence_length_pad_multiple: each length is rounded up to a multiple of this
            before packing (e.g. for context/tensor parallel alignment); default 1.
        microbatch_order: ``"packer"`` (default) runs a shard's bins in the order the packer
            dealt them; ``"largest_first"`` runs the shard's fullest bins first.
    """

    max_tokens_per_microbatch: int
    input_key: str
    input_lengths_key: str
    algorithm: str
    sequence_length_pad_multiple: NotRequired[int]
    microbatch_order: NotRequired[Literal["packer", "largest_first"]]


@dataclass
class ShardPlan:
    """Rows of each shard and, for dynamic batching or packing, its micro-batch layout.

    Attributes:
        rows: per shard, the indices of the source rows it holds, in order.
        micro_batch_indices: per shard, per chunk, ``[start, end]`` row ranges relative to the
            shard's part of that chunk (None in plain mode).
        micro_batch_lengths: per shard, per chunk, each micro-batch's sequence length (dynamic
            batching: padded longest row; packing: total padded tokens).
        elem_counts_per_gb: per shard, rows in each chunk (packing only; else None).
        sorted_indices: the source row of each row of the shards concatenated in shard
            order (packing) or of the length-sorted batch (dynamic batching).
    """

    rows: list[list[int]]
    micro_batch_indices: list[list[list[list[int]]]] | None = None
    micro_batch_lengths: list[list[list[int]]] | None = None
    elem_counts_per_gb: list[list[int]] | None = None
    sorted_indices: list[int] = field(default_factory=list)


def check_split(total: int, shards: int, batch_size: int | None, allow_uneven_shards: bool) -> int:
    """The chunk size (``batch_size`` or ``total``); raises ``BatchSplitError`` if it cannot split.

    >>> check_split(8, 2, 4, False)
    4
    """
    if shards < 1:
        raise BatchSplitError(f"shard_by_batch_size needs shards >= 1, got {shards}.")
    if allow_uneven_shards and batch_size is not None:
        raise BatchSplitError(
            "batch_size must be None if allow_uneven_shards is True: uneven shards split the "
            "whole batch once. Drop batch_size, or make it a multiple of shards."
        )
    if batch_size is not None and batch_size < 1:
        raise BatchSplitError(f"shard_by_batch_size needs batch_size >= 1, got {batch_size}.")
    size = total if batch_size is None else batch_size
    if total and total % size:
        raise BatchSplitError(
            f"Total batch size ({total}) is not a multiple of batch_size ({size}). Pass a "
            "batch_size that divides the batch (e.g. the global batch size) or None."
        )
    if size % shards and not allow_uneven_shards:
        raise BatchSplitError(
            f"Batch size ({size}) is not a multiple of shards ({shards}). Use a shard count "
            "that divides it, or allow_uneven_shards=True (with batch_size=None)."
        )
    return size


def plain_plan(total: int, shards: int, chunk: int) -> ShardPlan:
    """Shard ``s`` takes rows ``[s*k, (s+1)*k)`` of every chunk, ``k = ceil(chunk / shards)``.

    With uneven shards (one chunk) the last shards are shorter, possibly empty.

    >>> plain_plan(8, 2, 4).rows
    [[0, 1, 4, 5], [2, 3, 6, 7]]
    >>> plain_plan(5, 3, 5).rows
    [[0, 1], [2, 3], [4]]
    """
    k = -(-chunk // shards) if chunk else 0
    rows: list[list[int]] = [[] for _ in range(shards)]
    for start in range(0, total, chunk or 1):
        end = start + chunk
        for s in range(shards):
            rows[s].extend(range(min(start + s * k, end), min(start + (s + 1) * k, end)))
    return ShardPlan(rows)


def dynamic_plan(
    lengths: Sequence[int], shards: int, chunk: int, width: int, args: DynamicBatchingArgs
) -> ShardPlan:
    """Length-sorted rows dealt round-robin per chunk, then shared micro-batch boundaries.

    ``width`` is the padded length of ``args["input_key"]``; a micro-batch's length is the
    longest of its rows over all shards, rounded up to ``sequence_length_round`` and capped
    at ``width``.

    >>> args = {"max_tokens_per_microbatch": 8, "sequence_length_round": 2,
    ...         "input_key": "ids", "input_lengths_key": "n"}
    >>> plan = dynamic_plan([3, 1, 4, 2], shards=2, chunk=4, width=4, args=args)
    >>> plan.sorted_indices, plan.rows
    ([1, 0, 3, 2], [[1, 0], [3, 2]])
    >>> plan.micro_batch_indices[0], plan.micro_batch_lengths[0]
    ([[[0, 2]]], [[4]])
    """
    order: list[int] = []
    for start in range(0, len(lengths), chunk or 1):
        by_length = sorted(range(start, start + chunk), key=lambda i: lengths[i])
        order.extend(i for s in range(shards) for i in by_length[s::shards])
    sorted_lengths = [lengths[i] for i in order]
    k = chunk // shards
    indices, seq_lengths = [], []
    for start in range(0, len(order), chunk or 1):
        longest = [max(sorted_lengths[start + s * k + p] for s in range(shards)) for p in range(k)]
        bounds, sizes = _greedy_micro_batches(longest, width, args)
        indices.append(bounds)
        seq_lengths.append(sizes)
    plain = plain_plan(len(order), shards, chunk)
    return ShardPlan(
        rows=[[order[i] for i in rows] for rows in plain.rows],
        micro_batch_indices=[_nested_copy(indices) for _ in range(shards)],
        micro_batch_lengths=[_nested_copy(seq_lengths) for _ in range(shards)],
        sorted_indices=order,
    )


def packing_plan(
    lengths: Sequence[int], shards: int, chunk: int, args: SequencePackingArgs
) -> ShardPlan:
    """Per chunk, pack (padded) lengths into bins, deal bins round-robin; a bin = a micro-batch.

    >>> args = {"max_tokens_per_microbatch": 10, "input_key": "ids",
    ...         "input_lengths_key": "n", "algorithm": "first_fit_decreasing"}
    >>> plan = packing_plan([6, 3, 5, 4], shards=2, chunk=4, args=args)
    >>> plan.rows, plan.micro_batch_indices, plan.micro_batch_lengths
    ([[0, 3], [2, 1]], [[[[0, 2]]], [[[0, 2]]]], [[[10]], [[8]]])
    """
    order = args.get("microbatch_order")
    if order not in (None, "packer", "largest_first"):
        raise BatchSplitError(
            f"sequence packing microbatch_order must be 'packer' or 'largest_first', got {order!r}."
        )
    multiple = args.get("sequence_length_pad_multiple", 1)
    capacity = args["max_tokens_per_microbatch"]
    padded = [-(-int(n) // multiple) * multiple for n in lengths]
    _check_fits(padded, capacity, "Row", "sequence_length_pad_multiple")
    rows: list[list[int]] = [[] for _ in range(shards)]
    bounds: list[list[list[list[int]]]] = [[] for _ in range(shards)]
    totals: list[list[list[int]]] = [[] for _ in range(shards)]
    counts: list[list[int]] = [[] for _ in range(shards)]
    for start in range(0, len(padded), chunk or 1):
        packed = pack_sequences(
            padded[start : start + chunk],
            capacity,
            args["algorithm"],
            min_bin_count=shards,
            bin_count_multiple=shards,
        )
        bins = [[start + i for i in b] for b in packed]
        for s in range(shards):
            shard_bins = _ordered_bins(bins[s::shards], padded, order == "largest_first")
            rows[s].extend(i for b in shard_bins for i in b)
            bounds[s].append(_ranges([len(b) for b in shard_bins]))
            totals[s].append([sum(padded[i] for i in b) for b in shard_bins])
            counts[s].append(sum(len(b) for b in shard_bins))
    return ShardPlan(rows, bounds, totals, counts, [i for r in rows for i in r])


def _ordered_bins(bins: list[list[int]], padded: list[int], largest_first: bool) -> list[list[int]]:
    """``bins`` as dealt, or fullest first (stable) for ``largest_first``."""
    if not largest_first:
        return bins
    return sorted(bins, key=lambda b: sum(padded[i] for i in b), reverse=True)


def _ranges(sizes: list[int]) -> list[list[int]]:
    """Consecutive ``[start, end]`` ranges of the given sizes, from 0."""
    out, end = [], 0
    for n in sizes:
        out.append([end, end + n])
        end += n
    return out


def _greedy_micro_batches(
    longest: list[int], width: int, args: DynamicBatchingArgs
) -> tuple[list[list[int]], list[int]]:
    """Grow each micro-batch while ``rows * (its longest, rounded)`` fits the budget."""
    budget, step = args["max_tokens_per_microbatch"], args["sequence_length_round"]
    rounded = [min(-(-n // step) * step, width) for n in longest]
    _check_fits(rounded, budget, "Chunk position", "sequence_length_round")
    bounds: list[list[int]] = []
    sizes: list[int] = []
    for p, n in enumerate(rounded):
        if bounds and (p - bounds[-1][0] + 1) * max(sizes[-1], n) <= budget:
            bounds[-1][1] = p + 1
            sizes[-1] = max(sizes[-1], n)
        else:
            bounds.append([p, p + 1])
            sizes.append(n)
    return bounds, sizes


def _check_fits(lengths: list[int], budget: int, label: str, rounding: str) -> None:
    too_long = [(i, n) for i, n in enumerate(lengths) if n > budget]
    if too_long:
        i, n = too_long[0]
        raise BatchSplitError(
            f"{label} {i} has a padded length of {n} (after {rounding}), over "
            f"max_tokens_per_microbatch={budget}. Raise max_tokens_per_microbatch or "
            "truncate the sequences."
        )


def _nested_copy(value: list) -> list:
    return [_nested_copy(v) if isinstance(v, list) else v for v in value]
