"""Packer objects over the functions of ``envloop.distributed.bin_packing``, with the published
class names.

``get_packer(algorithm, bin_capacity, min_bin_count=None, bin_count_multiple=None)`` returns
a ``SequencePacker`` whose ``pack(lengths)`` gives the bins (lists of indices into
``lengths``) with the bin-count rules applied. Prefer ``pack_sequences`` in new code; these
classes exist so code written against the published interface ports unchanged.

>>> packer = get_packer("first_fit_decreasing", bin_capacity=100, min_bin_count=2)
>>> packer.pack([30, 40, 20])
[[1, 0], [2]]
"""

from __future__ import annotations

import enum
import random
from collections.abc import Sequence

from envloop.distributed.bin_packing import (
    Bins,
    adjust_bin_count,
    algorithm_by_name,
    concatenative,
    first_fit_decreasing,
    first_fit_shuffle,
    modified_first_fit_decreasing,
)


class PackingAlgorithm(enum.Enum):
    """The packing algorithms, by the names ``get_packer`` and ``pack_sequences`` accept."""

    CONCATENATIVE = "concatenative"
    FIRST_FIT_DECREASING = "first_fit_decreasing"
    FIRST_FIT_SHUFFLE = "first_fit_shuffle"
    MODIFIED_FIRST_FIT_DECREASING = "modified_first_fit_decreasing"


class SequencePacker:
    """Packs sequence lengths into bins of ``bin_capacity`` tokens (see ``bin_packing``).

    ``min_bin_count`` / ``bin_count_multiple`` apply ``adjust_bin_count`` to every result.
    ``collect_metrics`` is accepted for signature compatibility and must stay False.
    """

    def __init__(
        self,
        bin_capacity: int,
        collect_metrics: bool = False,
        min_bin_count: int | None = None,
        bin_count_multiple: int | None = None,
    ) -> None:
        if collect_metrics:
            raise ValueError(
                "envloop's packers do not collect metrics; pass collect_metrics=False and "
                "measure the returned bins (e.g. their token totals) where you need them."
            )
        if min_bin_count is not None and min_bin_count < 0:
            raise ValueError(f"min_bin_count must be >= 0, got {min_bin_count}.")
        if bin_count_multiple is not None and bin_count_multiple < 1:
            raise ValueError(f"bin_count_multiple must be >= 1, got {bin_count_multiple}.")
        self.bin_capacity = bin_capacity
        self.min_bin_count = min_bin_count
        self.bin_count_multiple = bin_count_multiple

    def pack(self, sequence_lengths: Sequence[int]) -> Bins:
        """Bins of indices into ``sequence_lengths``, with the bin-count rules applied."""
        bins = self._pack(list(sequence_lengths))
        return adjust_bin_count(bins, self.min_bin_count, self.bin_count_multiple)

    def _pack(self, lengths: list[int]) -> Bins:
        raise NotImplementedError(f"{type(self).__name__} does not define _pack.")


class ConcatenativePacker(SequencePacker):
    """In input order; a new bin when the next sequence does not fit."""

    def _pack(self, lengths: list[int]) -> Bins:
        return concatenative(lengths, self.bin_capacity)


class FirstFitDecreasingPacker(SequencePacker):
    """Longest first, each into the first bin with room."""

    def _pack(self, lengths: list[int]) -> Bins:
        return first_fit_decreasing(lengths, self.bin_capacity)


class FirstFitShufflePacker(SequencePacker):
    """Random order (the global ``random`` state, or ``rng``), first fit."""

    def __init__(self, *args: object, rng: random.Random | None = None, **kwargs: object):
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.rng = rng

    def _pack(self, lengths: list[int]) -> Bins:
        return first_fit_shuffle(lengths, self.bin_capacity, self.rng)


class ModifiedFirstFitDecreasingPacker(SequencePacker):
    """Johnson & Garey's Modified First-Fit-Decreasing."""

    def _pack(self, lengths: list[int]) -> Bins:
        return modified_first_fit_decreasing(lengths, self.bin_capacity)


_PACKERS: dict[PackingAlgorithm, type[SequencePacker]] = {
    PackingAlgorithm.CONCATENATIVE: ConcatenativePacker,
    PackingAlgorithm.FIRST_FIT_DECREASING: FirstFitDecreasingPacker,
    PackingAlgorithm.FIRST_FIT_SHUFFLE: FirstFitShufflePacker,
    PackingAlgorithm.MODIFIED_FIRST_FIT_DECREASING: ModifiedFirstFitDecreasingPacker,
}


def get_packer(
    algorithm: PackingAlgorithm | str,
    bin_capacity: int,
    collect_metrics: bool = False,
    min_bin_count: int | None = None,
    bin_count_multiple: int | None = None,
) -> SequencePacker:
    """The packer for ``algorithm`` (a ``PackingAlgorithm`` or its name, case-insensitive).

    >>> type(get_packer(PackingAlgorithm.CONCATENATIVE, 8)).__name__
    'ConcatenativePacker'
    """
    if not isinstance(algorithm, PackingAlgorithm):
        if not isinstance(algorithm, str):
            known = ", ".join(a.value for a in PackingAlgorithm)
            raise ValueError(
                f"Unknown packing algorithm {algorithm!r}: pass a PackingAlgorithm or one of "
                f"the names {known}."
            )
        algorithm_by_name(algorithm)  # raises with the known names and a suggestion
        algorithm = PackingAlgorithm(algorithm.lower())
    return _PACKERS[algorithm](
        bin_capacity,
        collect_metrics=collect_metrics,
        min_bin_count=min_bin_count,
        bin_count_multiple=bin_count_multiple,
    )
