"""TokenBuffer: per-sample token rows in one preallocated [B, max_seq_len] tensor."""

from __future__ import annotations

import torch

from envloop.experience.token_buffer import TokenBuffer


def ids(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


def test_rows_start_right_padded_with_the_pad_id():
    buf = TokenBuffer([ids(5, 6, 7), ids(8)], max_seq_len=5, pad_id=9)
    assert buf.ids.tolist() == [[5, 6, 7, 9, 9], [8, 9, 9, 9, 9]]
    assert buf.lengths.tolist() == [3, 1]
    assert buf.ids.dtype == torch.long and buf.lengths.dtype == torch.long


def test_rows_are_as_wide_as_the_longest_selected_row_in_the_given_order():
    buf = TokenBuffer([ids(1, 2, 3), ids(4), ids(5, 6)], max_seq_len=8, pad_id=0)
    input_ids, lengths = buf.rows(ids(2, 1))
    assert input_ids.tolist() == [[5, 6], [4, 0]]
    assert lengths.tolist() == [2, 1]


def test_rows_of_no_indices_are_empty():
    buf = TokenBuffer([ids(1, 2)], max_seq_len=4, pad_id=0)
    input_ids, lengths = buf.rows(ids())
    assert tuple(input_ids.shape) == (0, 0) and lengths.tolist() == []


def test_rows_are_copies_of_the_buffer():
    buf = TokenBuffer([ids(1, 2)], max_seq_len=4, pad_id=0)
    input_ids, lengths = buf.rows(ids(0))
    input_ids[0, 0] = 99
    lengths[0] = 0
    assert buf.ids[0].tolist() == [1, 2, 0, 0] and buf.lengths.tolist() == [2]


def test_append_ragged_puts_each_rows_tokens_after_its_own_end():
    buf = TokenBuffer([ids(5, 6), ids(7)], max_seq_len=4, pad_id=0)
    buf.append_ragged(ids(1, 0), ids(8, 9, 3), ids(1, 2))
    assert buf.ids.tolist() == [[5, 6, 9, 3], [7, 8, 0, 0]]
    assert buf.lengths.tolist() == [4, 2]


def test_append_ragged_skips_rows_with_zero_tokens():
    buf = TokenBuffer([ids(1), ids(2), ids(3)], max_seq_len=4, pad_id=0)
    buf.append_ragged(ids(0, 1, 2), ids(10, 30, 31), ids(1, 0, 2))
    assert buf.ids.tolist() == [[1, 10, 0, 0], [2, 0, 0, 0], [3, 30, 31, 0]]
    assert buf.lengths.tolist() == [2, 1, 3]


def test_append_ragged_with_no_tokens_changes_nothing():
    buf = TokenBuffer([ids(1, 2)], max_seq_len=3, pad_id=0)
    buf.append_ragged(ids(0), ids(), ids(0))
    assert buf.ids.tolist() == [[1, 2, 0]] and buf.lengths.tolist() == [2]


def test_successive_appends_fill_a_row_to_exactly_max_seq_len():
    buf = TokenBuffer([ids(1)], max_seq_len=4, pad_id=0)
    buf.append_ragged(ids(0), ids(2, 3), ids(2))
    buf.append_ragged(ids(0), ids(4), ids(1))
    assert buf.ids.tolist() == [[1, 2, 3, 4]] and buf.lengths.tolist() == [4]
    input_ids, lengths = buf.rows(ids(0))
    assert input_ids.tolist() == [[1, 2, 3, 4]] and lengths.tolist() == [4]


def test_empty_sequences_and_an_empty_batch():
    buf = TokenBuffer([ids(), ids(4, 5)], max_seq_len=3, pad_id=7)
    assert buf.ids.tolist() == [[7, 7, 7], [4, 5, 7]] and buf.lengths.tolist() == [0, 2]
    empty = TokenBuffer([], max_seq_len=3, pad_id=0)
    assert tuple(empty.ids.shape) == (0, 3) and empty.lengths.tolist() == []
