"""New weights for a served transformers model, checked and prepared before it changes.

``HfGeneration.update_weights`` takes a state dict (``model.state_dict()`` of a trainer's
copy), a ``torch.nn.Module`` of the same architecture, or a folder written by
``save_pretrained``. :func:`stage_weights` turns any of them into :class:`StagedWeights`:
every key checked against the served model (one ``ValueError`` lists every missing key,
unexpected key and wrong shape) and each tensor cast to the dtype, and moved to the device,
of the tensor it replaces. Only :meth:`StagedWeights.apply` touches the model, and nothing
it does depends on the input being valid, so an update happens entirely or not at all.

Keys are the served model's own ``state_dict()`` names. A folder is read with the model
class's ``from_pretrained`` and the served model's config, so a checkpoint whose saved
names differ from the module's (transformers saves Qwen2.5-VL's
``model.language_model.layers.*`` as ``model.layers.*``) loads as it would on
construction, sharded or not. Tied tensors (an LM head tied to the input embeddings) are
one tensor: a state dict may hold any one of their keys, or several with equal values.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

WeightsSource = Mapping[str, torch.Tensor] | torch.nn.Module | str | os.PathLike
"""What ``update_weights`` takes: a state dict, a module, or a ``save_pretrained`` folder."""

SAFETENSORS_FILES = ("model.safetensors", "model.safetensors.index.json")
"""The files ``save_pretrained`` writes the weights to: one file, or shards and their index."""


@dataclass(frozen=True)
class WeightSpec:
    """The tensors a model's weights consist of (picklable: a worker pool checks weights
    against a worker's spec before it sends them anywhere).

    >>> spec = WeightSpec.of(torch.nn.Linear(3, 2))
    >>> spec.shapes
    {'weight': (2, 3), 'bias': (2,)}
    >>> for line in spec.problems({"weight": torch.zeros(3, 2), "scale": torch.ones(1)}):
    ...     print(line)
    bias: missing
    scale: unexpected (the model has no such tensor)
    weight: shape [3, 2], expected [2, 3]
    """

    shapes: dict[str, tuple[int, ...]]
    """Each ``state_dict()`` key and its tensor's shape, in ``state_dict()`` order."""
    tied: tuple[tuple[str, ...], ...] = ()
    """Groups of keys that name one tensor (tied weights), each in ``state_dict()`` order."""

    @classmethod
    def of(cls, model: torch.nn.Module) -> WeightSpec:
        tensors = model.state_dict(keep_vars=True)  # the live objects: tied keys share one
        groups: dict[int, list[str]] = {}
        for key, tensor in tensors.items():
            groups.setdefault(id(tensor), []).append(key)
        tied = tuple(tuple(keys) for keys in groups.values() if len(keys) > 1)
        return cls({k: tuple(t.shape) for k, t in tensors.items()}, tied)

    def problems(self, given: Mapping[str, Any]) -> list[str]:
        """Every way ``given`` (key -> tensor) does not fit, one line each: missing keys,
        unexpected keys, then values that are not tensors of the right shape and tied keys
        given different values. Empty when it fits."""
        problems = [f"{key}: missing{self._tie_note(key)}" for key in self._missing(given)]
        problems += [
            f"{key}: unexpected (the model has no such tensor)"
            for key in given
            if key not in self.shapes
        ]
        for key, value in given.items():
            if key not in self.shapes:
                continue
            if not isinstance(value, torch.Tensor):
                problems.append(f"{key}: got {type(value).__name__}, expected a tensor")
            elif tuple(value.shape) != self.shapes[key]:
                problems.append(
                    f"{key}: shape {list(value.shape)}, expected {list(self.shapes[key])}"
                )
        return problems + self._tie_problems(given)

    def _missing(self, given: Mapping[str, Any]) -> list[str]:
        """Keys absent from ``given``; of a tied group, its first key when none is given."""
        group_of = {key: group for group in self.tied for key in group}
        missing = []
        for key in self.shapes:
            group = group_of.get(key, (key,))
            if key == group[0] and not any(k in given for k in group):
                missing.append(key)
        return missing

    def _tie_note(self, key: str) -> str:
        group = next((g for g in self.tied if key in g), None)
        if group is None:
            return ""
        return f" (tied to {', '.join(group[1:])}: give any one of them)"

    def _tie_problems(self, given: Mapping[str, Any]) -> list[str]:
        """Keys of one tied group given with different values."""
        problems = []
        for group in self.tied:
            present = [k for k in group if k in given and self._fits(k, given[k])]
            for other in present[1:]:
                if not _equal(given[present[0]], given[other]):
                    problems.append(
                        f"{other}: differs from {present[0]}, which this model ties it to "
                        "(one tensor); give equal values, or only one of the two keys"
                    )
        return problems

    def _fits(self, key: str, value: Any) -> bool:
        return isinstance(value, torch.Tensor) and tuple(value.shape) == self.shapes[key]


