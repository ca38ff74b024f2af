"""Bin-packing of sequence lengths under a token budget: pure functions, lengths -> bins.

Every algorithm takes ``lengths`` (one non-negative int per sequence) and ``capacity`` (the
token budget of one bin) and returns ``bins``: a list of bins, each a list of indices into
``lengths``, such that every index appears exactly once and no bin's total exceeds
``capacity``. A length above ``capacity`` raises ``ValueError``.

- ``concatenative``: in order, start a new bin when the next sequence does not fit.
- ``first_fit_decreasing``: longest first, each into the first bin with room (ties keep
  input order).
- ``first_fit_shuffle``: random order, first fit.
- ``modified_first_fit_decreasing``: Johnson & Garey's MFFD (1985), usually the fewest bins.

``pack_sequences`` picks one by name and then enforces a minimum bin count and a bin-count
multiple (e.g. one bin per data-parallel rank) with ``adjust_bin_count``.

>>> first_fit_decreasing([4, 8, 1, 4, 2, 1], capacity=10)
[[1, 4], [0, 3, 2, 5]]
>>> pack_sequences([4, 8, 1], capacity=10, algorithm="concatenative", min_bin_count=3)
[[0], [1], [2]]
"""

from __future__ import annotations

import difflib
import random
from bisect import bisect_right
from collections.abc import Callable, Sequence

Bins = list[list[int]]


def concatenative(lengths: Sequence[int], capacity: int) -> Bins:
    """Sequences in input order; a new bin starts when the next one does not fit.

    >>> concatenative([4, 1, 3, 2, 1, 3, 4, 5], capacity=5)
    [[0, 1], [2, 3], [4, 5], [6], [7]]
    """
    _check(lengths, capacity)
    bins: Bins = []
    load = capacity + 1  # forces a first bin
    for i, n in enumerate(lengths):
        if load + n > capacity:
            bins.append([])
            load = 0
        bins[-1].append(i)
        load += n
    return bins


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> Bins:
    """Longest sequence first, each into the first bin with room (equal lengths: lower index first).

    >>> first_fit_decreasing([30, 70, 50, 50], capacity=100)
    [[1, 0], [2, 3]]
    """
    _check(lengths, capacity)
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return _first_fit(lengths, capacity, order)


def first_fit_shuffle(
    lengths: Sequence[int], capacity: int, rng: random.Random | None = None
) -> Bins:
    """Sequences in a random order (``rng``, default the global ``random``), first fit.

    >>> first_fit_shuffle([60, 60, 30], capacity=100, rng=random.Random(0))
    [[0, 2], [1]]
    """
    _check(lengths, capacity)
    order = list(range(len(lengths)))
    (rng or random).shuffle(order)
    return _first_fit(lengths, capacity, order)


def modified_first_fit_decreasing(lengths: Sequence[int], capacity: int) -> Bins:
    """Johnson & Garey's Modified First-Fit-Decreasing.

    Sizes are classed relative to C = ``capacity``: large (C/2, C], medium (C/3, C/2],
    small (C/6, C/3], tiny [0, C/6]. (1) one bin per large item, largest first; (2) each of
    those bins takes the largest medium item that fits; (3) from the last bin backwards, a
    bin without a medium item takes the smallest small item plus the largest small item
    that still fits; (4) each bin, in order, greedily takes the largest remaining item that
    fits; (5) what is left goes, largest first, into the least-loaded leftover bin when it
    fits, else into a new one. Bins come out as the large-item bins in order, then the
    leftover bins from least to most loaded.

    >>> modified_first_fit_decreasing([46, 24, 55, 88, 11, 14, 73, 17], capacity=100)
    [[3, 4], [6, 5], [2, 7, 1], [0]]
    """
    _check(lengths, capacity)
    large, medium, small, tiny = _classify(lengths, capacity)
    bins = [[i] for i in large]
    loads = [lengths[i] for i in large]
    _add_one_medium(bins, loads, medium, lengths, capacity)
    _add_small_pairs(bins, loads, small, lengths, capacity, has_medium=_has_medium(bins, medium))
    rest = sorted(medium + small + tiny, key=lambda i: -lengths[i])
    for b, members in enumerate(bins):
        while rest and capacity - loads[b] >= lengths[rest[-1]]:
            pick = next(j for j, i in enumerate(rest) if lengths[i] <= capacity - loads[b])
            loads[b] += lengths[rest[pick]]
            members.append(rest.pop(pick))
    return bins + _least_loaded_fit(rest, lengths, capacity)


