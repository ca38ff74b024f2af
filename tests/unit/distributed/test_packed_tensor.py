"""PackedTensor, and BatchedDataDict columns that are PackedTensors (per-sample image data).

The property tests carry a sample id in every column and check, after any sequence of row
operations, that each row's image data is still its own sample's, and the same tensor and
PIL objects (no image data copied).
"""

from __future__ import annotations

import copy
import pickle
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from envloop.distributed.batched_data_dict import BatchedDataDict, BatchSplitError, MissingKeyError
from envloop.distributed.packed_tensor import PackedTensor, common_dim_to_pack

D = 4  # width of a stand-in patch row (pixel_values are [patches, D])


def _patches(sample: int, count: int, image: int = 0) -> torch.Tensor:
    """[count, D] float32 whose first column is the sample id and second the image index."""
    out = torch.arange(count * D, dtype=torch.float32).reshape(count, D) / 100
    out[:, 0] = sample
    out[:, 1] = image
    return out


def _packed(*items: torch.Tensor | None) -> PackedTensor:
    return PackedTensor(list(items), dim_to_pack=0)


def _same_items(packed, expected: list) -> bool:
    """``packed`` holds exactly the objects of ``expected`` (tensors or None), in order."""
    items = list(packed)
    return len(items) == len(expected) and all(a is b for a, b in zip(items, expected))


# --- PackedTensor -------------------------------------------------------------------------


def test_the_published_path_is_the_same_class():
    from envloop.data import multimodal_utils

    assert multimodal_utils.PackedTensor is PackedTensor
    assert "PackedTensor" in multimodal_utils.__all__


def test_as_tensor_concatenates_the_present_items_along_dim_to_pack():
    a, b = _patches(0, 2), _patches(2, 1)
    packed = _packed(a, None, b)
    assert len(packed) == 3
    assert packed.present == [a, b]
    assert torch.equal(packed.as_tensor(), torch.cat([a, b]))
    assert _packed(a).as_tensor() is a
    assert _packed(None, None).as_tensor() is None
    grids = PackedTensor([torch.ones(3, 2, 1), torch.zeros(3, 5, 1)], dim_to_pack=1)
    assert grids.as_tensor().shape == (3, 7, 1)


def test_slice_and_repeat_interleave_share_the_item_tensors():
    a, b, c = _patches(0, 1), _patches(1, 2), _patches(2, 3)
    packed = _packed(a, b, c)
    assert _same_items(packed.slice([2, 0, 2]), [c, a, c])
    assert all(x is y for x, y in zip(packed.slice(torch.tensor([2, 0])), [c, a]))
    assert packed.slice(slice(1, None)).tensors[0] is b
    assert packed.slice([-1])[0] is c
    assert isinstance(packed[1:], PackedTensor) and _same_items(packed[1:], [b, c])
    assert packed[-1] is c
    repeated = packed.repeat_interleave(2)
    assert [t.data_ptr() for t in repeated] == [t.data_ptr() for t in (a, a, b, b, c, c)]
    assert all(x is y for x, y in zip(repeated, (a, a, b, b, c, c)))


def test_concat_joins_items_and_flattened_concat_makes_one_item_per_entry():
    a, b, c = _patches(0, 1), _patches(1, 2), _patches(2, 3)
    joined = PackedTensor.concat([_packed(a), _packed(None, b), _packed()])
    assert _same_items(joined, [a, None, b])
    flat = PackedTensor.flattened_concat([_packed(a, b), None, _packed(None), _packed(c)])
    assert len(flat) == 4
    assert torch.equal(flat[0], torch.cat([a, b]))
    assert flat[1] is None and flat[2] is None
    assert flat[3] is c
    assert _same_items(PackedTensor.empty_like(_packed(a), 2), [None, None])


def test_deepcopy_copies_the_tensors_once_as_published():
    a = _patches(0, 2)
    packed = _packed(a, None, a)
    copied = copy.deepcopy({"x": packed, "again": packed})
    assert copied["x"] is copied["again"]  # the memo keeps one copy per object
    assert copied["x"] is not packed and not copied["x"].deduplication_enabled
    assert copied["x"][0] is not a and torch.equal(copied["x"][0], a)
    assert copied["x"][2] is copied["x"][0] and copied["x"][1] is None  # a tensor held twice
    copied["x"].tensors.append(a)
    assert len(packed) == 3


def test_deepcopy_of_a_deduplicated_value_shares_the_tensors_but_not_the_item_list():
    a = _patches(0, 2)
    packed = _packed(a, None).enable_deduplication()
    copied = copy.deepcopy(packed)
    assert copied is not packed and copied[0] is a
    assert copied._segment_provenance == packed._segment_provenance
    assert copied._segment_provenance is not packed._segment_provenance
    copied.tensors.append(a)
    assert len(packed) == 2
    shared = _packed(a).sharing_copy()
    assert shared[0] is a and not shared.deduplication_enabled


