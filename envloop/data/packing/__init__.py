"""Sequence packing: group sequences into bins that each hold at most a token budget.

Start with ``pack_sequences(lengths, capacity, algorithm="first_fit_decreasing")``: it takes
one length per sequence and returns bins, each a list of indices into ``lengths``, every
index exactly once and every bin's total at most ``capacity``. The algorithms themselves
(``concatenative``, ``first_fit_decreasing``, ``first_fit_shuffle``,
``modified_first_fit_decreasing``) and ``adjust_bin_count`` live in
``envloop.distributed.bin_packing`` (batch sharding packs with them); the published packer
classes (``get_packer``, ``SequencePacker``, ...) in ``algorithms``.

>>> pack_sequences([300, 900, 200, 600], capacity=1000)
[[1], [3, 0], [2]]
"""

from envloop.data.packing.algorithms import (
    ConcatenativePacker,
    FirstFitDecreasingPacker,
    FirstFitShufflePacker,
    ModifiedFirstFitDecreasingPacker,
    PackingAlgorithm,
    SequencePacker,
    get_packer,
)
from envloop.distributed.bin_packing import (
    ALGORITHMS,
    Bins,
    adjust_bin_count,
    algorithm_by_name,
    concatenative,
    first_fit_decreasing,
    first_fit_shuffle,
    modified_first_fit_decreasing,
    pack_sequences,
)

__all__ = [
    "ALGORITHMS",
    "Bins",
    "ConcatenativePacker",
    "FirstFitDecreasingPacker",
    "FirstFitShufflePacker",
    "ModifiedFirstFitDecreasingPacker",
    "PackingAlgorithm",
    "SequencePacker",
    "adjust_bin_count",
    "algorithm_by_name",
    "concatenative",
    "first_fit_decreasing",
    "first_fit_shuffle",
    "get_packer",
    "modified_first_fit_decreasing",
    "pack_sequences",
]
