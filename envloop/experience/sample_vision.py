"""The vision inputs each sample of a rollout has accumulated, ready to go to the policy.

A sample's images come from its prompt messages and from observations that hold images;
each message carries its own as one-item ``PackedTensor`` values (see
``envloop.data.multimodal_utils``). The policy needs, per sample, all of them in message
order, so they are kept concatenated per key and handed over as one ``PackedTensor``
column per key, one item per active sample (None for a sample without images).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from envloop.data.multimodal_utils import PackedTensor


class SampleVision:
    """Per sample, each vision input key's tensors so far, concatenated along dim 0."""

    def __init__(self, size: int) -> None:
        self.inputs: list[dict[str, torch.Tensor]] = [{} for _ in range(size)]

    @classmethod
    def from_logs(cls, logs: Sequence[Sequence[Mapping[str, Any]]]) -> SampleVision:
        vision = cls(len(logs))
        for i, log in enumerate(logs):
            for message in log:
                vision.add(i, message)
        return vision

    @property
    def any(self) -> bool:
        return any(self.inputs)

    def add(self, sample: int, message: Mapping[str, Any]) -> None:
        """Append the ``PackedTensor`` values of ``message`` to ``sample``'s inputs."""
        own = self.inputs[sample]
        for key, value in message.items():
            if not isinstance(value, PackedTensor):
                continue
            tensor = value.as_tensor()
            if tensor is None:
                continue
            own[key] = tensor if key not in own else torch.cat([own[key], tensor])

    def columns(self, samples: Sequence[int]) -> dict[str, PackedTensor]:
        """One ``PackedTensor`` per key any of ``samples`` has, one item per sample."""
        keys = dict.fromkeys(k for i in samples for k in self.inputs[i])
        return {k: PackedTensor([self.inputs[i].get(k) for i in samples], 0) for k in keys}