def test_to_moves_every_item_and_keeps_nones():
    moved = _packed(_patches(0, 2), None).to("meta")
    assert moved[0].device.type == "meta" and moved[0].shape == (2, D)
    assert moved[1] is None


def test_pickling_keeps_items_and_dim():
    a = _patches(3, 2)
    restored = pickle.loads(pickle.dumps(PackedTensor([None, a], dim_to_pack=1)))
    assert restored.dim_to_pack == 1
    assert restored[0] is None and torch.equal(restored[1], a)


@pytest.mark.parametrize(
    ("items", "error", "message"),
    [
        ([[1.0, 2.0]], TypeError, "PackedTensor item 0 is a list; items are tensors or None"),
        ([None, torch.tensor(1.0)], ValueError, r"item 1 has shape \(\), which has no dimension 0"),
        ("ab", TypeError, "takes a tensor or a list of tensors"),
    ],
)
def test_constructor_rejects_bad_items(items, error, message):
    with pytest.raises(error, match=message):
        PackedTensor(items, dim_to_pack=0)


def test_a_single_tensor_is_one_item():
    a = _patches(0, 2)
    assert _same_items(PackedTensor(a, dim_to_pack=0), [a])


def test_values_packed_along_different_dims_raise_naming_the_key():
    with pytest.raises(ValueError, match="'pixel_values' are packed along different dimensions"):
        common_dim_to_pack([_packed(), PackedTensor([], dim_to_pack=1)], "pixel_values")
    with pytest.raises(ValueError, match=r"different dimensions: \[0, 1\]"):
        PackedTensor.concat([_packed(), PackedTensor([], dim_to_pack=1)])


# --- BatchedDataDict with PackedTensor columns --------------------------------------------


def _image_batch() -> tuple[BatchedDataDict, list[torch.Tensor | None]]:
    """Four rows; rows 1 and 3 have images, row 0 and 2 none."""
    items = [None, _patches(1, 2), None, _patches(3, 1)]
    batch = BatchedDataDict(
        {"sid": torch.arange(4), "name": ["s0", "s1", "s2", "s3"], "pixel_values": _packed(*items)}
    )
    return batch, items


def test_size_counts_items_and_mismatched_sizes_name_the_key():
    batch, _ = _image_batch()
    assert batch.size == 4
    batch["pixel_values"] = _packed(None)
    with pytest.raises(BatchSplitError, match="'sid' has 4, 'pixel_values' has 1"):
        _ = batch.size


def test_copy_and_get_dict_keep_the_same_packed_tensor():
    batch, _ = _image_batch()
    assert batch.copy()["pixel_values"] is batch["pixel_values"]
    plain = batch.get_dict()
    assert type(plain) is dict and plain["pixel_values"] is batch["pixel_values"]


def test_select_indices_takes_items_by_list_or_tensor():
    batch, items = _image_batch()
    for indices in ([3, 1, 3, -4], torch.tensor([3, 1, 3, -4])):
        out = batch.select_indices(indices)
        assert out["sid"].tolist() == [3, 1, 3, 0]
        assert isinstance(out["pixel_values"], PackedTensor)
        assert out["pixel_values"].tensors[:3] == [items[3], items[1], items[3]]
        assert out["pixel_values"][0] is items[3] and out["pixel_values"][3] is None


def test_slice_takes_the_same_items():
    batch, items = _image_batch()
    out = batch.slice(1, 3)
    assert out["name"] == ["s1", "s2"]
    assert out["pixel_values"][0] is items[1] and out["pixel_values"][1] is None
    assert len(batch.slice(3, 10)["pixel_values"]) == 1


def _media_log(image: Image.Image, encoded: bytes, buffer: bytearray, pixels: torch.Tensor):
    return [
        {
            "role": "user",
            "content": [{"type": "image", "image": image}, {"type": "text", "text": "hi"}],
            "token_ids": torch.tensor([1, 2, 3]),
            "pixel_values": _packed(pixels),
        },
        {"role": "user", "content": [{"type": "image", "image": encoded}]},
        {"role": "user", "content": [{"type": "image", "image": {"bytes": buffer}}]},
    ]


