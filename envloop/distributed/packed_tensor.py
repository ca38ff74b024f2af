"""``PackedTensor``: per-sample (or per-message) tensors kept apart until a model needs them.

Vision inputs differ in size from sample to sample (an image is 4 or 64 patches), so they
cannot be one [B, ...] tensor. A ``PackedTensor`` holds one logical row per sample and
concatenates the rows' tensors along ``dim_to_pack`` only in ``as_tensor()``.
``BatchedDataDict`` accepts it as a column. Its tensors are treated as immutable: selecting,
slicing and repeating rows build new lists of the same tensor objects, so image data is
never copied per sample or per generation. ``copy.deepcopy`` copies the tensors unless
deduplication is enabled (as published); ``BatchedDataDict.repeat_interleave(...,
share_immutable_media=True)`` enables it.

Two layouts (see ``docs/multimodal_data.md``):

- plain: ``tensors[i]`` is row ``i`` (a tensor, or None for a row without this input).
- segmented: ``tensors`` are physical segments, each stored once; row ``r`` is the segments
  ``tensors[j]`` for ``j`` in ``_segment_indices[_row_offsets[r]:_row_offsets[r + 1]]``.
  A row may hold several segments (the images of every turn of a conversation) and many
  rows may reference one segment (the image of a prompt, in each of its generations).
  ``enable_deduplication()`` gives every physical segment a provenance id; ``concat``,
  ``slice`` and the ``BatchedDataDict`` row operations keep one physical copy per
  provenance (and per tensor object), so a shard or a joined batch re-interns the
  segments its rows reference.

The published path is ``envloop.data.multimodal_utils.PackedTensor``; it lives here so that
``BatchedDataDict`` (a lower layer than ``data``) can handle it.
"""

from __future__ import annotations

import copy
import itertools
import uuid
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, overload

import torch

from envloop.distributed.media_padding import pad_and_concat

__all__ = ["PackDimError", "PackedTensor", "common_dim_to_pack"]

Item = torch.Tensor | None


class PackDimError(ValueError, IndexError):
    """An item has no dimension ``dim_to_pack`` (a ``ValueError``, and an ``IndexError`` as
    the published interface raised for an out-of-range packing dimension)."""