@dataclass(frozen=True)
class StagedWeights:
    """New weights checked against a model and prepared (cast to each replaced tensor's
    dtype, on its device), not yet in the model."""

    pairs: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    """``(model tensor, new value)``, one per tensor of the model (a tied group once)."""

    def apply(self) -> None:
        """Copy every new value into the model's tensors, in place (tied weights stay tied,
        and what holds references to the tensors sees the new values)."""
        with torch.no_grad():
            for target, value in self.pairs:
                target.copy_(value)


def stage_weights(model: torch.nn.Module, weights: WeightsSource) -> StagedWeights:
    """``weights`` (a state dict, a module or a ``save_pretrained`` folder) checked against
    ``model`` and prepared to replace its tensors; ``model`` is not changed.

    Raises one ``ValueError`` naming every missing key, unexpected key and wrong shape (with
    both shapes), and ``TypeError`` for anything else than the three kinds of input. The
    given tensors are read, not copied, when they already have the model's dtype and
    device: leave them unchanged until the update is applied.
    """
    if isinstance(weights, (str, os.PathLike)):
        folder = Path(weights)
        given, problems = folder_state_dict(model, folder)
        source = f"the folder {str(folder)!r}"
    else:
        given, problems = state_dict_of(weights), []
        source = f"the {source_kind(weights)}"
    spec = WeightSpec.of(model)
    problems += spec.problems(given)
    if problems:
        raise weights_error(source, problems)
    return StagedWeights(_pairs(model, spec, given))


def state_dict_of(weights: Any) -> dict[str, Any]:
    """The key -> tensor mapping of a state dict or a module (its ``state_dict()``)."""
    if isinstance(weights, torch.nn.Module):
        return dict(weights.state_dict())
    if isinstance(weights, Mapping):
        return dict(weights)
    raise TypeError(
        f"update_weights takes a state dict (key -> tensor), a torch.nn.Module or the path of "
        f"a folder written by save_pretrained; got {type(weights).__name__}."
    )


def source_kind(weights: Any) -> str:
    """``module`` or ``state dict``: what an error calls ``weights``."""
    return "module" if isinstance(weights, torch.nn.Module) else "state dict"


def folder_state_dict(model: Any, folder: Path) -> tuple[dict[str, torch.Tensor], list[str]]:
    """The weights saved in ``folder`` under ``model``'s keys (loaded on the CPU in its
    dtype, by its class's ``from_pretrained`` with its config), and the keys transformers
    found missing, unexpected or of another shape. Raises ``ValueError`` when ``folder``
    holds no safetensors weights."""
    if not any((folder / name).is_file() for name in SAFETENSORS_FILES):
        raise ValueError(
            f"update_weights: {str(folder)!r} holds neither {' nor '.join(SAFETENSORS_FILES)}; "
            "give a folder written by model.save_pretrained(folder) (safetensors, the default), "
            "or the model or its state_dict()."
        )
    loaded, info = type(model).from_pretrained(
        folder,
        config=copy.deepcopy(model.config),
        dtype=model.dtype,
        output_loading_info=True,
        ignore_mismatched_sizes=True,  # reported below instead of raised one at a time
    )
    problems = [f"{key}: missing" for key in sorted(info["missing_keys"])]
    problems += [
        f"{key}: unexpected (the model has no such tensor)"
        for key in sorted(info["unexpected_keys"])
    ]
    problems += [
        f"{key}: shape {list(saved)}, expected {list(expected)}"
        for key, saved, expected in sorted(info["mismatched_keys"])
    ]
    return dict(loaded.state_dict()), problems


def weights_error(source: str, problems: list[str]) -> ValueError:
    """One error listing every problem of ``source``'s weights, with the fix."""
    lines = "\n".join(f"  - {p}" for p in problems)
    return ValueError(
        f"update_weights: {source} does not fit the served model, so nothing was changed "
        f"({len(problems)} problem{'s' if len(problems) > 1 else ''}):\n{lines}\n"
        "Give every key of the served model's state_dict() with its shape (the state_dict() "
        "of a model of the same architecture and size), or a folder its save_pretrained wrote."
    )


def _pairs(
    model: torch.nn.Module, spec: WeightSpec, given: Mapping[str, torch.Tensor]
) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """``(model tensor, new value)`` for each tensor of ``model``, the value cast and moved;
    a tied group's tensor takes the first of its keys that ``given`` holds."""
    group_of = {key: group for group in spec.tied for key in group}
    pairs, seen = [], set()
    for key, target in model.state_dict(keep_vars=True).items():
        if id(target) in seen:
            continue
        seen.add(id(target))
        source = next(k for k in group_of.get(key, (key,)) if k in given)
        pairs.append((target, given[source].detach().to(device=target.device, dtype=target.dtype)))
    return tuple(pairs)


def _equal(first: torch.Tensor, second: torch.Tensor) -> bool:
    """Whether two same-shaped tensors hold equal values (the same memory counts at once)."""
    same = (first.data_ptr(), first.stride(), first.device, first.dtype)
    if same == (second.data_ptr(), second.stride(), second.device, second.dtype):
        return True
    return torch.equal(first, second.to(device=first.device, dtype=first.dtype))