def test_repeat_interleave_copies_image_data_unless_asked_to_share_it():
    image = Image.new("RGB", (5, 3), (9, 8, 7))
    encoded = b"\x89PNG not really"
    buffer = bytearray(encoded)
    pixels = _patches(0, 2)
    log = _media_log(image, encoded, buffer, pixels)
    plain = BatchedDataDict({"message_log": [log]}).repeat_interleave(2)["message_log"]
    for copy_ in plain:
        assert copy_[0]["content"][0]["image"] is not image
        assert copy_[0]["content"][0]["image"].tobytes() == image.tobytes()
        assert copy_[2]["content"][0]["image"]["bytes"] is not buffer
        assert copy_[0]["pixel_values"][0] is not pixels
        assert torch.equal(copy_[0]["pixel_values"][0], pixels)
    out = BatchedDataDict({"message_log": [log]}).repeat_interleave(3, share_immutable_media=True)
    first, second = out["message_log"][0], out["message_log"][1]
    assert first is not second and first is not log
    for copy_ in (first, second):
        assert copy_[0]["content"][0]["image"] is image
        assert copy_[1]["content"][0]["image"] is encoded
        assert copy_[2]["content"][0]["image"]["bytes"] is buffer
        assert copy_[0]["pixel_values"][0] is pixels
        assert copy_[0]["pixel_values"] is not log[0]["pixel_values"]
        assert copy_[0]["token_ids"].data_ptr() != log[0]["token_ids"].data_ptr()
    first[0]["content"].append({"type": "text", "text": "mine"})
    first[0]["token_ids"][0] = 99
    assert len(second[0]["content"]) == 2 and len(log[0]["content"]) == 2
    assert log[0]["token_ids"].tolist() == [1, 2, 3]


def test_shard_by_batch_size_deals_items_with_their_rows():
    batch, items = _image_batch()
    shards = batch.shard_by_batch_size(2)
    assert [s["sid"].tolist() for s in shards] == [[0, 1], [2, 3]]
    assert _same_items(shards[1]["pixel_values"], [None, items[3]])
    shards = batch.shard_by_batch_size(2, batch_size=2)
    assert [s["sid"].tolist() for s in shards] == [[0, 2], [1, 3]]
    assert shards[1]["pixel_values"][0] is items[1]
    shards = batch.slice(0, 3).shard_by_batch_size(2, allow_uneven_shards=True)
    assert _same_items(shards[0]["pixel_values"], [None, items[1]])
    assert _same_items(shards[1]["pixel_values"], [None])


def _length_batch() -> BatchedDataDict:
    lengths = [5, 1, 4, 2]
    return BatchedDataDict(
        {
            "input_ids": torch.tensor([[i] * 5 for i in range(4)]),
            "input_lengths": torch.tensor(lengths),
            "pixel_values": _packed(*[_patches(i, i + 1) for i in range(4)]),
        }
    )


def test_dynamic_batching_and_packing_move_items_with_their_rows():
    batch = _length_batch()
    dynamic = {
        "max_tokens_per_microbatch": 10,
        "sequence_length_round": 1,
        "input_key": "input_ids",
        "input_lengths_key": "input_lengths",
    }
    packing = {
        "max_tokens_per_microbatch": 6,
        "input_key": "input_ids",
        "input_lengths_key": "input_lengths",
        "algorithm": "first_fit_decreasing",
    }
    for args in ({"dynamic_batching_args": dynamic}, {"sequence_packing_args": packing}):
        shards, order = batch.shard_by_batch_size(2, **args)
        rows = [int(r) for s in shards for r in s["input_ids"][:, 0]]
        assert sorted(rows) == [0, 1, 2, 3]
        for shard in shards:
            for row, item in zip(shard["input_ids"][:, 0], shard["pixel_values"]):
                assert item is batch["pixel_values"][int(row)]
        if "sequence_packing_args" in args:
            assert rows == order
            joined = BatchedDataDict.from_batches(shards)
            joined.reorder_data(order)
            assert _same_items(joined["pixel_values"], batch["pixel_values"].tensors)
            micro = list(shards[0].make_microbatch_iterator_for_packable_sequences())
            for m in micro:
                rows = [int(r) for r in m["input_ids"][:, 0]]
                assert _same_items(m["pixel_values"], [batch["pixel_values"][r] for r in rows])
        else:
            micro = list(shards[0].make_microbatch_iterator_with_dynamic_shapes())
            for m in micro:  # token tensors are cut to the micro-batch length, images are not
                rows = [int(r) for r in m["input_ids"][:, 0]]
                assert _same_items(m["pixel_values"], [batch["pixel_values"][r] for r in rows])


def test_sharding_by_a_packed_lengths_or_input_column_names_it():
    batch = _length_batch()
    packing = {
        "max_tokens_per_microbatch": 6,
        "input_key": "input_ids",
        "input_lengths_key": "pixel_values",
        "algorithm": "first_fit_decreasing",
    }
    with pytest.raises(TypeError) as raised:
        batch.shard_by_batch_size(2, sequence_packing_args=packing)
    assert str(raised.value) == (
        "input_lengths_key 'pixel_values' is a PackedTensor column (per-sample items such as "
        "images); set input_lengths_key to the [B] column of lengths."
    )
    dynamic = {
        "max_tokens_per_microbatch": 10,
        "sequence_length_round": 1,
        "input_key": "pixel_values",
        "input_lengths_key": "input_lengths",
    }
    with pytest.raises(TypeError) as raised:
        batch.shard_by_batch_size(2, dynamic_batching_args=dynamic)
    assert str(raised.value) == (
        "input_key 'pixel_values' must be the [B, L] tensor column of token ids, got "
        "PackedTensor[4, 4 present] float32; set input_key to that column."
    )