class PackedTensor:
    """A batch of logical rows (one per sample or per message), each zero or more tensors.

    ``as_tensor()`` concatenates every row's tensors along ``dim_to_pack`` (e.g. the image
    patches of every sample, [sum of patches, D], as a vision tower takes them); with
    ``pad_to_max_shape`` every other dimension is first zero-padded (at its end) to the
    largest size in the batch, for images of mixed sizes, audio or video. ``p[i]`` is row
    ``i`` as one tensor (None for a row without this input). Selecting, slicing and repeating
    rows build new lists of the same tensor objects: no image data is copied.
    ``copy.deepcopy`` copies the tensors unless deduplication is enabled.

    >>> p = PackedTensor([torch.ones(2, 3), None, torch.zeros(1, 3)], dim_to_pack=0)
    >>> len(p), tuple(p.as_tensor().shape), len(p.slice([2, 0]))
    (3, (3, 3), 2)
    >>> PackedTensor.flattened_concat([p, p.slice([1])]).as_tensor().shape[0]
    3
    >>> copy.deepcopy(p)[0] is p[0], copy.deepcopy(p.enable_deduplication())[0] is p[0]
    (False, True)

    Deduplicated: four rows, one physical tensor.

    >>> shared = PackedTensor(torch.ones(4, 3), dim_to_pack=0).enable_deduplication()
    >>> group = PackedTensor.concat([shared] * 4)
    >>> len(group), len(group.tensors), tuple(group.as_tensor().shape)
    (4, 1, (16, 3))
    """

    def __init__(
        self,
        tensors: torch.Tensor | Sequence[Item],
        dim_to_pack: int,
        *,
        pad_to_max_shape: bool = False,
        _row_offsets: list[int] | None = None,
        _segment_indices: list[int] | None = None,
        _segment_provenance: list[bytes] | None = None,
    ):
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        if not isinstance(tensors, Sequence) or isinstance(tensors, (str, bytes)):
            raise TypeError(
                f"PackedTensor takes a tensor or a list of tensors (None for an item without "
                f"this input), got {type(tensors).__name__}."
            )
        items = list(tensors)
        for k, item in enumerate(items):
            if item is not None and not isinstance(item, torch.Tensor):
                raise TypeError(
                    f"PackedTensor item {k} is a {type(item).__name__}; items are tensors or None."
                )
            if item is not None and not -item.dim() <= dim_to_pack < item.dim():
                raise PackDimError(
                    f"PackedTensor item {k} has shape {tuple(item.shape)}, which has no "
                    f"dimension {dim_to_pack} to pack along (dim_to_pack={dim_to_pack} is "
                    f"invalid for tensors with rank {item.dim()}); give dim_to_pack a "
                    "dimension every item has."
                )
        _check_layout(len(items), _row_offsets, _segment_indices, _segment_provenance)
        self.tensors: list[Item] = items
        self.dim_to_pack = dim_to_pack
        self.pad_to_max_shape = pad_to_max_shape
        self._row_offsets = _row_offsets
        self._segment_indices = _segment_indices
        self._segment_provenance = _segment_provenance

    # --- layout ---------------------------------------------------------------------------

    @property
    def deduplication_enabled(self) -> bool:
        """Whether every physical segment carries a provenance id (``enable_deduplication``)."""
        return self._segment_provenance is not None

    @property
    def segmented(self) -> bool:
        """Whether rows reference physical segments (the segmented layout) or deduplication
        is enabled; row operations then keep one physical copy per segment."""
        return self._row_offsets is not None or self._segment_provenance is not None

    def enable_deduplication(self) -> PackedTensor:
        """Give every physical segment a provenance id (once; the rows do not change).

        Copies of this value (``copy.deepcopy``, pickling, ``slice``) keep the ids, so
        ``concat`` and the ``BatchedDataDict`` row operations store a segment once however
        many rows reference it. Returns self.
        """
        if self._segment_provenance is None:
            self._segment_provenance = [uuid.uuid4().bytes for _ in self.tensors]
        return self

    def _row_refs(self, row: int) -> list[int]:
        """The physical indices of row ``row``'s segments (an empty row: none)."""
        if self._row_offsets is None:
            return [] if self.tensors[row] is None else [row]
        assert self._segment_indices is not None
        return self._segment_indices[self._row_offsets[row] : self._row_offsets[row + 1]]

    def logical_segment_counts_by_row(self) -> list[int]:
        """Per row, how many tensors (e.g. images' inputs) it holds.

        >>> PackedTensor([torch.ones(1, 2), None], dim_to_pack=0).logical_segment_counts_by_row()
        [1, 0]
        """
        return [
            sum(self.tensors[j] is not None for j in self._row_refs(r)) for r in range(len(self))
        ]

    def iter_logical_segments(self) -> Iterator[Item]:
        """The tensors of every row in row order (a segment shared by rows, once per row;
        in the plain layout, None for a row without this input)."""
        if self._segment_indices is None:
            yield from self.tensors
            return
        for j in self._segment_indices:
            yield self.tensors[j]

    # --- rows -----------------------------------------------------------------------------

    def __len__(self) -> int:
        if self._row_offsets is not None:
            return len(self._row_offsets) - 1
        return len(self.tensors)

    def __iter__(self) -> Iterator[Item]:
        """Each row as one tensor (see ``__getitem__``)."""
        return (self._row_item(r) for r in range(len(self)))

    @overload
    def __getitem__(self, index: int) -> Item: ...

    @overload
    def __getitem__(self, index: slice) -> PackedTensor: ...

    def __getitem__(self, index: int | slice) -> Item | PackedTensor:
        """Row ``index`` as one tensor (its only segment itself, several concatenated along
        ``dim_to_pack``, None if it has none); for a slice the rows as a PackedTensor."""
        if isinstance(index, slice):
            return self.slice(index)
        if self._row_offsets is None:
            return self.tensors[index]
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"PackedTensor row {index} is out of range for {n} rows.")
        return self._row_item(index % n)

    def _row_item(self, row: int) -> Item:
        if self._row_offsets is None:
            return self.tensors[row]
        return self._pack([self.tensors[j] for j in self._row_refs(row)])

    @property
    def present(self) -> list[torch.Tensor]:
        """The rows that hold a tensor, each as one tensor, in order."""
        return [t for t in self if t is not None]

    def __repr__(self) -> str:
        shapes = [None if t is None else tuple(t.shape) for t in list(self)[:4]]
        more = f", ... {len(self) - 4} more" if len(self) > 4 else ""
        physical = f", {len(self.tensors)} stored" if self.segmented else ""
        return (
            f"PackedTensor({len(self)} items {shapes}{more}{physical}, "
            f"dim_to_pack={self.dim_to_pack})"
        )

    # --- copies and pickling --------------------------------------------------------------

    def _with(
        self,
        tensors: list[Item],
        offsets: list[int] | None,
        indices: list[int] | None,
        provenance: list[bytes] | None,
    ) -> PackedTensor:
        return PackedTensor(
            tensors,
            self.dim_to_pack,
            pad_to_max_shape=self.pad_to_max_shape,
            _row_offsets=offsets,
            _segment_indices=indices,
            _segment_provenance=provenance,
        )

    def _copy_layout(self, tensors: list[Item], provenance: list[bytes] | None) -> PackedTensor:
        return self._with(
            tensors,
            None if self._row_offsets is None else list(self._row_offsets),
            None if self._segment_indices is None else list(self._segment_indices),
            provenance,
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> PackedTensor:
        """A new PackedTensor with its own lists. With deduplication enabled it holds the same
        tensor objects (immutable media, stored once) and the same provenance ids; without,
        copies of the tensors (``copy.deepcopy`` with ``memo``, so a tensor held twice is
        copied once), as published."""
        provenance = self._segment_provenance
        if provenance is None:
            copied = self._copy_layout([copy.deepcopy(t, memo) for t in self.tensors], None)
        else:
            copied = self._copy_layout(list(self.tensors), list(provenance))
        memo[id(self)] = copied
        return copied

    def sharing_copy(self) -> PackedTensor:
        """A new PackedTensor with its own lists holding the same tensor objects (no data
        copied) and the same provenance ids, if any."""
        provenance = self._segment_provenance
        return self._copy_layout(
            list(self.tensors), None if provenance is None else list(provenance)
        )

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore a pickled value, including one pickled before deduplication existed (no
        layout or provenance attributes: the plain layout)."""
        self.__dict__.update(state)
        self.__dict__.setdefault("pad_to_max_shape", False)
        for name in ("_row_offsets", "_segment_indices", "_segment_provenance"):
            self.__dict__.setdefault(name, None)

    # --- materialising --------------------------------------------------------------------

    def _pack(self, present: list[torch.Tensor | None]) -> Item:
        tensors = [t for t in present if t is not None]
        if not tensors:
            return None
        if len(tensors) == 1:
            return tensors[0]
        return pad_and_concat(tensors, self.dim_to_pack, self.pad_to_max_shape)

    def as_tensor(self, device: str | torch.device | None = None) -> torch.Tensor | None:
        """Every row's tensors concatenated along ``dim_to_pack`` in row order (a segment
        shared by rows repeated for each), padded first if ``pad_to_max_shape``; None when
        no row holds a tensor. Raises ``ValueError`` for mixed ranks under
        ``pad_to_max_shape`` and ``RuntimeError`` (torch's) for mismatched shapes without it.

        >>> a = PackedTensor([torch.ones(1, 2, 4), torch.ones(1, 4, 2)], 0, pad_to_max_shape=True)
        >>> tuple(a.as_tensor().shape)
        (2, 4, 4)
        """
        packed = self._pack(list(self.iter_logical_segments()))
        return packed if packed is None or device is None else packed.to(device)

    def to(self, device_or_dtype: str | torch.device | torch.dtype) -> PackedTensor:
        """A PackedTensor with every tensor moved to a device (same rows and provenance:
        a move keeps the values), or, given a ``torch.dtype``, ``to_dtype(dtype)``."""
        if isinstance(device_or_dtype, torch.dtype):
            return self.to_dtype(device_or_dtype)
        moved = [None if t is None else t.to(device_or_dtype) for t in self.tensors]
        provenance = self._segment_provenance
        return self._copy_layout(moved, None if provenance is None else list(provenance))

    def to_dtype(self, dtype: torch.dtype) -> PackedTensor:
        """Floating-point tensors cast to ``dtype``, each physical segment once (rows that
        share a segment still share it); integer tensors (grids, sizes, frame counts) kept.

        A cast that changes any value gives the segments new provenance ids (they are new
        data); when nothing changes, the result holds the same tensors and ids. Always a
        new PackedTensor with its own lists.
        """
        changes = any(
            t is not None and t.is_floating_point() and t.dtype != dtype for t in self.tensors
        )
        if not changes:
            provenance = self._segment_provenance
            return self._copy_layout(
                list(self.tensors), None if provenance is None else list(provenance)
            )
        cast = [t.to(dtype) if t is not None and t.is_floating_point() else t for t in self.tensors]
        fresh = None if self._segment_provenance is None else [uuid.uuid4().bytes for _ in cast]
        return self._copy_layout(cast, fresh)

    # --- row operations -------------------------------------------------------------------

    def slice(self, indices: Iterable[int] | torch.Tensor | slice) -> PackedTensor:
        """The rows at ``indices`` (a slice, a list or a 1-D tensor; negative indices count
        from the end; repeats allowed), in that order. A segmented value keeps each
        referenced segment once."""
        rows = _row_indices(len(self), indices)
        if not self.segmented:
            return self._with([self.tensors[r] for r in rows], None, None, None)
        builder = _SegmentBuilder()
        builder.add_rows(self, rows)
        return builder.build(self)

    def repeat_interleave(self, repeats: int) -> PackedTensor:
        """Each row ``repeats`` times in a row, sharing the row's tensors (no copy)."""
        return self.slice([r for r in range(len(self)) for _ in range(repeats)])

    @classmethod
    def empty_like(cls, other: PackedTensor, num_items: int | None = None) -> PackedTensor:
        """``num_items`` rows without tensors (default: as many as ``other``), laid out like
        ``other`` (dim, padding, and segmented if ``other`` is)."""
        return cls.empty_rows_like(other, len(other) if num_items is None else num_items)

    @classmethod
    def empty_rows_like(cls, other: PackedTensor, num_rows: int) -> PackedTensor:
        """``num_rows`` rows without tensors, laid out like ``other``."""
        if num_rows < 0:
            raise ValueError(f"empty_rows_like needs num_rows >= 0, got {num_rows}.")
        if other.segmented:
            return other._with([], [0] * (num_rows + 1), [], [])
        return other._with([None] * num_rows, None, None, None)

    @classmethod
    def concat(cls, packed: Sequence[PackedTensor]) -> PackedTensor:
        """The rows of every ``packed`` value in order (batches joined end to end).

        If any value is segmented, the result is segmented and deduplicated: segments with
        the same provenance id (or the same tensor object) are stored once.
        """
        dim = common_dim_to_pack(packed)
        padding = _common_padding(packed)
        if not any(p.segmented for p in packed):
            items = [t for p in packed for t in p.tensors]
            return cls(items, dim, pad_to_max_shape=padding)
        builder = _SegmentBuilder()
        for p in packed:
            builder.add_rows(p, range(len(p)))
        template = cls([], dim, pad_to_max_shape=padding)
        return builder.build(template, dedup=True)

    @classmethod
    def merge_segments(cls, packed: Sequence[PackedTensor]) -> PackedTensor:
        """A conversation's per-message values as one value. Plain values: their rows
        joined (``concat``). If any is segmented: one row referencing every segment in
        order (the turns' media, nothing copied)."""
        joined = cls.concat(packed)
        if not joined.segmented:
            return joined
        assert joined._segment_indices is not None
        refs = list(joined._segment_indices)
        return joined._with(joined.tensors, [0, len(refs)], refs, joined._segment_provenance)

    @classmethod
    def flattened_concat(cls, packed: Sequence[PackedTensor | None]) -> PackedTensor:
        """One row per entry of ``packed``: that entry's rows joined into one (None rows for
        a None entry or one without tensors). Turns a log's per-message values into one
        per-sample row, or per-sample values into a batch.

        Plain entries are concatenated (``as_tensor``); if any entry is segmented, each
        entry's segments are referenced, not copied, and the result is deduplicated.
        """
        present = [p for p in packed if p is not None]
        dim = common_dim_to_pack(present)
        padding = _common_padding(present)
        if not any(p.segmented for p in present):
            items = [None if p is None else p.as_tensor() for p in packed]
            return cls(items, dim, pad_to_max_shape=padding)
        builder = _SegmentBuilder()
        for p in packed:
            builder.add_merged(p)
        return builder.build(cls([], dim, pad_to_max_shape=padding), dedup=True)


class _SegmentBuilder:
    """Collects rows as references to physical segments, storing each segment once."""

    def __init__(self) -> None:
        self.tensors: list[Item] = []
        self.provenance: list[bytes] = []
        self.offsets = [0]
        self.indices: list[int] = []
        self.by_provenance: dict[bytes, int] = {}
        self.by_object: dict[int, int] = {}
        self.all_have_provenance = True

    def add_rows(self, source: PackedTensor, rows: Iterable[int]) -> None:
        local: dict[int, int] = {}
        src_prov = source._segment_provenance
        if src_prov is None:
            self.all_have_provenance = False
        for row in rows:
            for j in source._row_refs(row):
                if j not in local:
                    local[j] = self._intern(
                        source.tensors[j], None if src_prov is None else src_prov[j]
                    )
                self.indices.append(local[j])
            self.offsets.append(len(self.indices))

    def add_merged(self, source: PackedTensor | None) -> None:
        """One row holding every segment of ``source``'s rows (none for None)."""
        if source is not None and len(source):
            self.add_rows(source, range(len(source)))
            del self.offsets[-len(source) :]
        self.offsets.append(len(self.indices))

    def _intern(self, tensor: Item, provenance: bytes | None) -> int:
        found = self.by_provenance.get(provenance) if provenance is not None else None
        if found is None and tensor is not None:
            found = self.by_object.get(id(tensor))
        if found is None:
            found = len(self.tensors)
            self.tensors.append(tensor)
            self.provenance.append(provenance if provenance is not None else uuid.uuid4().bytes)
            if tensor is not None:
                self.by_object[id(tensor)] = found
        if provenance is not None:
            self.by_provenance.setdefault(provenance, found)
        return found

    def build(self, template: PackedTensor, dedup: bool | None = None) -> PackedTensor:
        """The collected rows, laid out like ``template``; provenance kept if ``dedup`` (by
        default: if every source had provenance)."""
        keep = self.all_have_provenance if dedup is None else dedup
        return template._with(
            self.tensors, self.offsets, self.indices, self.provenance if keep else None
        )


def _row_indices(n: int, indices: Iterable[int] | torch.Tensor | slice) -> list[int]:
    """``indices`` (a slice, a list or a 1-D tensor) as rows in ``range(n)``; negative ones
    count from the end, others out of range raise ``IndexError``."""
    if isinstance(indices, slice):
        return list(range(n))[indices]
    if isinstance(indices, torch.Tensor):
        indices = indices.tolist()
    rows = []
    for i in indices:
        i = int(i)
        if not -n <= i < n:
            raise IndexError(f"PackedTensor row index {i} is out of range for {n} rows.")
        rows.append(i % n)
    return rows


def _check_layout(
    n: int,
    offsets: list[int] | None,
    indices: list[int] | None,
    provenance: list[bytes] | None,
) -> None:
    if (offsets is None) != (indices is None):
        raise ValueError("_row_offsets and _segment_indices must both be given or both be None.")
    if offsets is not None and indices is not None:
        if not offsets or offsets[0] != 0:
            raise ValueError("_row_offsets must start with 0.")
        if any(a > b for a, b in itertools.pairwise(offsets)):
            raise ValueError("_row_offsets must be non-decreasing.")
        if offsets[-1] != len(indices):
            raise ValueError(
                f"_row_offsets must end at the number of segment references ({len(indices)}), "
                f"got {offsets[-1]}."
            )
        if any(not 0 <= j < n for j in indices):
            raise ValueError(f"_segment_indices must index the {n} physical segments.")
    if provenance is not None and len(provenance) != n:
        raise ValueError(
            f"_segment_provenance must have one entry per physical segment ({n}), "
            f"got {len(provenance)}."
        )


def common_dim_to_pack(packed: Sequence[PackedTensor], key: str | None = None) -> int:
    """The ``dim_to_pack`` all of ``packed`` share (0 for none); ``ValueError`` naming
    ``key`` if they differ."""
    dims = {p.dim_to_pack for p in packed}
    if len(dims) > 1:
        where = f" for key {key!r}" if key is not None else ""
        raise ValueError(
            f"PackedTensor values{where} are packed along different dimensions: "
            f"{sorted(dims)}; give every value of one key the same dim_to_pack."
        )
    return dims.pop() if dims else 0


def _common_padding(packed: Sequence[PackedTensor]) -> bool:
    flags = {p.pad_to_max_shape for p in packed}
    if len(flags) > 1:
        raise ValueError(
            "PackedTensor values to join differ in pad_to_max_shape; build every value of "
            "one key with the same pad_to_max_shape."
        )
    return flags.pop() if flags else False
