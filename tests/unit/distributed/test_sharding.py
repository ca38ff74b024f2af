"""Dynamic batching, sequence packing and micro-batch iteration of BatchedDataDict."""

from __future__ import annotations

import pickle

import pytest
import torch

from envloop.distributed.batched_data_dict import (
    BatchedDataDict,
    BatchSplitError,
    DynamicBatchingArgs,
    SequencePackingArgs,
    SlicedDataDict,
)


def _dynamic_batch() -> BatchedDataDict:
    lengths = torch.tensor([2, 8, 4, 16, 28, 32, 2, 32])
    return BatchedDataDict(
        {"ids": torch.arange(8 * 40).reshape(8, 40), "n": lengths, "row": list(range(8))}
    )


DYNAMIC: DynamicBatchingArgs = {
    "max_tokens_per_microbatch": 32,
    "sequence_length_round": 4,
    "input_key": "ids",
    "input_lengths_key": "n",
}


def _packing(algorithm: str = "modified_first_fit_decreasing", **extra) -> SequencePackingArgs:
    args = {
        "max_tokens_per_microbatch": 100,
        "input_key": "ids",
        "input_lengths_key": "n",
        "algorithm": algorithm,
        "sequence_length_pad_multiple": 1,
    }
    return SequencePackingArgs(**{**args, **extra})  # type: ignore[typeddict-item]


def _packing_batch(lengths: list[int]) -> BatchedDataDict:
    n = len(lengths)
    return BatchedDataDict(
        {
            "ids": torch.ones(n, 100, dtype=torch.long),
            "n": torch.tensor(lengths),
            "row": list(range(n)),
        }
    )


# --- dynamic batching ---------------------------------------------------------------------


def test_dynamic_batching_deals_length_sorted_rows_and_shares_micro_batch_bounds():
    shards, order = _dynamic_batch().shard_by_batch_size(2, dynamic_batching_args=DYNAMIC)
    assert order == [0, 2, 3, 5, 6, 1, 4, 7]
    assert [s["row"] for s in shards] == [[0, 2, 3, 5], [6, 1, 4, 7]]
    for shard in shards:
        assert type(shard) is SlicedDataDict
        # position-wise longest over both shards, rounded to 4: 4, 8, 28, 32
        assert shard.micro_batch_indices == [[[0, 2], [2, 3], [3, 4]]]
        assert shard.micro_batch_lengths == [[8, 28, 32]]
        assert shard.get_microbatch_iterator_dynamic_shapes_len() == 3
    micro = list(shards[1].make_microbatch_iterator_with_dynamic_shapes())
    assert [tuple(mb["ids"].shape) for mb in micro] == [(2, 8), (1, 28), (1, 32)]
    assert [mb["row"] for mb in micro] == [[6, 1], [4], [7]]
    assert torch.equal(micro[0]["ids"], _dynamic_batch()["ids"][[6, 1], :8])
    assert micro[0]["n"].tolist() == [2, 8]  # 1-D columns are not cut


def test_dynamic_batching_caps_the_rounded_length_at_the_input_width():
    batch = _dynamic_batch()
    batch["ids"] = batch["ids"][:, :30]
    shards, _ = batch.shard_by_batch_size(2, dynamic_batching_args=DYNAMIC)
    assert shards[0].micro_batch_lengths == [[8, 28, 30]]


def test_dynamic_batching_per_chunk_and_get_batch():
    shards, order = _dynamic_batch().shard_by_batch_size(
        2, batch_size=4, dynamic_batching_args=DYNAMIC
    )
    # chunk 0 = rows 0-3 (lengths 2, 8, 4, 16), chunk 1 = rows 4-7 (28, 32, 2, 32)
    assert order == [0, 1, 2, 3, 6, 5, 4, 7]
    assert [s["row"] for s in shards] == [[0, 1, 6, 5], [2, 3, 4, 7]]
    assert shards[0].micro_batch_indices == [[[0, 2]], [[0, 1], [1, 2]]]
    assert shards[0].micro_batch_lengths == [[16], [28, 32]]
    second = shards[0].get_batch(1, batch_size=2)
    assert second["row"] == [6, 5]
    assert second.micro_batch_indices == [[[0, 1], [1, 2]]]
    assert [mb["ids"].shape[1] for mb in second.make_microbatch_iterator_with_dynamic_shapes()] == [
        28,
        32,
    ]


def test_dynamic_batching_rejects_a_row_over_the_budget():
    args = {**DYNAMIC, "max_tokens_per_microbatch": 16}
    with pytest.raises(
        BatchSplitError, match="padded length of 28 .* over max_tokens_per_microbatch=16"
    ):
        _dynamic_batch().shard_by_batch_size(2, dynamic_batching_args=args)  # type: ignore[arg-type]


def test_dynamic_batching_cannot_use_uneven_shards():
    with pytest.raises(BatchSplitError, match="allow_uneven_shards cannot be combined"):
        _dynamic_batch().shard_by_batch_size(
            3, allow_uneven_shards=True, dynamic_batching_args=DYNAMIC
        )