def test_microbatch_iteration_chunk_and_get_batch_slice_items():
    batch, items = _image_batch()
    micro = list(batch.make_microbatch_iterator(2))
    assert len(micro) == 2
    assert _same_items(micro[0]["pixel_values"], [None, items[1]])
    assert _same_items(micro[1]["pixel_values"], [None, items[3]])
    assert _same_items(batch.chunk(rank=1, chunks=2)["pixel_values"], [None, items[3]])
    assert batch.get_batch(1, batch_size=2)["pixel_values"][1] is items[3]
    batch.truncate_tensors(dim=0, truncated_len=1)  # only tensors with more than one dim
    assert _same_items(batch["pixel_values"], items)


def test_from_batches_concatenates_packed_items():
    batch, items = _image_batch()
    empty = BatchedDataDict({"sid": torch.zeros(0, dtype=torch.long)})  # may lack keys
    out = BatchedDataDict.from_batches([batch.slice(2, 4), empty, batch.slice(0, 2)])
    assert out["sid"].tolist() == [2, 3, 0, 1]
    assert _same_items(out["pixel_values"], [None, items[3], None, items[1]])
    assert out["pixel_values"][1] is items[3]


def test_from_batches_of_empty_packed_batches_keeps_a_packed_column():
    out = BatchedDataDict.from_batches([{"p": _packed()}, {"p": _packed()}])
    assert isinstance(out["p"], PackedTensor) and len(out["p"]) == 0


def test_from_batches_rejects_a_packed_key_of_another_type_naming_it():
    batch, _ = _image_batch()
    other = batch.slice(0, 2)
    other["pixel_values"] = [None, None]
    with pytest.raises(TypeError) as raised:
        BatchedDataDict.from_batches([batch, other])
    assert str(raised.value) == (
        "from_batches: column 'pixel_values' is a PackedTensor in some batches and a list in "
        "batches [1]. Give it as a PackedTensor in every batch; a batch whose samples lack "
        "this input holds PackedTensor([None] * rows, dim_to_pack)."
    )


def test_from_batches_rejects_a_missing_packed_key_naming_it():
    batch, _ = _image_batch()
    other = batch.slice(0, 2)
    del other["pixel_values"]
    with pytest.raises(MissingKeyError) as raised:
        BatchedDataDict.from_batches([batch, other])
    assert str(raised.value) == (
        "from_batches: key 'pixel_values' is missing from non-empty batches [1]. Every "
        "non-empty batch needs every key (only empty batches may omit keys); add "
        "'pixel_values' to those batches or drop it from the others. 'pixel_values' is a "
        "PackedTensor: a batch whose samples lack it holds PackedTensor([None] * rows, "
        "dim_to_pack), or pass allow_missing_packed_tensors=True."
    )


def test_from_batches_rejects_packed_values_along_different_dims_naming_the_key():
    a = {"p": _packed(_patches(0, 1))}
    b = {"p": PackedTensor([torch.ones(1, 1)], dim_to_pack=1)}
    with pytest.raises(ValueError, match=r"for key 'p' are packed along different dimensions"):
        BatchedDataDict.from_batches([a, b])


def test_to_moves_packed_items():
    batch, _ = _image_batch()
    moved = batch.to("meta")
    assert moved is batch
    assert moved["pixel_values"][1].device.type == "meta"
    assert moved["pixel_values"][0] is None


def test_repr_summarizes_packed_columns():
    batch, _ = _image_batch()
    assert repr(batch) == (
        "BatchedDataDict(\n"
        "  sid: Tensor[4] int64,\n"
        "  name: list[4],\n"
        "  pixel_values: PackedTensor[4, 2 present] float32,\n"
        ")"
    )
    assert "PackedTensor[1, 0 present]," in repr(BatchedDataDict({"p": _packed(None)}))


def test_a_batched_data_dict_with_packed_columns_pickles():
    batch, items = _image_batch()
    restored = pickle.loads(pickle.dumps(batch))
    assert restored["pixel_values"][0] is None
    assert torch.equal(restored["pixel_values"][1], items[1])


# --- properties: image data stays with its sample -----------------------------------------


@dataclass
class Sample:
    """What a row of sample ``sid`` must hold, as the objects it was built from."""

    sid: int
    pixels: torch.Tensor | None  # [patches, D], the sample's images concatenated
    per_image: list[torch.Tensor]  # the user message's pixel_values items, one per image
    grid: torch.Tensor | None  # [images, 3]
    images: list[Image.Image]
    length: int


