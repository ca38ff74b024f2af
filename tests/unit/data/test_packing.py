"""Sequence packing (envloop.data.packing): exact bins, bin-count rules, errors, invariants."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from envloop.data.packing import (
    ALGORITHMS,
    ConcatenativePacker,
    FirstFitDecreasingPacker,
    FirstFitShufflePacker,
    ModifiedFirstFitDecreasingPacker,
    PackingAlgorithm,
    adjust_bin_count,
    concatenative,
    first_fit_decreasing,
    first_fit_shuffle,
    get_packer,
    modified_first_fit_decreasing,
    pack_sequences,
)


def _loads(lengths: list[int], bins: list[list[int]]) -> list[int]:
    return [sum(lengths[i] for i in b) for b in bins]


# --- each algorithm, exact bins -----------------------------------------------------------


def test_concatenative_keeps_input_order_and_opens_a_bin_when_the_next_does_not_fit():
    assert concatenative([4, 1, 3, 2, 1, 3, 4, 5], 5) == [[0, 1], [2, 3], [4, 5], [6], [7]]
    assert concatenative([4, 1, 3, 2, 1, 3, 4, 5], 8) == [[0, 1, 2], [3, 4, 5], [6], [7]]
    assert concatenative([5, 5, 0], 5) == [[0], [1, 2]]


def test_first_fit_decreasing_places_longest_first_into_the_first_bin_with_room():
    lengths = [30, 70, 50, 50, 20, 80]
    bins = first_fit_decreasing(lengths, 100)
    assert bins == [[5, 4], [1, 0], [2, 3]]
    assert _loads(lengths, bins) == [100, 100, 100]


def test_first_fit_decreasing_breaks_ties_by_input_order():
    assert first_fit_decreasing([6, 6, 6, 6], 12) == [[0, 1], [2, 3]]


def test_first_fit_shuffle_is_reproducible_with_a_seeded_rng():
    lengths = [10, 20, 30, 40, 50, 60, 70, 80, 90]
    first = first_fit_shuffle(lengths, 100, random.Random(7))
    assert first == first_fit_shuffle(lengths, 100, random.Random(7))
    order = list(range(9))
    random.Random(7).shuffle(order)
    assert first[0][0] == order[0]  # the first shuffled item opens bin 0
    random.seed(3)
    global_state = first_fit_shuffle(lengths, 100)
    random.seed(3)
    assert first_fit_shuffle(lengths, 100) == global_state


def test_modified_first_fit_decreasing_exact_bins():
    # large 88, 73, 55 each open a bin; 17 + 24 pair up with 55 (backward pass);
    # 11 joins 88 and 14 joins 73 (greedy pass); 46 is left over in its own bin.
    lengths = [46, 24, 55, 88, 11, 14, 73, 17]
    bins = modified_first_fit_decreasing(lengths, 100)
    assert bins == [[3, 4], [6, 5], [2, 7, 1], [0]]
    assert _loads(lengths, bins) == [99, 87, 96, 46]


def test_modified_first_fit_decreasing_adds_a_medium_item_to_a_large_bin():
    # 60 is large, 40 medium: they share a bin; the tiny 5s fill the leftover bins.
    assert modified_first_fit_decreasing([40, 60, 5, 5], 100) == [[1, 0], [2, 3]]


def test_modified_first_fit_decreasing_leftovers_go_to_the_least_loaded_bin():
    # No large items, so everything is a leftover: each item (longest first) joins the
    # least-loaded bin when it fits; bins come out least loaded first.
    lengths = [45, 45, 30, 30]
    bins = modified_first_fit_decreasing(lengths, 100)
    assert bins == [[2, 3], [0, 1]]
    assert _loads(lengths, bins) == [60, 90]


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_every_algorithm_packs_nothing_into_no_bins(name):
    assert pack_sequences([], 10, name) == []


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_every_algorithm_rejects_a_sequence_longer_than_the_capacity(name):
    with pytest.raises(ValueError, match=r"Sequence 1 has length 150, outside \[0, 100\]"):
        pack_sequences([50, 150, 70], 100, name)


@pytest.mark.parametrize("capacity", [0, -5])
def test_capacity_must_be_positive(capacity):
    with pytest.raises(ValueError, match=f"capacity must be >= 1 token, got {capacity}"):
        first_fit_decreasing([1], capacity)


# --- bin-count rules ----------------------------------------------------------------------


def test_adjust_bin_count_moves_last_items_out_of_the_fullest_bin_first():
    assert adjust_bin_count([[0, 1, 2], [3, 4], [5]], min_bin_count=5) == [
        [0],
        [3, 4],
        [5],
        [2],
        [1],
    ]
    # The fullest bin gives until it holds one sequence, then the next fullest gives.
    assert adjust_bin_count([[0, 1], [2, 3, 4]], min_bin_count=5) == [[0], [2], [4], [3], [1]]


def test_adjust_bin_count_rounds_up_to_the_multiple():
    assert adjust_bin_count([[0, 1], [2, 3]], bin_count_multiple=4) == [[0], [2], [3], [1]]
    bins = adjust_bin_count([[0, 1], [2, 3], [4]], bin_count_multiple=2)
    assert bins == [[0, 1], [2], [4], [3]]
    assert adjust_bin_count([[0], [1]], min_bin_count=1, bin_count_multiple=2) == [[0], [1]]


def test_adjust_bin_count_without_enough_sequences_names_the_fix():
    with pytest.raises(ValueError, match=r"Cannot create 4 bins with only 3 sequences \(no bin"):
        adjust_bin_count([[0, 1], [2]], min_bin_count=4)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_bin_count": -1}, "min_bin_count must be >= 0, got -1"),
        ({"bin_count_multiple": 0}, "bin_count_multiple must be >= 1, got 0"),
    ],
)
def test_adjust_bin_count_rejects_bad_rules(kwargs, message):
    with pytest.raises(ValueError, match=message):
        adjust_bin_count([[0]], **kwargs)


def test_pack_sequences_applies_the_bin_count_rules():
    assert pack_sequences([10, 10, 10], 100) == [[0, 1, 2]]
    assert pack_sequences([10, 10, 10], 100, min_bin_count=2) == [[0, 1], [2]]
    assert pack_sequences([10, 10, 10], 100, "CONCATENATIVE", bin_count_multiple=3) == [
        [0],
        [2],
        [1],
    ]


def test_pack_sequences_unknown_algorithm_lists_the_known_ones_and_suggests():
    with pytest.raises(ValueError, match="Did you mean 'first_fit_decreasing'") as info:
        pack_sequences([1], 10, "first_fit_decreasin")
    assert "Known: concatenative, first_fit_decreasing" in str(info.value)


# --- packer classes -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("algorithm", "cls"),
    [
        (PackingAlgorithm.CONCATENATIVE, ConcatenativePacker),
        ("first_fit_decreasing", FirstFitDecreasingPacker),
        ("FIRST_FIT_SHUFFLE", FirstFitShufflePacker),
        (PackingAlgorithm.MODIFIED_FIRST_FIT_DECREASING, ModifiedFirstFitDecreasingPacker),
    ],
)
def test_get_packer_returns_the_packer_for_an_enum_or_a_name(algorithm, cls):
    packer = get_packer(algorithm, 100, min_bin_count=2)
    assert type(packer) is cls
    bins = packer.pack([60, 30, 20])
    assert len(bins) == 2
    assert sorted(i for b in bins for i in b) == [0, 1, 2]


def test_get_packer_bins_match_the_functions():
    lengths = [46, 24, 55, 88, 11, 14, 73, 17]
    assert get_packer("modified_first_fit_decreasing", 100).pack(lengths) == (
        modified_first_fit_decreasing(lengths, 100)
    )
    assert get_packer("first_fit_decreasing", 100, bin_count_multiple=4).pack(lengths) == (
        adjust_bin_count(first_fit_decreasing(lengths, 100), bin_count_multiple=4)
    )


def test_get_packer_rejects_what_is_not_an_algorithm():
    with pytest.raises(ValueError, match="Unknown packing algorithm <object"):
        get_packer(object(), 100)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Unknown packing algorithm 'best_fit'"):
        get_packer("best_fit", 100)


def test_get_packer_refuses_metrics_collection_instead_of_ignoring_it():
    with pytest.raises(ValueError, match="do not collect metrics"):
        get_packer("concatenative", 100, collect_metrics=True)


# --- invariants ---------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    capacity=st.integers(1, 60),
    name=st.sampled_from(list(ALGORITHMS)),
)
def test_every_index_once_and_no_bin_over_capacity(data, capacity, name):
    lengths = data.draw(st.lists(st.integers(0, capacity), max_size=30))
    min_bins = data.draw(st.integers(0, len(lengths)))
    bins = pack_sequences(lengths, capacity, name, min_bin_count=min_bins)
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(b for b in bins)
    assert max(_loads(lengths, bins), default=0) <= capacity
    assert len(bins) >= min_bins
    if name != "first_fit_shuffle":
        assert bins == pack_sequences(lengths, capacity, name, min_bin_count=min_bins)


@settings(max_examples=100, deadline=None)
@given(lengths=st.lists(st.integers(1, 100), min_size=1, max_size=40))
def test_first_fit_leaves_at_most_one_bin_half_empty(lengths):
    # Two bins at most half full would have been merged by first fit, which bounds the count.
    for algorithm in (first_fit_decreasing, concatenative):
        loads = _loads(lengths, algorithm(lengths, 100))
        if algorithm is first_fit_decreasing:
            assert sum(load <= 50 for load in loads) <= 1
        assert len(loads) <= 2 * sum(lengths) // 100 + 1