def adjust_bin_count(
    bins: Bins, min_bin_count: int | None = None, bin_count_multiple: int | None = None
) -> Bins:
    """``bins`` grown to at least ``min_bin_count`` bins and a multiple of ``bin_count_multiple``.

    New bins are filled by moving one sequence at a time (the last one of a bin) out of the
    bin that held the most sequences (equal counts: the later bin) until it holds one, then
    out of the next; no bin is left empty and no bin grows, so the capacity still holds.
    Raises ``ValueError`` when there are fewer sequences than bins needed.

    >>> adjust_bin_count([[0, 1, 2], [3]], min_bin_count=3)
    [[0, 1], [3], [2]]
    >>> adjust_bin_count([[0, 1], [2, 3], [4]], bin_count_multiple=2)
    [[0, 1], [2], [4], [3]]
    """
    if min_bin_count is not None and min_bin_count < 0:
        raise ValueError(f"min_bin_count must be >= 0, got {min_bin_count}.")
    if bin_count_multiple is not None and bin_count_multiple < 1:
        raise ValueError(f"bin_count_multiple must be >= 1, got {bin_count_multiple}.")
    target = max(len(bins), min_bin_count or 0)
    multiple = bin_count_multiple or 1
    target = -(-target // multiple) * multiple
    if target == len(bins):
        return bins
    total = sum(len(b) for b in bins)
    if total < target:
        raise ValueError(
            f"Cannot create {target} bins with only {total} sequences (no bin may be empty). Lower "
            "min_bin_count / bin_count_multiple (e.g. fewer data-parallel shards) or pack "
            "more sequences."
        )
    out = [list(b) for b in bins]
    donors = sorted(range(len(bins)), key=lambda b: (len(bins[b]), b), reverse=True)
    donor = 0
    for _ in range(target - len(bins)):
        while len(out[donors[donor]]) < 2:
            donor += 1
        out.append([out[donors[donor]].pop()])
    return out


ALGORITHMS: dict[str, Callable[[Sequence[int], int], Bins]] = {
    "concatenative": concatenative,
    "first_fit_decreasing": first_fit_decreasing,
    "first_fit_shuffle": first_fit_shuffle,
    "modified_first_fit_decreasing": modified_first_fit_decreasing,
}
"""Packing functions by name (the names ``pack_sequences`` and ``get_packer`` accept)."""


def pack_sequences(
    lengths: Sequence[int],
    capacity: int,
    algorithm: str = "first_fit_decreasing",
    *,
    min_bin_count: int | None = None,
    bin_count_multiple: int | None = None,
) -> Bins:
    """Pack with the algorithm named ``algorithm`` (case-insensitive), then ``adjust_bin_count``.

    >>> pack_sequences([90, 20, 70, 10], capacity=100)
    [[0, 3], [2, 1]]
    """
    bins = algorithm_by_name(algorithm)(lengths, capacity)
    return adjust_bin_count(bins, min_bin_count, bin_count_multiple)


def algorithm_by_name(name: str) -> Callable[[Sequence[int], int], Bins]:
    """The packing function called ``name`` (case-insensitive); an unknown name lists the known."""
    key = name.lower() if isinstance(name, str) else name
    if key not in ALGORITHMS:
        close = difflib.get_close_matches(str(key), ALGORITHMS, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise ValueError(
            f"Unknown packing algorithm {name!r}. Known: {', '.join(ALGORITHMS)}.{hint}"
        )
    return ALGORITHMS[key]


def _check(lengths: Sequence[int], capacity: int) -> None:
    if capacity < 1:
        raise ValueError(f"Bin capacity must be >= 1 token, got {capacity}.")
    for i, n in enumerate(lengths):
        if n < 0 or n > capacity:
            raise ValueError(
                f"Sequence {i} has length {n}, outside [0, {capacity}] (the bin capacity). "
                "Raise the token budget (max_tokens_per_microbatch) or truncate the sequence."
            )


def _first_fit(lengths: Sequence[int], capacity: int, order: list[int]) -> Bins:
    bins: Bins = []
    room: list[int] = []
    for i in order:
        b = next((b for b, r in enumerate(room) if r >= lengths[i]), len(bins))
        if b == len(bins):
            bins.append([])
            room.append(capacity)
        bins[b].append(i)
        room[b] -= lengths[i]
    return bins


def _classify(lengths: Sequence[int], capacity: int) -> tuple[list[int], ...]:
    """Indices of large, medium (both longest first), small and tiny (both shortest first)."""
    classes: tuple[list[int], ...] = ([], [], [], [])
    for i, n in enumerate(lengths):
        k = 0 if n * 2 > capacity else 1 if n * 3 > capacity else 2 if n * 6 > capacity else 3
        classes[k].append(i)
    for k, longest_first in enumerate((True, True, False, False)):
        classes[k].sort(key=lambda i: -lengths[i] if longest_first else lengths[i])
    return classes


def _has_medium(bins: Bins, medium: list[int]) -> list[bool]:
    medium_set = set(medium)
    return [any(i in medium_set for i in b) for b in bins]


def _add_one_medium(
    bins: Bins, loads: list[int], medium: list[int], lengths: Sequence[int], capacity: int
) -> None:
    for b in range(len(bins)):
        pick = next((j for j, i in enumerate(medium) if lengths[i] <= capacity - loads[b]), None)
        if pick is not None:
            loads[b] += lengths[medium[pick]]
            bins[b].append(medium.pop(pick))


def _add_small_pairs(
    bins: Bins,
    loads: list[int],
    small: list[int],
    lengths: Sequence[int],
    capacity: int,
    has_medium: list[bool],
) -> None:
    for b in reversed(range(len(bins))):
        room = capacity - loads[b]
        if has_medium[b] or len(small) < 2 or lengths[small[0]] + lengths[small[1]] > room:
            continue
        first = small.pop(0)
        room -= lengths[first]
        # small is shortest first and its shortest fits, so a second one always exists
        second = max(j for j, i in enumerate(small) if lengths[i] <= room)
        bins[b] += [first, small.pop(second)]
        loads[b] += lengths[first] + lengths[bins[b][-1]]


def _least_loaded_fit(items: list[int], lengths: Sequence[int], capacity: int) -> Bins:
    """Items (longest first) into the least-loaded bin if they fit, else a new bin."""
    bins: Bins = [[]]
    loads = [0]  # kept sorted ascending, bins in the same order
    for i in items:
        if lengths[i] <= capacity - loads[0]:
            members, load = bins.pop(0), loads.pop(0)
        else:
            members, load = [], 0
        members.append(i)
        load += lengths[i]
        at = bisect_right(loads, load)
        bins.insert(at, members)
        loads.insert(at, load)
    return [b for b in bins if b]