def _build(patch_counts: list[list[int]], lengths: list[int]) -> tuple[BatchedDataDict, dict]:
    """A batch with one row per sample: ids, tokens, image columns and a message log."""
    samples, logs = {}, []
    for sid, (counts, length) in enumerate(zip(patch_counts, lengths)):
        per_image = [_patches(sid, n, k) for k, n in enumerate(counts)]
        pixels = torch.cat(per_image) if per_image else None
        grid = torch.tensor([[1, n, sid] for n in counts]) if counts else None
        images = [Image.new("RGB", (1 + k, 1), (sid, k, 0)) for k in range(len(counts))]
        samples[sid] = Sample(sid, pixels, per_image, grid, images, length)
        user = {
            "role": "user",
            "content": [{"type": "image", "image": im} for im in images]
            + [{"type": "text", "text": f"sample {sid}"}],
            "token_ids": torch.full((length,), sid),
        }
        if counts:
            user["pixel_values"] = _packed(*per_image)
            user["image_grid_thw"] = _packed(grid)
        logs.append([user, {"role": "assistant", "content": str(sid)}])
    width = max(lengths)
    batch = BatchedDataDict(
        {
            "sample_id": list(samples),
            "sid": torch.arange(len(samples)),
            "input_ids": torch.tensor(
                [[sid] * n + [-1] * (width - n) for sid, n in enumerate(lengths)]
            ),
            "input_lengths": torch.tensor(lengths),
            "pixel_values": _packed(*[s.pixels for s in samples.values()]),
            "image_grid_thw": _packed(*[s.grid for s in samples.values()]),
            "message_log": logs,
        }
    )
    return batch, samples


def _assert_aligned(batch: BatchedDataDict, samples: dict[int, Sample]) -> None:
    """Every row holds its own sample's data, image data as the very same objects."""
    assert batch.size == len(batch["sample_id"])
    for i, sid in enumerate(batch["sample_id"]):
        want = samples[sid]
        assert int(batch["sid"][i]) == sid
        assert int(batch["input_lengths"][i]) == want.length
        assert batch["input_ids"][i, : want.length].tolist() == [sid] * want.length
        assert batch["pixel_values"][i] is want.pixels
        assert batch["image_grid_thw"][i] is want.grid
        if want.pixels is not None:
            assert bool((batch["pixel_values"][i][:, 0] == sid).all())
        user = batch["message_log"][i][0]
        images = [p["image"] for p in user["content"] if p["type"] == "image"]
        assert len(images) == len(want.images)
        assert all(got is image for got, image in zip(images, want.images))
        assert user["content"][-1]["text"] == f"sample {sid}"
        if want.pixels is None:
            assert "pixel_values" not in user
        else:
            assert len(user["pixel_values"]) == len(want.per_image)
            assert all(got is t for got, t in zip(user["pixel_values"], want.per_image))
            assert torch.equal(user["pixel_values"].as_tensor(), want.pixels)
            assert user["image_grid_thw"][0] is want.grid


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _shard(data, batch: BatchedDataDict) -> tuple[list[BatchedDataDict], str, list[int] | None]:
    """Shards of ``batch`` in a drawn mode (plain, dynamic batching or packing)."""
    size = batch.size
    shards = data.draw(st.sampled_from(_divisors(size)), label="shards")
    chunk = data.draw(
        st.sampled_from([None, *[c for c in _divisors(size) if c % shards == 0]]),
        label="batch_size",
    )
    mode = data.draw(st.sampled_from(["plain", "dynamic", "packing"]), label="mode")
    width = batch["input_ids"].shape[1]
    if mode == "plain":
        return batch.shard_by_batch_size(shards, chunk), mode, None
    if mode == "dynamic":
        args = {
            "max_tokens_per_microbatch": width * size,
            "sequence_length_round": data.draw(st.integers(1, 3), label="round"),
            "input_key": "input_ids",
            "input_lengths_key": "input_lengths",
        }
        parts, order = batch.shard_by_batch_size(shards, chunk, dynamic_batching_args=args)
        return parts, mode, order
    algorithm = data.draw(
        st.sampled_from(["concatenative", "first_fit_decreasing", "modified_first_fit_decreasing"]),
        label="algorithm",
    )
    args = {
        "max_tokens_per_microbatch": width,
        "input_key": "input_ids",
        "input_lengths_key": "input_lengths",
        "algorithm": algorithm,
    }
    parts, order = batch.shard_by_batch_size(shards, chunk, sequence_packing_args=args)
    return parts, mode, order


def _repeat(batch: BatchedDataDict, n: int) -> BatchedDataDict:
    """Each row of ``batch`` ``n`` times: its ``PackedTensor`` columns by their own
    ``repeat_interleave`` (a batch refuses them, as published), the other columns by the
    batch's, sharing media."""
    packed = {k: v for k, v in batch.items() if isinstance(v, PackedTensor)}
    rest = BatchedDataDict({k: v for k, v in batch.items() if k not in packed})
    out = rest.repeat_interleave(n, share_immutable_media=True)
    out.update({k: v.repeat_interleave(n) for k, v in packed.items()})
    return out