# --- sequence packing ---------------------------------------------------------------------


def test_packing_deals_bins_round_robin_and_records_each_bin():
    batch = _packing_batch([46, 24, 55, 88, 11, 14, 73, 17])
    shards, order = batch.shard_by_batch_size(2, sequence_packing_args=_packing())
    # MFFD bins: [3, 4] (99), [6, 5] (87), [2, 7, 1] (96), [0] (46)
    assert [s["row"] for s in shards] == [[3, 4, 2, 7, 1], [6, 5, 0]]
    assert order == [3, 4, 2, 7, 1, 6, 5, 0]
    assert shards[0].micro_batch_indices == [[[0, 2], [2, 5]]]
    assert shards[0].micro_batch_lengths == [[99, 96]]
    assert shards[1].micro_batch_indices == [[[0, 2], [2, 3]]]
    assert shards[1].micro_batch_lengths == [[87, 46]]
    assert [s.elem_counts_per_gb for s in shards] == [[5], [3]]
    assert [mb["row"] for mb in shards[0].make_microbatch_iterator_for_packable_sequences()] == [
        [3, 4],
        [2, 7, 1],
    ]
    assert shards[1].get_microbatch_iterator_for_packable_sequences_len() == (2, 87)
    rebuilt = BatchedDataDict.from_batches(shards)
    rebuilt.reorder_data(order)
    assert rebuilt["row"] == list(range(8))
    assert torch.equal(rebuilt["n"], batch["n"])


def test_packing_largest_first_runs_a_shards_fullest_bins_first():
    batch = _packing_batch([2, 9, 3, 8])
    args = _packing("first_fit_decreasing", max_tokens_per_microbatch=10)
    [packer_order], _ = batch.shard_by_batch_size(1, sequence_packing_args=args)
    assert packer_order.micro_batch_lengths == [[9, 10, 3]]
    args = _packing(
        "first_fit_decreasing", max_tokens_per_microbatch=10, microbatch_order="largest_first"
    )
    [shard], order = batch.shard_by_batch_size(1, sequence_packing_args=args)
    assert shard.micro_batch_lengths == [[10, 9, 3]]
    assert shard["row"] == order == [3, 0, 1, 2]
    assert shard.micro_batch_indices == [[[0, 2], [2, 3], [3, 4]]]


def test_packing_pads_lengths_to_the_multiple_before_packing():
    batch = _packing_batch([30, 33, 60])
    args = _packing("first_fit_decreasing", sequence_length_pad_multiple=32)
    [shard], _ = batch.shard_by_batch_size(1, sequence_packing_args=args)
    # padded 32, 64, 64: 64 + 32 fits, the other 64 does not
    assert shard.micro_batch_lengths == [[96, 64]]
    assert shard["row"] == [1, 0, 2]


def test_packing_per_chunk_keeps_rows_inside_their_global_batch():
    batch = _packing_batch([46, 24, 55, 88, 11, 14, 73, 17])
    shards, order = batch.shard_by_batch_size(2, batch_size=4, sequence_packing_args=_packing())
    for shard in shards:
        first, second = shard.elem_counts_per_gb
        assert all(r < 4 for r in shard["row"][:first])
        assert all(r >= 4 for r in shard["row"][first : first + second])
        assert len(shard.micro_batch_indices) == 2
    chunk = shards[0].get_batch(1)
    assert chunk["row"] == shards[0]["row"][shards[0].elem_counts_per_gb[0] :]
    assert chunk.micro_batch_indices == [shards[0].micro_batch_indices[1]]
    assert chunk.elem_counts_per_gb == [shards[0].elem_counts_per_gb[1]]
    assert sorted(order) == list(range(8))


def test_packing_makes_at_least_one_bin_per_shard():
    batch = _packing_batch([10, 10, 10, 10])
    shards, _ = batch.shard_by_batch_size(2, sequence_packing_args=_packing("first_fit_decreasing"))
    assert [s["row"] for s in shards] == [[0, 1, 2], [3]]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"microbatch_order": "unknown"}, "microbatch_order must be 'packer' or 'largest_first'"),
        ({"max_tokens_per_microbatch": 50}, "Row 2 has a padded length of 55"),
        ({"algorithm": "best_fit"}, "Unknown packing algorithm 'best_fit'"),
    ],
)
def test_packing_errors_name_the_problem(kwargs, message):
    args = {**_packing(), **kwargs}
    with pytest.raises(ValueError, match=message):
        _packing_batch([46, 24, 55, 8]).shard_by_batch_size(2, sequence_packing_args=args)  # type: ignore[arg-type]


def test_dynamic_batching_and_packing_cannot_be_combined():
    with pytest.raises(AssertionError, match="cannot be passed together"):
        _packing_batch([1, 2]).shard_by_batch_size(
            2, dynamic_batching_args=DYNAMIC, sequence_packing_args=_packing()
        )


