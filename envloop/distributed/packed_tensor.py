"""``PackedTensor``: per-sample (or per-message) tensors kept apart until a model needs them.

Vision inputs differ in size from sample to sample (an image is 4 or 64 patches), so they
cannot be one [B, ...] tensor. A ``PackedTensor`` holds one item per sample, a tensor or
None, and concatenates the present items along ``dim_to_pack`` only in ``as_tensor()``.
``BatchedDataDict`` accepts it as a column. Its items are treated as immutable: selecting,
slicing, repeating and ``copy.deepcopy`` build new lists of the same tensor objects, so
image data is never copied per sample or per generation.

The published path is ``envloop.data.multimodal_utils.PackedTensor``; it lives here so that
``BatchedDataDict`` (a lower layer than ``data``) can handle it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, overload

import torch

__all__ = ["PackedTensor"]


class PackedTensor:
    """A batch of items (one per sample or per message), each a tensor or None, kept apart.

    ``as_tensor()`` concatenates the present items along ``dim_to_pack`` (e.g. the image
    patches of every sample, [sum of patches, D], as a vision tower takes them). Selecting,
    slicing, repeating and deep-copying build new lists of the same tensor objects: no image
    data is copied.

    >>> p = PackedTensor([torch.ones(2, 3), None, torch.zeros(1, 3)], dim_to_pack=0)
    >>> len(p), tuple(p.as_tensor().shape), len(p.slice([2, 0]))
    (3, (3, 3), 2)
    >>> PackedTensor.flattened_concat([p, p.slice([1])]).as_tensor().shape[0]
    3
    >>> import copy
    >>> copy.deepcopy(p)[0] is p[0]
    True
    """

    def __init__(self, tensors: torch.Tensor | Sequence[torch.Tensor | None], dim_to_pack: int):
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
            if item is not None and item.dim() <= dim_to_pack:
                raise ValueError(
                    f"PackedTensor item {k} has shape {tuple(item.shape)}, which has no "
                    f"dimension {dim_to_pack} to pack along."
                )
        self.tensors: list[torch.Tensor | None] = items
        self.dim_to_pack = dim_to_pack

    def __len__(self) -> int:
        return len(self.tensors)

    def __iter__(self) -> Iterator[torch.Tensor | None]:
        return iter(self.tensors)

    @overload
    def __getitem__(self, index: int) -> torch.Tensor | None: ...

    @overload
    def __getitem__(self, index: slice) -> PackedTensor: ...

    def __getitem__(self, index: int | slice) -> torch.Tensor | PackedTensor | None:
        """Item ``index``, or for a slice the items as a PackedTensor (same tensors)."""
        if isinstance(index, slice):
            return self.slice(index)
        return self.tensors[index]

    def __repr__(self) -> str:
        shapes = [None if t is None else tuple(t.shape) for t in self.tensors[:4]]
        more = f", ... {len(self) - 4} more" if len(self) > 4 else ""
        return f"PackedTensor({len(self)} items {shapes}{more}, dim_to_pack={self.dim_to_pack})"

    def __deepcopy__(self, memo: dict[int, Any]) -> PackedTensor:
        """A new PackedTensor holding the same tensor objects (items are immutable data)."""
        copied = PackedTensor(list(self.tensors), self.dim_to_pack)
        memo[id(self)] = copied
        return copied

    @property
    def present(self) -> list[torch.Tensor]:
        """The items that are not None, in order."""
        return [t for t in self.tensors if t is not None]

    def as_tensor(self, device: str | torch.device | None = None) -> torch.Tensor | None:
        """The present items concatenated along ``dim_to_pack`` (None when all are None)."""
        present = self.present
        if not present:
            return None
        packed = present[0] if len(present) == 1 else torch.cat(present, dim=self.dim_to_pack)
        return packed if device is None else packed.to(device)

    def to(self, device: str | torch.device) -> PackedTensor:
        """Every item moved to ``device`` (items already there are kept, not copied)."""
        return PackedTensor(
            [None if t is None else t.to(device) for t in self.tensors], self.dim_to_pack
        )

    def slice(self, indices: Iterable[int] | torch.Tensor | slice) -> PackedTensor:
        """The items at ``indices`` (a slice, a list or a 1-D tensor), in that order."""
        if isinstance(indices, slice):
            return PackedTensor(self.tensors[indices], self.dim_to_pack)
        if isinstance(indices, torch.Tensor):
            indices = indices.tolist()
        return PackedTensor([self.tensors[int(i)] for i in indices], self.dim_to_pack)

    def repeat_interleave(self, repeats: int) -> PackedTensor:
        """Each item ``repeats`` times in a row, sharing the item's tensor (no copy)."""
        return PackedTensor([t for t in self.tensors for _ in range(repeats)], self.dim_to_pack)

    @classmethod
    def empty_like(cls, other: PackedTensor, num_items: int = 0) -> PackedTensor:
        """``num_items`` None items, packed like ``other``."""
        return cls([None] * num_items, other.dim_to_pack)

    @classmethod
    def concat(cls, packed: Sequence[PackedTensor]) -> PackedTensor:
        """The items of every ``packed`` value in order (batches joined end to end)."""
        dim = common_dim_to_pack(packed)
        return cls([t for p in packed for t in p.tensors], dim)

    @classmethod
    def flattened_concat(cls, packed: Sequence[PackedTensor | None]) -> PackedTensor:
        """One item per entry of ``packed``: that entry's items concatenated (None for a
        None entry or one with no present item). Turns a log's per-message values into one
        per-sample item, or per-sample values into a batch."""
        dim = common_dim_to_pack([p for p in packed if p is not None])
        return cls([None if p is None else p.as_tensor() for p in packed], dim)


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