def _apply(data, op: str, batch: BatchedDataDict) -> BatchedDataDict:
    size = batch.size
    if op == "select":
        row = st.integers(-size, size - 1)
        rows = data.draw(st.lists(row, max_size=8) if size else st.just([]), label="rows")
        as_tensor = data.draw(st.booleans(), label="as_tensor")
        return batch.select_indices(torch.tensor(rows, dtype=torch.long) if as_tensor else rows)
    if op == "slice":
        start = data.draw(st.integers(0, size), label="start")
        return batch.slice(start, data.draw(st.integers(start, size + 1), label="end"))
    if op == "repeat":
        n = data.draw(st.integers(1, 3), label="repeats")
        out = _repeat(batch, n)
        for i in range(out.size):  # every repeat has its own log, sharing the image data
            source = batch["message_log"][i // n][0]
            mine = out["message_log"][i][0]
            assert mine is not source and mine["content"] is not source["content"]
            assert mine["token_ids"].data_ptr() != source["token_ids"].data_ptr()
            if "pixel_values" in source:
                assert mine["pixel_values"][0].data_ptr() == source["pixel_values"][0].data_ptr()
            assert out["pixel_values"][i] is batch["pixel_values"][i // n]
        return out
    if op == "split_join":
        cut = data.draw(st.integers(0, size), label="cut")
        return BatchedDataDict.from_batches([batch.slice(cut, size), batch.slice(0, cut)])
    if op == "to":
        return batch.to("cpu")
    if size == 0:
        return batch
    parts, mode, order = _shard(data, batch)
    if op == "shard_one":
        return parts[data.draw(st.integers(0, len(parts) - 1), label="shard")]
    joined = BatchedDataDict.from_batches(parts)
    if mode == "packing":  # packing's sorted_indices undo the shard order
        restored = joined.copy()
        restored.reorder_data(order)
        assert restored["sample_id"] == batch["sample_id"]
    return joined


OPS = ["select", "slice", "repeat", "split_join", "to", "shard_one", "shard_join"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    patch_counts=st.lists(st.lists(st.integers(1, 5), max_size=3), min_size=1, max_size=6),
    ops=st.lists(st.sampled_from(OPS), max_size=4),
    data=st.data(),
)
def test_image_data_stays_with_its_sample_through_any_row_operations(patch_counts, ops, data):
    lengths = data.draw(
        st.lists(st.integers(1, 6), min_size=len(patch_counts), max_size=len(patch_counts)),
        label="lengths",
    )
    batch, samples = _build(patch_counts, lengths)
    _assert_aligned(batch, samples)
    for op in ops:
        if batch.size > 12:
            batch = batch.slice(0, 12)
        batch = _apply(data, op, batch)
        _assert_aligned(batch, samples)


@settings(max_examples=30, deadline=None)
@given(
    patch_counts=st.lists(st.lists(st.integers(1, 5), max_size=3), min_size=1, max_size=5),
    repeats=st.integers(1, 4),
)
def test_shared_repeats_never_copy_image_data(patch_counts, repeats):
    batch, samples = _build(patch_counts, [2] * len(patch_counts))

    def storage(t: torch.Tensor) -> int:
        return t.untyped_storage().data_ptr()

    out = _repeat(batch, repeats)
    assert out["sample_id"] == [sid for sid in samples for _ in range(repeats)]
    for i, sid in enumerate(out["sample_id"]):
        want, pixels, message = samples[sid], out["pixel_values"][i], out["message_log"][i][0]
        if want.pixels is None:
            assert pixels is None and "pixel_values" not in message
            continue
        assert storage(pixels) == storage(want.pixels)
        assert [storage(t) for t in message["pixel_values"]] == list(map(storage, want.per_image))
    _assert_aligned(out, samples)


# --- deduplicated (segmented) layout ------------------------------------------------------


def _shared(sample: int, count: int = 2) -> PackedTensor:
    """One row holding sample ``sample``'s image, with provenance (``enable_deduplication``)."""
    return PackedTensor(_patches(sample, count), dim_to_pack=0).enable_deduplication()


def test_a_deduplicated_image_repeated_in_every_row_is_stored_once():
    image = _shared(0)
    group = PackedTensor.concat([image, copy.deepcopy(image), image.slice([0]), image])
    assert len(group) == 4 and group.deduplication_enabled
    assert len(group.tensors) == 1 and group.tensors[0] is image.tensors[0]
    assert group.logical_segment_counts_by_row() == [1, 1, 1, 1]
    assert all(row is image.tensors[0] for row in group)
    assert torch.equal(group.as_tensor(), image.tensors[0].repeat(4, 1))


def test_equal_values_of_different_images_are_not_merged():
    a, b = _shared(0), _shared(0)  # same values, different images (no common provenance)
    joined = PackedTensor.concat([a, b, a])
    assert len(joined.tensors) == 2
    assert joined._segment_indices == [0, 1, 0]


def test_the_same_tensor_object_is_stored_once_even_without_common_provenance():
    t = _patches(1, 3)
    joined = PackedTensor.concat(
        [PackedTensor(t, 0).enable_deduplication(), PackedTensor(t, 0).enable_deduplication()]
    )
    assert joined.tensors == [t]


def test_multi_turn_rows_share_the_prompt_image_and_keep_their_own():
    prompt = _shared(0)
    turn_1, turn_2 = _patches(1, 1), _patches(2, 3)
    rows = [
        PackedTensor.merge_segments([copy.deepcopy(prompt), PackedTensor(turn_1, 0)]),
        PackedTensor.merge_segments([copy.deepcopy(prompt), PackedTensor(turn_2, 0)]),
        PackedTensor.merge_segments([copy.deepcopy(prompt)]),
    ]
    assert [len(r) for r in rows] == [1, 1, 1]
    batch = PackedTensor.flattened_concat([*rows, None])
    assert len(batch) == 4 and len(batch.tensors) == 3
    assert batch.logical_segment_counts_by_row() == [2, 2, 1, 0]
    p = prompt.tensors[0]
    assert torch.equal(batch[0], torch.cat([p, turn_1])) and torch.equal(
        batch[1], torch.cat([p, turn_2])
    )
    assert batch[2] is p and batch[3] is None and batch[-1] is None
    assert torch.equal(batch.as_tensor(), torch.cat([p, turn_1, p, turn_2, p]))
    second = batch.slice([1])
    assert second.tensors == [p, turn_2] and torch.equal(second.as_tensor(), batch[1])
    with pytest.raises(IndexError, match="row 4 is out of range for 4 rows"):
        batch[4]


def test_plain_values_merge_per_message_and_flatten_to_one_concatenated_row():
    a, b = _patches(0, 1), _patches(0, 2)
    merged = PackedTensor.merge_segments([_packed(a), _packed(b)])
    assert not merged.segmented and _same_items(merged, [a, b])
    flat = PackedTensor.flattened_concat([merged])
    assert len(flat) == 1 and torch.equal(flat[0], torch.cat([a, b]))


def test_slicing_a_deduplicated_value_keeps_only_the_segments_its_rows_reference():
    a, b = _shared(0), _shared(1)
    batch = PackedTensor.concat([a, a, b, b])
    assert [len(batch.slice(rows).tensors) for rows in ([0, 1], [2], [3, 0, -1], [])] == [
        1,
        1,
        2,
        0,
    ]
    picked = batch.slice(torch.tensor([3, 0]))
    assert picked.tensors == [b.tensors[0], a.tensors[0]] and picked._segment_indices == [0, 1]
    assert picked._segment_provenance == [b._segment_provenance[0], a._segment_provenance[0]]
    assert len(batch[1:3]) == 2 and len(batch.repeat_interleave(3)) == 12
    assert len(batch.repeat_interleave(3).tensors) == 2
    with pytest.raises(IndexError, match="row index -5 is out of range for 4 rows"):
        batch.slice([-5])


def test_to_dtype_casts_each_stored_float_segment_once_and_keeps_integer_metadata():
    pixels = PackedTensor.concat([_shared(0)] * 3)
    cast = pixels.to_dtype(torch.bfloat16)
    assert cast.tensors[0].dtype == torch.bfloat16 and pixels.tensors[0].dtype == torch.float32
    assert len(cast.tensors) == 1 and cast._row_offsets == pixels._row_offsets
    assert cast._segment_provenance != pixels._segment_provenance  # new data, new ids
    same = pixels.to_dtype(torch.float32)
    assert same is not pixels and same.tensors[0] is pixels.tensors[0]
    assert same._segment_provenance == pixels._segment_provenance
    assert same._row_offsets is not pixels._row_offsets
    grid = PackedTensor(torch.tensor([[1, 2, 2]]), 0).enable_deduplication()
    assert grid.to(torch.bfloat16).tensors[0].dtype == torch.int64
    moved = pixels.to("meta")
    assert moved.tensors[0].device.type == "meta" and pixels.tensors[0].device.type == "cpu"
    assert moved._segment_provenance == pixels._segment_provenance


def test_empty_like_has_the_rows_of_the_other_value_without_tensors():
    plain = _packed(_patches(0, 1), None, _patches(2, 2))
    assert _same_items(PackedTensor.empty_like(plain), [None, None, None])
    assert _same_items(PackedTensor.empty_like(plain, 1), [None])
    segmented = PackedTensor.empty_like(PackedTensor.concat([_shared(0)] * 2))
    assert len(segmented) == 2 and segmented.tensors == [] and segmented.deduplication_enabled
    assert segmented.as_tensor() is None and list(segmented) == [None, None]
    with pytest.raises(ValueError, match="num_rows >= 0, got -1"):
        PackedTensor.empty_rows_like(plain, -1)


def test_cloudpickle_round_trips_a_deduplicated_value():
    from ray import cloudpickle

    batch = PackedTensor.flattened_concat(
        [PackedTensor.merge_segments([_shared(0), _packed(_patches(1, 1))]), _shared(2)]
    )
    restored = cloudpickle.loads(cloudpickle.dumps(batch))
    assert restored.deduplication_enabled and len(restored) == 2 and len(restored.tensors) == 3
    assert restored._segment_provenance == batch._segment_provenance
    assert torch.equal(restored.as_tensor(), batch.as_tensor())
    again = PackedTensor.concat([restored, batch])  # same provenance: stored once
    assert len(again.tensors) == 3


@pytest.mark.parametrize(
    "state",
    [
        {"dim_to_pack": 0},  # envloop before pad_to_max_shape and deduplication
        {"dim_to_pack": 0, "pad_to_max_shape": False},  # the published class before them
    ],
)
def test_values_pickled_before_deduplication_existed_load(state):
    from ray import cloudpickle

    t = _patches(0, 2)
    old = PackedTensor.__new__(PackedTensor)
    old.__dict__ = {"tensors": [t, None], **state}
    restored = cloudpickle.loads(cloudpickle.dumps(old))
    assert not restored.deduplication_enabled and not restored.pad_to_max_shape
    assert len(restored) == 2 and restored.logical_segment_counts_by_row() == [1, 0]
    assert torch.equal(restored.as_tensor(), t)
    assert restored.enable_deduplication().deduplication_enabled


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        ({"_row_offsets": [0, 1]}, "must both be given or both be None"),
        ({"_row_offsets": [1, 1], "_segment_indices": [0]}, "must start with 0"),
        ({"_row_offsets": [0, 1, 0], "_segment_indices": [0]}, "non-decreasing"),
        ({"_row_offsets": [0, 2], "_segment_indices": [0]}, r"number of segment references \(1\)"),
        ({"_row_offsets": [0, 1], "_segment_indices": [1]}, "index the 1 physical segments"),
        ({"_segment_provenance": [b"a", b"b"]}, r"one entry per physical segment \(1\), got 2"),
    ],
)
def test_an_inconsistent_layout_is_rejected(layout, message):
    with pytest.raises(ValueError, match=message):
        PackedTensor([_patches(0, 1)], 0, **layout)