def test_missing_lengths_column_names_it():
    args = {**_packing(), "input_lengths_key": "lens"}
    with pytest.raises(KeyError, match="input_lengths_key 'lens' is not a column"):
        _packing_batch([1, 2]).shard_by_batch_size(2, sequence_packing_args=args)  # type: ignore[arg-type]


# --- micro-batch metadata through other operations ----------------------------------------


def _packed_shard() -> BatchedDataDict:
    shards, _ = _packing_batch([46, 24, 55, 88, 11, 14, 73, 17]).shard_by_batch_size(
        2, sequence_packing_args=_packing()
    )
    return shards[0]


def test_copy_to_and_pickle_keep_micro_batch_metadata_but_row_moves_drop_it():
    shard = _packed_shard()
    copied = shard.copy()
    assert copied.micro_batch_indices == [[[0, 2], [2, 5]]]
    copied.micro_batch_indices[0][0][1] = 99  # a copy, not shared
    assert shard.micro_batch_indices == [[[0, 2], [2, 5]]]
    assert shard.to("cpu").micro_batch_lengths == [[99, 96]]
    restored = pickle.loads(pickle.dumps(shard))
    assert restored.micro_batch_lengths == [[99, 96]]
    assert restored.elem_counts_per_gb == [5]
    assert restored["row"] == shard["row"]
    for moved in (shard.select_indices([0, 1]), shard.slice(0, 2), shard.repeat_interleave(2)):
        assert moved.micro_batch_indices is None
        assert moved.micro_batch_lengths is None
        assert moved.elem_counts_per_gb is None
    shard.reorder_data([4, 3, 2, 1, 0])
    assert shard.micro_batch_indices is None


def test_iterators_need_one_global_batch_of_metadata():
    with pytest.raises(BatchSplitError, match="has no .*get_batch"):
        next(BatchedDataDict({"x": [1]}).make_microbatch_iterator_for_packable_sequences())
    shards, _ = _packing_batch([46, 24, 55, 88, 11, 14, 73, 17]).shard_by_batch_size(
        2, batch_size=4, sequence_packing_args=_packing()
    )
    with pytest.raises(BatchSplitError, match="this dict has 2"):
        shards[0].get_microbatch_iterator_dynamic_shapes_len()


def test_get_batch_without_packing_metadata_needs_a_batch_size():
    b = BatchedDataDict({"x": [0, 1, 2, 3]})
    assert b.get_batch(1, batch_size=2)["x"] == [2, 3]
    with pytest.raises(BatchSplitError, match="get_batch needs batch_size"):
        b.get_batch(0)


def test_make_microbatch_iterator_slices_fixed_sizes():
    b = BatchedDataDict({"x": torch.arange(6), "y": list("abcdef")})
    assert [mb["y"] for mb in b.make_microbatch_iterator(2)] == [["a", "b"], ["c", "d"], ["e", "f"]]
    with pytest.raises(BatchSplitError, match=r"size \(6\) is not a multiple .* \(4\)"):
        list(b.make_microbatch_iterator(4))


# --- chunk, reorder_data, truncate_tensors, data ------------------------------------------


def test_chunk_takes_one_of_equal_contiguous_parts_as_copies():
    b = BatchedDataDict({"x": torch.arange(6), "y": list("abcdef")})
    part = b.chunk(rank=1, chunks=3)
    assert type(part) is SlicedDataDict
    assert part["x"].tolist() == [2, 3]
    assert part["y"] == ["c", "d"]
    part["x"][0] = 99
    assert b["x"][2].item() == 2
    with pytest.raises(
        BatchSplitError, match=r"batch size \(6\) is not a multiple of chunks \(4\)"
    ):
        b.chunk(0, 4)
    with pytest.raises(BatchSplitError, match=r"rank must be in \[0, 3\), got 3"):
        b.chunk(3, 3)


def test_reorder_data_undoes_a_permutation_in_place():
    b = BatchedDataDict({"x": torch.tensor([30, 10, 20]), "y": ["c", "a", "b"]})
    b.reorder_data([2, 0, 1])
    assert b["x"].tolist() == [10, 20, 30]
    assert b["y"] == ["a", "b", "c"]
    with pytest.raises(BatchSplitError, match=r"permutation of range\(3\)"):
        b.reorder_data([0, 0, 1])


def test_truncate_tensors_cuts_only_tensors_with_that_dim():
    b = BatchedDataDict(
        {"ids": torch.arange(12).reshape(2, 6), "n": torch.tensor([6, 2]), "t": ["a", "b"]}
    )
    b.truncate_tensors(dim=1, truncated_len=4)
    assert b["ids"].tolist() == [[0, 1, 2, 3], [6, 7, 8, 9]]
    assert b["n"].tolist() == [6, 2]
    b.truncate_tensors(dim=1, truncated_len=10)  # longer than the tensor: unchanged
    assert b["ids"].shape == (2, 4)


def test_data_is_the_dict_itself():
    b = BatchedDataDict({"x": [1, 2]})
    assert b.data is b
    b.data["y"] = [3, 4]
    assert b["y"] == [3, 4]
    assert BatchedDataDict().micro_batch_indices is None
