"""BatchedDataDict (docs/contract.md, "BatchedDataDict"): row selection, repetition,
sharding and concatenation."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from envloop.distributed.batched_data_dict import (
    BatchedDataDict,
    BatchSplitError,
    MissingKeyError,
    SlicedDataDict,
)


def _batch() -> BatchedDataDict:
    """Three rows: a 1-D tensor, a 2-D tensor, strings and mutable dicts."""
    return BatchedDataDict(
        {
            "x": torch.tensor([10, 11, 12]),
            "ids": torch.tensor([[1, 2], [3, 4], [5, 6]]),
            "name": ["a", "b", "c"],
            "meta": [{"k": [0]}, {"k": [1]}, {"k": [2]}],
        }
    )


def _numbered(n: int) -> BatchedDataDict:
    """``n`` rows whose every column holds the row number, so row order is visible."""
    return BatchedDataDict(
        {
            "row": torch.arange(n),
            "pair": torch.arange(2 * n).reshape(n, 2),
            "tag": [f"r{i}" for i in range(n)],
        }
    )


def _assert_same(actual: dict, expected: dict) -> None:
    """Same keys; tensors equal in dtype, shape and values; lists equal."""
    assert list(actual) == list(expected)
    for key, want in expected.items():
        got = actual[key]
        if isinstance(want, torch.Tensor):
            assert isinstance(got, torch.Tensor), key
            assert got.dtype == want.dtype, key
            assert got.shape == want.shape, key
            assert torch.equal(got, want), key
        else:
            assert got == want, key


# --- size, copy, get_dict, to -------------------------------------------------------------


def test_size_is_the_shared_leading_dimension():
    assert _batch().size == 3
    assert BatchedDataDict({"t": torch.zeros(4, 2, 5)}).size == 4
    assert BatchedDataDict({"names": []}).size == 0
    assert BatchedDataDict().size == 0


def test_size_with_mismatched_columns_names_both_keys():
    b = BatchedDataDict({"a": [1, 2], "b": torch.zeros(3)})
    with pytest.raises(ValueError, match="'a' has 2, 'b' has 3"):
        _ = b.size


def test_zero_dim_tensor_column_is_rejected_by_name():
    b = BatchedDataDict({"scalar": torch.tensor(1.0)})
    with pytest.raises(ValueError, match="column 'scalar' is a 0-d tensor"):
        _ = b.size
    with pytest.raises(ValueError, match="'scalar'"):
        b.slice(0, 1)


@pytest.mark.parametrize(
    "operation",
    [
        lambda b: b.size,
        lambda b: b.select_indices([0]),
        lambda b: b.slice(0, 1),
        lambda b: b.repeat_interleave(2),
        lambda b: b.shard_by_batch_size(2),
    ],
    ids=["size", "select_indices", "slice", "repeat_interleave", "shard_by_batch_size"],
)
def test_unsupported_value_type_names_the_key(operation):
    b = BatchedDataDict({"ok": [1, 2], "pairs": (1, 2)})
    with pytest.raises(TypeError, match="column 'pairs' holds a tuple"):
        operation(b)


def test_copy_is_a_new_dict_holding_the_same_values():
    b = _batch()
    c = b.copy()
    assert type(c) is BatchedDataDict
    assert c is not b
    assert all(c[key] is b[key] for key in b)
    c["extra"] = [0, 0, 0]
    del c["x"]
    assert list(b) == ["x", "ids", "name", "meta"]


def test_get_dict_returns_a_plain_dict_with_the_same_values():
    b = _batch()
    d = b.get_dict()
    assert type(d) is dict
    assert d == dict(b)
    assert all(d[key] is b[key] for key in b)


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu")])
def test_to_moves_tensors_and_returns_self(device):
    b = _batch()
    names = b["name"]
    assert b.to(device) is b
    assert b["x"].device == torch.device("cpu")
    assert b["ids"].device == torch.device("cpu")
    assert b["name"] is names
    assert b["x"].tolist() == [10, 11, 12]


# --- select_indices, slice ----------------------------------------------------------------


@pytest.mark.parametrize(
    "indices",
    [[2, 0, 2], torch.tensor([2, 0, 2]), torch.tensor([2, 0, 2], dtype=torch.int32), (2, 0, 2)],
    ids=["list", "int64-tensor", "int32-tensor", "tuple"],
)
def test_select_indices_keeps_order_and_repeats(indices):
    out = _batch().select_indices(indices)
    assert type(out) is BatchedDataDict
    assert out["x"].tolist() == [12, 10, 12]
    assert out["ids"].tolist() == [[5, 6], [1, 2], [5, 6]]
    assert out["name"] == ["c", "a", "c"]
    assert out["meta"] == [{"k": [2]}, {"k": [0]}, {"k": [2]}]
    assert out.size == 3


def test_select_indices_negative_indices_work_for_lists_and_tensors_alike():
    out = _batch().select_indices([-1, 0])
    assert out["x"].tolist() == [12, 10]
    assert out["ids"].tolist() == [[5, 6], [1, 2]]
    assert out["name"] == ["c", "a"]
    _assert_same(_batch().select_indices(torch.tensor([-1, 0])), out)


def test_select_indices_empty_keeps_trailing_dimensions():
    for indices in ([], torch.tensor([], dtype=torch.long)):
        out = _batch().select_indices(indices)
        assert out.size == 0
        assert out["ids"].shape == (0, 2)
        assert out["name"] == []


def test_select_indices_rejects_a_2d_index_tensor():
    with pytest.raises(ValueError, match=re.escape("1-D index tensor, got shape (1, 2)")):
        _batch().select_indices(torch.tensor([[0, 1]]))


def test_select_indices_out_of_range_raises():
    with pytest.raises(IndexError):
        _batch().select_indices([3])
    with pytest.raises(IndexError):
        _batch().select_indices(torch.tensor([3]))


def test_slice_takes_rows_start_to_end():
    b = _batch()
    out = b.slice(1, 3)
    assert type(out) is BatchedDataDict
    assert out["x"].tolist() == [11, 12]
    assert out["ids"].tolist() == [[3, 4], [5, 6]]
    assert out["name"] == ["b", "c"]
    out["name"].append("z")
    assert b["name"] == ["a", "b", "c"]
    assert b.slice(2, 2).size == 0
    assert b.slice(0, 10)["name"] == ["a", "b", "c"]


# --- repeat_interleave --------------------------------------------------------------------


def test_repeat_interleave_repeats_each_row_in_place():
    out = _batch().repeat_interleave(2)
    assert out.size == 6
    assert out["x"].tolist() == [10, 10, 11, 11, 12, 12]
    assert out["ids"].tolist() == [[1, 2], [1, 2], [3, 4], [3, 4], [5, 6], [5, 6]]
    assert out["name"] == ["a", "a", "b", "b", "c", "c"]
    assert out["meta"] == [{"k": [0]}, {"k": [0]}, {"k": [1]}, {"k": [1]}, {"k": [2]}, {"k": [2]}]


def test_repeat_interleave_deep_copies_list_items_per_repeat():
    b = _batch()
    out = b.repeat_interleave(3)
    out["meta"][0]["k"].append(99)
    out["meta"][1]["k"] = "replaced"
    assert out["meta"][:3] == [{"k": [0, 99]}, {"k": "replaced"}, {"k": [0]}]
    assert b["meta"] == [{"k": [0]}, {"k": [1]}, {"k": [2]}]
    assert out["meta"][0] is not b["meta"][0]


def test_repeat_interleave_once_is_an_equal_copy():
    b = _batch()
    out = b.repeat_interleave(1)
    _assert_same(out, b)
    assert out["meta"][0] is not b["meta"][0]


@pytest.mark.parametrize("num_repeats", [0, -1])
def test_repeat_interleave_needs_a_positive_count(num_repeats):
    with pytest.raises(ValueError, match=f"num_repeats >= 1, got {num_repeats}"):
        _batch().repeat_interleave(num_repeats)


# --- shard_by_batch_size ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rows", "shards", "expected"),
    [
        (6, 3, [[0, 1], [2, 3], [4, 5]]),
        (6, 2, [[0, 1, 2], [3, 4, 5]]),
        (3, 1, [[0, 1, 2]]),
        (0, 2, [[], []]),
    ],
)
def test_shard_by_batch_size_without_batch_size_gives_contiguous_parts(rows, shards, expected):
    out = _numbered(rows).shard_by_batch_size(shards)
    assert len(out) == shards
    for shard, want in zip(out, expected):
        assert type(shard) is SlicedDataDict
        assert shard["row"].tolist() == want
        assert shard["pair"].shape == (len(want), 2)
        assert shard["pair"].tolist() == [[2 * i, 2 * i + 1] for i in want]
        assert shard["tag"] == [f"r{i}" for i in want]
        assert shard.micro_batch_indices is None


@pytest.mark.parametrize(
    ("rows", "shards", "expected"),
    [
        (5, 2, [[0, 1, 2], [3, 4]]),
        (5, 3, [[0, 1], [2, 3], [4]]),
        (7, 3, [[0, 1, 2], [3, 4, 5], [6]]),
        (2, 4, [[0], [1], [], []]),
        (6, 4, [[0, 1], [2, 3], [4, 5], []]),
        (0, 2, [[], []]),
    ],
)
def test_uneven_shards_hold_ceil_rows_and_the_last_ones_fewer(rows, shards, expected):
    out = _numbered(rows).shard_by_batch_size(shards, allow_uneven_shards=True)
    assert [shard["row"].tolist() for shard in out] == expected
    assert [shard["tag"] for shard in out] == [[f"r{i}" for i in want] for want in expected]
    for shard in out:  # empty shards keep every key, with empty values of the right shape
        assert list(shard) == ["row", "pair", "tag"]
        assert shard["pair"].shape == (shard.size, 2)


def test_uneven_shards_cannot_take_a_batch_size():
    with pytest.raises(BatchSplitError, match="batch_size must be None if allow_uneven_shards"):
        _numbered(4).shard_by_batch_size(2, batch_size=2, allow_uneven_shards=True)


@pytest.mark.parametrize(
    ("rows", "shards", "batch_size", "expected"),
    [
        (8, 2, 4, [[0, 1, 4, 5], [2, 3, 6, 7]]),
        (8, 2, 2, [[0, 2, 4, 6], [1, 3, 5, 7]]),
        (8, 2, 8, [[0, 1, 2, 3], [4, 5, 6, 7]]),
        (12, 3, 6, [[0, 1, 6, 7], [2, 3, 8, 9], [4, 5, 10, 11]]),
        (12, 3, 3, [[0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8, 11]]),
    ],
)
def test_shard_by_batch_size_shards_each_chunk(rows, shards, batch_size, expected):
    out = _numbered(rows).shard_by_batch_size(shards, batch_size=batch_size)
    assert [shard["row"].tolist() for shard in out] == expected
    assert [shard["tag"] for shard in out] == [[f"r{i}" for i in want] for want in expected]


@pytest.mark.parametrize(
    ("rows", "shards", "batch_size", "message"),
    [
        (6, 2, 4, r"Total batch size \(6\) is not a multiple of batch_size \(4\)"),
        (6, 2, 7, r"Total batch size \(6\) is not a multiple of batch_size \(7\)"),
        (6, 2, 0, "batch_size >= 1, got 0"),
        (6, 2, -2, "batch_size >= 1, got -2"),
        (12, 4, 6, r"Batch size \(6\) is not a multiple of shards \(4\)\. Use a shard count"),
        (10, 3, None, r"Batch size \(10\) is not a multiple of shards \(3\)"),
    ],
)
def test_shard_by_batch_size_rejects_sizes_that_do_not_divide(rows, shards, batch_size, message):
    with pytest.raises(BatchSplitError, match=message) as info:
        _numbered(rows).shard_by_batch_size(shards, batch_size=batch_size)
    # Both a ValueError (envloop) and an AssertionError (the published interface asserted).
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, AssertionError)


def test_shard_by_batch_size_needs_a_positive_shard_count():
    with pytest.raises(BatchSplitError, match="shards >= 1, got 0"):
        _numbered(4).shard_by_batch_size(0)


def test_shard_by_batch_size_with_mismatched_columns_raises():
    with pytest.raises(
        BatchSplitError, match="not the same across the rollout batch: 'a' has 2, 'b' has 1"
    ):
        BatchedDataDict({"a": [1, 2], "b": [1]}).shard_by_batch_size(2)


# --- from_batches -------------------------------------------------------------------------


def test_from_batches_concatenates_lists_and_1d_tensors():
    out = BatchedDataDict.from_batches(
        [
            {"n": ["a"], "r": torch.tensor([1.5])},
            BatchedDataDict({"n": ["b", "c"], "r": torch.tensor([2.5, 3.5])}),
        ]
    )
    assert type(out) is BatchedDataDict
    assert out["n"] == ["a", "b", "c"]
    assert out["r"].tolist() == [1.5, 2.5, 3.5]
    assert out["r"].dtype == torch.float32


def test_from_batches_right_pads_2d_tensors_with_each_keys_pad_value():
    a = {"ids": torch.tensor([[1, 2]]), "mask": torch.tensor([[1, 1]])}
    b = {"ids": torch.tensor([[3, 4, 5, 6], [7, 8, 9, 0]]), "mask": torch.tensor([[1] * 4] * 2)}
    c = {"ids": torch.tensor([[4, 4, 4]]), "mask": torch.tensor([[1, 1, 1]])}
    out = BatchedDataDict.from_batches([a, b, c], pad_value_dict={"ids": -1})
    assert out["ids"].tolist() == [[1, 2, -1, -1], [3, 4, 5, 6], [7, 8, 9, 0], [4, 4, 4, -1]]
    assert out["mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 1, 0]]
    assert out["ids"].dtype == torch.int64


def test_from_batches_pads_bool_and_float_tensors():
    out = BatchedDataDict.from_batches(
        [
            {"m": torch.tensor([[True]]), "lp": torch.tensor([[-0.5]])},
            {"m": torch.tensor([[True, True]]), "lp": torch.tensor([[-1.0, -2.0]])},
        ],
        pad_value_dict={"lp": float("-inf")},
    )
    assert out["m"].dtype == torch.bool
    assert out["m"].tolist() == [[True, False], [True, True]]
    assert out["lp"].tolist() == [[-0.5, float("-inf")], [-1.0, -2.0]]


def test_from_batches_pads_3d_tensors_along_dim_1():
    a = torch.arange(6).reshape(1, 2, 3)
    b = torch.arange(100, 124).reshape(2, 4, 3)
    out = BatchedDataDict.from_batches([{"e": a}, {"e": b}], pad_value_dict={"e": 7})["e"]
    assert out.shape == (3, 4, 3)
    assert out[0].tolist() == [[0, 1, 2], [3, 4, 5], [7, 7, 7], [7, 7, 7]]
    assert torch.equal(out[1:], b)


def test_from_batches_of_nothing_is_empty():
    out = BatchedDataDict.from_batches([])
    assert type(out) is BatchedDataDict
    assert out == {}


def test_from_batches_with_empty_batches_keeps_the_others():
    full = _numbered(3)
    out = BatchedDataDict.from_batches([full.select_indices([]), full, full.slice(0, 0)])
    _assert_same(out, full)


def test_from_batches_missing_key_names_it_and_the_batches():
    with pytest.raises(
        MissingKeyError, match=r"key 'mask' is missing from non-empty batches \[1\]"
    ):
        BatchedDataDict.from_batches(
            [{"ids": [1], "mask": [1]}, {"ids": [2]}, {"ids": [3], "mask": [0]}]
        )
    # The first batch lacking a key that a later one has is just as wrong; it is also a
    # KeyError and a ValueError.
    with pytest.raises(KeyError, match=r"'extra' is missing from non-empty batches \[0\]"):
        BatchedDataDict.from_batches([{"ids": [1]}, {"ids": [2], "extra": [0]}])
    with pytest.raises(ValueError, match="'extra'"):
        BatchedDataDict.from_batches([{"ids": [1]}, {"ids": [2], "extra": [0]}])


def test_from_batches_lets_empty_batches_omit_keys():
    empty = {"ids": torch.zeros((0, 0), dtype=torch.long)}
    full = {"ids": torch.tensor([[1, 2, 3]]), "extra": torch.full((1, 2, 2), 7), "t": ["a"]}
    for batches in ([empty, full], [{}, full], [full, BatchedDataDict(), empty]):
        out = BatchedDataDict.from_batches(batches)
        assert out["ids"].tolist() == [[1, 2, 3]]
        assert torch.equal(out["extra"], full["extra"])
        assert out["t"] == ["a"]
    # Only empty batches hold a key: their values keep its dtype and trailing shape.
    only_empty = BatchedDataDict.from_batches([{"x": torch.zeros(0, 3, dtype=torch.int8)}, {}])
    assert only_empty["x"].shape == (0, 3)
    assert only_empty["x"].dtype == torch.int8


def test_from_batches_pads_4d_tensors_along_dim_1():
    a = torch.arange(8).reshape(1, 2, 2, 2)
    b = torch.arange(100, 124).reshape(1, 3, 2, 4)[..., :2]
    out = BatchedDataDict.from_batches([{"r": a}, {"r": b}], pad_value_dict={"r": -1})["r"]
    assert out.shape == (2, 3, 2, 2)
    assert torch.equal(out[0, :2], a[0])
    assert out[0, 2].tolist() == [[-1, -1], [-1, -1]]
    assert torch.equal(out[1], b[0])


def test_from_batches_rejects_tensors_differing_after_the_sequence_dim():
    with pytest.raises(ValueError, match=r"column 'r' has tensors whose dims after the sequence"):
        BatchedDataDict.from_batches([{"r": torch.zeros(1, 2, 3)}, {"r": torch.zeros(1, 2, 4)}])


def test_from_batches_mismatched_sizes_inside_a_batch_names_the_keys():
    with pytest.raises(ValueError, match=r"batch 1 has mismatched column sizes \{'a': 1, 'b': 2\}"):
        BatchedDataDict.from_batches([{"a": [1], "b": [1]}, {"a": [1], "b": [1, 2]}])


def test_from_batches_mixing_lists_and_tensors_names_the_key():
    with pytest.raises(TypeError, match=r"column 'v' mixes value types \['Tensor', 'list'\]"):
        BatchedDataDict.from_batches([{"v": [1]}, {"v": torch.tensor([2])}])


def test_from_batches_mixing_tensor_ranks_names_the_key():
    with pytest.raises(ValueError, match=r"column 'v' mixes tensor ranks \[1, 2\]"):
        BatchedDataDict.from_batches([{"v": torch.tensor([1])}, {"v": torch.tensor([[2]])}])


def test_from_batches_unsupported_type_names_the_key():
    with pytest.raises(TypeError, match="column 'v' holds a str"):
        BatchedDataDict.from_batches([{"v": "abc"}])


def test_from_batches_zero_dim_tensor_names_the_key():
    with pytest.raises(ValueError, match="column 'v' is a 0-d tensor"):
        BatchedDataDict.from_batches([{"v": torch.tensor([1])}, {"v": torch.tensor(2)}])


# --- properties ---------------------------------------------------------------------------


@st.composite
def batches(draw, min_size: int = 0, max_size: int = 8) -> BatchedDataDict:
    """A batch with a 1-D int column, a 2-D float column, a 3-D column and a list column."""
    n = draw(st.integers(min_size, max_size))
    width = draw(st.integers(0, 4))
    ints = draw(st.lists(st.integers(-(2**40), 2**40), min_size=n, max_size=n))
    floats = draw(st.lists(st.floats(-1e6, 1e6, width=32), min_size=n * width, max_size=n * width))
    items = draw(st.lists(st.lists(st.text(max_size=3), max_size=2), min_size=n, max_size=n))
    return BatchedDataDict(
        {
            "i": torch.tensor(ints, dtype=torch.int64),
            "f": torch.tensor(floats, dtype=torch.float32).reshape(n, width),
            "e": torch.arange(n * width * 2, dtype=torch.int32).reshape(n, width, 2),
            "items": items,
        }
    )


@settings(max_examples=60, deadline=None)
@given(data=st.data(), batch=batches())
def test_select_indices_list_and_tensor_agree_and_pick_each_row(data, batch):
    n = batch.size
    indices = data.draw(st.lists(st.integers(-n, max(n - 1, 0)), max_size=10 if n else 0))
    from_list = batch.select_indices(indices)
    _assert_same(from_list, batch.select_indices(torch.tensor(indices, dtype=torch.long)))
    assert from_list.size == len(indices)
    for j, i in enumerate(indices):
        assert torch.equal(from_list["f"][j], batch["f"][i])
        assert torch.equal(from_list["e"][j], batch["e"][i])
        assert from_list["i"][j].item() == batch["i"][i].item()
        assert from_list["items"][j] == batch["items"][i]


@settings(max_examples=60, deadline=None)
@given(data=st.data(), batch=batches())
def test_slice_equals_selecting_the_range(data, batch):
    start = data.draw(st.integers(0, batch.size))
    end = data.draw(st.integers(start, batch.size))
    _assert_same(batch.slice(start, end), batch.select_indices(list(range(start, end))))


@settings(max_examples=60, deadline=None)
@given(data=st.data(), batch=batches())
def test_shards_fed_back_to_from_batches_reproduce_the_batch(data, batch):
    shards = data.draw(st.integers(1, 10))
    parts = batch.shard_by_batch_size(shards, allow_uneven_shards=True)
    k = -(-batch.size // shards)
    assert [p.size for p in parts] == [max(0, min(k, batch.size - s * k)) for s in range(shards)]
    _assert_same(BatchedDataDict.from_batches(parts), batch)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), batch=batches(min_size=1, max_size=12))
def test_shards_with_batch_size_hold_each_chunks_parts_in_order(data, batch):
    n = batch.size
    batch_size = data.draw(st.sampled_from([d for d in range(1, n + 1) if n % d == 0]))
    shards = data.draw(
        st.sampled_from([d for d in range(1, batch_size + 1) if batch_size % d == 0])
    )
    parts = batch.shard_by_batch_size(shards, batch_size=batch_size)
    # Walk the chunks: shard s holds, for each chunk in order, its contiguous part of it.
    rebuilt, taken = [], [0] * shards
    k = batch_size // shards
    for _chunk in range(n // batch_size):
        for s, part in enumerate(parts):
            rebuilt.append(part.slice(taken[s], taken[s] + k))
            taken[s] += k
    assert taken == [p.size for p in parts]
    _assert_same(BatchedDataDict.from_batches(rebuilt), batch)


@settings(max_examples=60, deadline=None)
@given(
    rows=st.lists(
        st.tuples(st.integers(1, 3), st.integers(0, 5)), min_size=1, max_size=5
    ),  # (batch size, width) of each batch
    pad=st.integers(-5, 5),
)
def test_from_batches_padding_only_adds_pad_values(rows, pad):
    parts, start = [], 0
    for size, width in rows:
        ids = torch.arange(start, start + size * width).reshape(size, width) + 100
        parts.append({"ids": ids, "w": [width] * size, "n": torch.full((size,), width)})
        start += size * width
    out = BatchedDataDict.from_batches(parts, pad_value_dict={"ids": pad})
    widest = max(width for _, width in rows)
    assert out["ids"].shape == (sum(size for size, _ in rows), widest)
    assert out["w"] == out["n"].tolist() == [w for size, w in rows for _ in range(size)]
    row = 0
    for part in parts:
        for original in part["ids"]:
            width = len(original)
            assert torch.equal(out["ids"][row, :width], original)
            assert out["ids"][row, width:].tolist() == [pad] * (widest - width)
            row += 1
    # Cutting each batch's rows and columns back out restores it exactly.
    row = 0
    for part, (size, width) in zip(parts, rows):
        assert torch.equal(out.slice(row, row + size)["ids"][:, :width], part["ids"])
        row += size


@settings(max_examples=40, deadline=None)
@given(batch=batches(), num_repeats=st.integers(1, 4))
def test_repeat_interleave_every_kth_row_is_the_original(batch, num_repeats):
    before = copy.deepcopy(batch["items"])
    out = batch.repeat_interleave(num_repeats)
    assert out.size == batch.size * num_repeats
    for offset in range(num_repeats):
        picked = out.select_indices(list(range(offset, out.size, num_repeats)))
        _assert_same(picked, batch)
    for j, item in enumerate(out["items"]):
        item.append(f"mutated {j}")
    assert batch["items"] == before


# --- deduplicated media through row operations ---------------------------------------------


def _grpo_media_batch() -> tuple[BatchedDataDict, list[list[torch.Tensor]]]:
    """3 prompts x 4 generations: each row references its prompt's image (stored once per
    prompt); odd generations also hold an image of their own (a second turn)."""
    from envloop.distributed.packed_tensor import PackedTensor

    prompts = [
        PackedTensor(torch.full((p + 1, 3), float(p)), 0).enable_deduplication() for p in range(3)
    ]
    rows, expected = [], []
    for p, prompt in enumerate(prompts):
        for g in range(4):
            own = [torch.full((1, 3), 10.0 * p + g)] if g % 2 else []
            rows.append(PackedTensor.merge_segments([prompt, *(PackedTensor(t, 0) for t in own)]))
            expected.append([prompt.tensors[0], *own])
    lengths = [3 + (i * 5) % 7 for i in range(12)]
    batch = BatchedDataDict(
        {
            "sid": torch.arange(12),
            "input_ids": torch.tensor([[i] * 9 for i in range(12)]),
            "input_lengths": torch.tensor(lengths),
            "pixel_values": PackedTensor.flattened_concat(rows),
        }
    )
    return batch, expected


def _assert_media_aligned(batch: BatchedDataDict, expected: list[list[torch.Tensor]]) -> None:
    pixels = batch["pixel_values"]
    assert len(pixels) == batch.size
    wanted = {id(t): t for sid in batch["sid"].tolist() for t in expected[sid]}
    assert sorted(map(id, pixels.tensors)) == sorted(wanted)  # each referenced image once
    for row, sid in enumerate(batch["sid"].tolist()):
        assert torch.equal(pixels[row], torch.cat(expected[sid]))


def test_deduplicated_media_stays_aligned_and_stored_once_per_shard():
    batch, expected = _grpo_media_batch()
    assert len(batch["pixel_values"].tensors) == 3 + 6
    _assert_media_aligned(batch, expected)
    dynamic = {
        "max_tokens_per_microbatch": 18,
        "sequence_length_round": 2,
        "input_key": "input_ids",
        "input_lengths_key": "input_lengths",
    }
    packing = {
        "max_tokens_per_microbatch": 16,
        "input_key": "input_ids",
        "input_lengths_key": "input_lengths",
        "algorithm": "modified_first_fit_decreasing",
        "sequence_length_pad_multiple": 4,
    }
    plain = batch.shard_by_batch_size(2, batch_size=6)
    with_dynamic, _ = batch.shard_by_batch_size(2, dynamic_batching_args=dynamic)
    with_packing, order = batch.shard_by_batch_size(2, sequence_packing_args=packing)
    for shards in (plain, with_dynamic, with_packing):
        for shard in shards:
            _assert_media_aligned(shard, expected)
        _assert_media_aligned(BatchedDataDict.from_batches(shards), expected)
    joined = BatchedDataDict.from_batches(with_packing)
    joined.reorder_data(order)
    assert joined["sid"].tolist() == list(range(12))
    _assert_media_aligned(joined, expected)
    for part in (
        batch.chunk(rank=1, chunks=3),
        batch.select_indices([11, 0, 4, 4]),
        batch.slice(2, 7),
    ):
        _assert_media_aligned(part, expected)
    assert len(batch.chunk(rank=0, chunks=3)["pixel_values"].tensors) == 1 + 2  # prompt 0


def test_from_batches_can_fill_a_media_key_that_some_batches_lack():
    from envloop.distributed.packed_tensor import PackedTensor

    audio = PackedTensor(torch.ones(1, 5), 0).enable_deduplication()
    image = PackedTensor(torch.zeros(2, 3), 0).enable_deduplication()
    images = BatchedDataDict(
        {"input_ids": torch.ones(2, 2), "pixel_values": PackedTensor.concat([image] * 2)}
    )
    sounds = BatchedDataDict({"input_ids": torch.ones(1, 2), "audio_values": audio})
    with pytest.raises(KeyError, match="or pass allow_missing_packed_tensors=True"):
        BatchedDataDict.from_batches([images, sounds])
    joined = BatchedDataDict.from_batches([images, sounds], allow_missing_packed_tensors=True)
    assert joined["pixel_values"].logical_segment_counts_by_row() == [1, 1, 0]
    assert joined["audio_values"].logical_segment_counts_by_row() == [0, 0, 1]
    assert len(joined["pixel_values"].tensors) == 1
