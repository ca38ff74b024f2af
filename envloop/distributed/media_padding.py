"""Concatenating media tensors of different shapes: ``PackedTensor(pad_to_max_shape=True)``.

Images of mixed resolutions ([1, C, H, W] with different H and W), audio features of
different lengths and videos of different frame counts cannot be concatenated as they are.
With padding, every dimension except the packing one is zero-padded at its end to the
largest size among the tensors, then the tensors are concatenated along the packing one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["pad_and_concat"]


def pad_and_concat(tensors: list[torch.Tensor], dim: int, pad_to_max_shape: bool) -> torch.Tensor:
    """``tensors`` concatenated along ``dim``, each first zero-padded (at the end of every
    other dimension) to the batch's largest size there if ``pad_to_max_shape``.

    Raises ``ValueError`` if padding tensors of different ranks and ``IndexError`` if
    ``dim`` is not a dimension of the tensors.

    >>> a, b = torch.ones(1, 2, 4), torch.ones(2, 4, 2)
    >>> tuple(pad_and_concat([a, b], 0, True).shape)
    (3, 4, 4)
    """
    if not pad_to_max_shape:
        return torch.cat(tensors, dim=dim)
    ranks = sorted({t.dim() for t in tensors})
    if len(ranks) != 1:
        raise ValueError(
            f"pad_to_max_shape requires tensors with the same rank, but received ranks {ranks}; "
            "give every item of this input the same number of dimensions (e.g. add the "
            "leading image or frame dimension with unsqueeze(0))."
        )
    rank = ranks[0]
    if not -rank <= dim < rank:
        raise IndexError(
            f"dim_to_pack={dim} is invalid for tensors with rank {rank}; use a dimension in "
            f"[{-rank}, {rank})."
        )
    pack = dim % rank
    target = [max(t.shape[d] for t in tensors) for d in range(rank)]
    padded = []
    for t in tensors:
        pads: list[int] = []
        for d in reversed(range(rank)):  # F.pad takes (left, right) pairs from the last dim
            pads += [0, 0 if d == pack else target[d] - t.shape[d]]
        padded.append(F.pad(t, pads) if any(pads) else t)
    return torch.cat(padded, dim=pack)