def test_a_missing_pack_dimension_is_a_value_and_an_index_error():
    with pytest.raises(ValueError) as raised:
        PackedTensor([torch.ones(1, 3, 4)], dim_to_pack=3)
    assert isinstance(raised.value, IndexError)
    assert str(raised.value) == (
        "PackedTensor item 0 has shape (1, 3, 4), which has no dimension 3 to pack along "
        "(dim_to_pack=3 is invalid for tensors with rank 3); give dim_to_pack a dimension "
        "every item has."
    )


def test_values_that_differ_in_padding_cannot_be_joined():
    with pytest.raises(ValueError, match="differ in pad_to_max_shape"):
        PackedTensor.concat([_packed(), PackedTensor([], 0, pad_to_max_shape=True)])


# --- property: deduplicated values read as their plain equivalents -----------------------


def _reference(packed: PackedTensor) -> list[list[torch.Tensor]]:
    """Each row's tensors, as a plain list (the value's meaning)."""
    return [[packed.tensors[j] for j in packed._row_refs(r)] for r in range(len(packed))]


@settings(max_examples=60, deadline=None)
@given(data=st.data(), sources=st.integers(1, 4), ops=st.lists(st.integers(0, 3), max_size=5))
def test_deduplicated_rows_through_any_operations_read_as_the_plain_rows(data, sources, ops):
    images = [PackedTensor(_patches(s, s + 1), 0).enable_deduplication() for s in range(sources)]
    picks = data.draw(st.lists(st.lists(st.integers(0, sources - 1), max_size=3), min_size=1))
    value = PackedTensor.flattened_concat(
        [
            PackedTensor.merge_segments([copy.deepcopy(images[i]) for i in p]) if p else None
            for p in picks
        ]
    )
    rows = [[images[i].tensors[0] for i in p] for p in picks]
    for op in ops:
        n = len(value)
        if op == 0 and n:
            idx = data.draw(st.lists(st.integers(-n, n - 1), max_size=6))
            value, rows = value.slice(idx), [rows[i] for i in idx]
        elif op == 1:
            k = data.draw(st.integers(1, 3))
            value, rows = value.repeat_interleave(k), [r for r in rows for _ in range(k)]
        elif op == 2:
            cut = data.draw(st.integers(0, n))
            value = PackedTensor.concat([value.slice(range(cut, n)), value.slice(range(cut))])
            rows = rows[cut:] + rows[:cut]
        else:
            from ray import cloudpickle

            value = cloudpickle.loads(cloudpickle.dumps(copy.deepcopy(value)))
            rows = [[t.clone() for t in r] for r in rows]
        assert len(value) == len(rows)
        assert sum(t is not None for t in value.tensors) <= sources  # each image at most once
        for got, want in zip(_reference(value), rows):
            assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
        flat = [t for r in rows for t in r]
        assert (value.as_tensor() is None) == (not flat)
        if flat:
            assert torch.equal(value.as_tensor(), torch.cat(flat))
