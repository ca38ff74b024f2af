"""The vision inputs each sample of a rollout has accumulated, ready to go to the policy.

A sample's images come from its prompt messages and from observations that hold images;
each message carries its own as one-item ``PackedTensor`` values (see
``envloop.data.multimodal_utils``). The policy needs, per sample, all of them in message
order. They are kept as references to the messages' own tensors (a prompt's images,
shared by every generation of a GRPO group, are never copied into each sample's state) and
joined per key only when handed over: one ``PackedTensor`` column per key, one item per
active sample (None for a sample without images), built for the policy call at hand. The images
themselves go along too, as the ``images`` column (a list of RGB PIL images per sample, in
message order; None for a sample without), for backends that send images rather than
pixel values (inference servers).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from envloop.data.multimodal_utils import PackedTensor, content_images

IMAGE_READER_KEYS = frozenset({"image_grid_thw"})
"""The vision input columns a backend that reads ``images`` also reads (each image's patch
grid, to check its placeholder tokens)."""


class SampleVision:
    """Per sample, each vision input key's tensors so far, in message order (references to
    the messages' tensors; joined along dim 0 by :meth:`columns`)."""

    def __init__(self, size: int, reads_images: bool | None = None) -> None:
        self.inputs: list[dict[str, list[torch.Tensor]]] = [{} for _ in range(size)]
        self.images: list[list[Any]] = [[] for _ in range(size)]
        # What columns() hands over: None, both the vision input columns and images; True,
        # images and image_grid_thw (what a server backend sends and checks); False, the
        # vision input columns without images (rollout_state.media_read_by).
        self.reads_images = reads_images

    def reset(self, sample: int, messages: Sequence[Mapping[str, Any]]) -> None:
        """``sample`` holds the vision inputs of ``messages`` and nothing else."""
        self.inputs[sample], self.images[sample] = {}, []
        for message in messages:
            self.add(sample, message)

    @property
    def any(self) -> bool:
        return any(self.inputs)

    def add(self, sample: int, message: Mapping[str, Any]) -> None:
        """Add the ``PackedTensor`` values of ``message`` to ``sample``'s inputs, and
        its images to the sample's images (a message without vision inputs adds none)."""
        own = self.inputs[sample]
        if any(isinstance(v, PackedTensor) for v in message.values()):
            where = f"sample {sample}, {message.get('role')} message"
            self.images[sample].extend(content_images(message.get("content"), where))
        for key, value in message.items():
            if not isinstance(value, PackedTensor):
                continue
            tensor = value.as_tensor()
            if tensor is None:
                continue
            own.setdefault(key, []).append(tensor)

    def columns(self, samples: Sequence[int]) -> dict[str, Any]:
        """One ``PackedTensor`` per key any of ``samples`` has, one item per sample (its
        tensors joined along dim 0; a sample with one image message: that message's own
        tensor), and the ``images`` column (none of either when no sample has images);
        with :attr:`reads_images` set, only what the policy reads (the other inputs are
        never joined)."""
        keys = dict.fromkeys(k for i in samples for k in self.inputs[i])
        if not keys:
            return {}
        if self.reads_images:
            keys = dict.fromkeys(k for k in keys if k in IMAGE_READER_KEYS)
        columns: dict[str, Any] = {
            k: PackedTensor([_joined(self.inputs[i].get(k)) for i in samples], 0) for k in keys
        }
        if self.reads_images is not False:
            columns["images"] = [self.images[i] or None for i in samples]
        return columns


def _joined(tensors: list[torch.Tensor] | None) -> torch.Tensor | None:
    """``tensors`` joined along dim 0 (the one tensor itself, uncopied, when alone)."""
    if not tensors:
        return None
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)
