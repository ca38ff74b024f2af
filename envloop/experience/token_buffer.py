"""Per-sample token sequences kept in one preallocated [B, max_seq_len] tensor.

The rollout engine appends each turn's tokens here, so building the next generation input is
one ``index_select`` instead of re-concatenating every message of every sample.
"""

from __future__ import annotations

import numpy as np
import torch


class TokenBuffer:
    """Right-padded token rows of a batch, each at most ``max_seq_len`` long.

    >>> buf = TokenBuffer([torch.tensor([5, 6]), torch.tensor([7])], max_seq_len=4, pad_id=0)
    >>> buf.append_ragged(torch.tensor([1, 0]), torch.tensor([8, 9, 3]), torch.tensor([1, 2]))
    >>> ids, lengths = buf.rows(torch.tensor([1, 0]))
    >>> ids.tolist(), lengths.tolist()
    ([[7, 8, 0, 0], [5, 6, 9, 3]], [2, 4])
    """

    def __init__(self, sequences: list[torch.Tensor], max_seq_len: int, pad_id: int) -> None:
        self.max_seq_len = max_seq_len
        self.pad_id = pad_id
        self.ids = torch.full((len(sequences), max_seq_len), pad_id, dtype=torch.long)
        self.lengths = torch.zeros(len(sequences), dtype=torch.long)
        if sequences:
            counts = torch.tensor([len(s) for s in sequences], dtype=torch.long)
            self.append_ragged(torch.arange(len(sequences)), torch.cat(sequences), counts)

    def reset(self, indices: torch.Tensor, sequences: list[torch.Tensor]) -> None:
        """Rows ``indices`` hold ``sequences`` (one each) and nothing else."""
        ids, lengths = self.ids.numpy(), self.lengths.numpy()
        for row, sequence in zip(indices.tolist(), sequences, strict=True):
            ids[row, : len(sequence)] = sequence.numpy()
            ids[row, len(sequence) :] = self.pad_id
            lengths[row] = len(sequence)

    def rows(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input_ids [b, L], input_lengths [b])`` of rows ``indices``; L = longest row."""
        lengths = self.lengths.index_select(0, indices)
        width = int(lengths.max()) if len(lengths) else 0
        return self.ids[:, :width].index_select(0, indices), lengths

    def append_ragged(
        self, indices: torch.Tensor, flat_tokens: torch.Tensor, counts: torch.Tensor
    ) -> None:
        """Append ``counts[k]`` tokens of ``flat_tokens`` (in order) to row ``indices[k]``.

        The caller guarantees no row grows past ``max_seq_len``. (numpy's ``repeat`` does
        the ragged index arithmetic ~1000x faster than ``torch.repeat_interleave`` here.)
        """
        if len(flat_tokens) == 0:
            return
        rows, n, lengths = indices.numpy(), counts.numpy(), self.lengths.numpy()
        starts = lengths[rows]
        offsets = np.cumsum(n) - n
        cols = np.repeat(starts - offsets, n) + np.arange(len(flat_tokens))
        self.ids.numpy()[np.repeat(rows, n), cols] = flat_tokens.numpy()
        np.add.at(lengths, rows, n)
