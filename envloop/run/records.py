"""One record per sample of a finished rollout batch: what ``rollouts.jsonl`` and
``rollouts.parquet`` hold.

Prompt messages keep their original content (not the chat-templated text they were
tokenized as); each observation carries the reward of the turn that produced it. ``rewards``
holds the ``reward/<name>`` component totals that the sample's own environment returned (a
batch column of a component only another task's environment returns is left out). The token
columns (:data:`TOKEN_KEYS`) are the whole sequence the policy saw and produced.

A message whose ``content`` is a list of parts keeps its parts, JSON-safe: each image part's
``image`` becomes the name of its file in the run directory, ``images/<16 hex>.png`` (the
first 16 hex digits of the SHA-256 of the PNG, so an image is stored once however often it
occurs). The image, in RGB as the processor was given it, travels as lossless PNG bytes in
the record's image columns (:data:`IMAGE_KEYS`; present only on samples with images):
``images`` (in message order), ``image_messages`` (each image's message index) and
``image_grid_thw`` (each image's ``[t, h, w]`` patch grid from the message's
``image_grid_thw``, or None when the processor gives none). Vision inputs
(``pixel_values`` and any other ``PackedTensor``) are model inputs and never stored.
"""

from __future__ import annotations

import hashlib
import io
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from envloop.data.multimodal_utils import PackedTensor, load_image
from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.run.files import IMAGES_DIR

TOKEN_KEYS = (
    "input_ids",
    "generation_logprobs",
    "generation_policy_versions",
    "loss_mask",
    "message_token_counts",
)
"""Per-token columns: Parquet only."""

IMAGE_KEYS = ("images", "image_messages", "image_grid_thw")
"""Per-image columns, on the records of samples with images only: Parquet only."""

PARQUET_ONLY_KEYS = TOKEN_KEYS + IMAGE_KEYS
"""The record keys ``rollouts.jsonl`` leaves out (the model's inputs and outputs)."""


def sample_records(
    final: BatchedDataDict[Any], first_sample: int = 0, *, ids: Sequence[int] | None = None
) -> list[dict[str, Any]]:
    """Records of the samples of ``final`` (a ``run_multi_turn_rollout`` result whose input
    came from :func:`envloop.data.datasets.build_rollout_batch`), numbered from
    ``first_sample``, or ``ids`` (one per row) when given."""
    size = len(final["message_log"])
    numbers = list(ids) if ids is not None else range(first_sample, first_sample + size)
    if len(numbers) != size:
        raise ValueError(f"sample_records: {len(numbers)} ids for {size} rows")
    components = sorted(k for k in final if k.startswith("reward/"))
    encoded: dict[int, bytes] = {}  # id(image) -> PNG: generations of a prompt share images
    return [_record(final, i, numbers[i], components, encoded) for i in range(size)]


def jsonable(value: Any) -> Any:
    """``value`` with tensors, tuples and other non-JSON values made JSON-safe (NaN and
    infinities become None)."""
    if isinstance(value, torch.Tensor):
        return jsonable(value.tolist())
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


def png_bytes(image: Any, where: str = "image") -> bytes:
    """``image`` (anything :func:`~envloop.data.multimodal_utils.load_image` reads) as
    lossless RGB PNG bytes: decoding them gives the pixels the processor was given."""
    buffer = io.BytesIO()
    load_image(image, where).save(buffer, format="PNG")
    return buffer.getvalue()


def image_file_name(png: bytes) -> str:
    """The run-directory path an image's PNG bytes are stored under, named by their content.

    >>> image_file_name(b"not really a png")
    'images/e90137d39de304ee.png'
    """
    return f"{IMAGES_DIR}/{hashlib.sha256(png).hexdigest()[:16]}.png"


def _record(
    final: BatchedDataDict[Any],
    i: int,
    sample: int,
    components: list[str],
    encoded: dict[int, bytes],
) -> dict[str, Any]:
    prompt, log = final["prompt_messages"][i], final["message_log"][i]
    images = _Images(encoded)
    messages, tokens = _messages(log, prompt, final["turn_rewards"][i], images, f"sample {sample}")
    return {
        "sample": sample,
        "idx": int(final["idx"][i]),
        "task": final["task_name"][i],
        "generation": int(final["generation"][i]),
        "messages": messages,
        "total_reward": float(final["total_reward"][i]),
        "rewards": {name: float(final[name][i]) for name in _own(final, i, components)},
        "turn_rewards": [float(r) for r in final["turn_rewards"][i]],
        "num_turns": int(final["num_turns"][i]),
        "truncated": bool(final["truncated"][i]),
        "terminated": bool(final["terminated"][i]),
        "error": final["env_error"][i] or final["generation_error"][i],
        "loss_multiplier": float(final["loss_multiplier"][i]),
        "min_policy_version": _version(final, "min_policy_version", i),
        "max_policy_version": _version(final, "max_policy_version", i),
        "ground_truth": final["ground_truth"][i],
        "extra_env_info": jsonable(final["extra_env_info"][i]),
        "initial_extra_env_info": jsonable(final["initial_extra_env_info"][i]),
        **tokens,
        **images.columns(),
    }


def _messages(
    log: list[dict[str, Any]],
    prompt: list[dict[str, Any]],
    turn_rewards: list[float],
    images: _Images,
    where: str,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages of one sample and its token columns; its images go to ``images``."""
    messages, turn = [], -1
    ids, logprobs, versions, mask = [], [], [], []
    for j, message in enumerate(log):
        token_ids = message["token_ids"]
        generated = "generation_logprobs" in message
        content = prompt[j]["content"] if j < len(prompt) else message["content"]
        if isinstance(content, list):
            content = images.stored_parts(content, j, message, f"{where}, message {j}")
        entry: dict[str, Any] = {
            "role": message["role"],
            "content": content,
            "num_tokens": len(token_ids),
        }
        if generated:
            turn += 1
        elif j >= len(prompt) and 0 <= turn < len(turn_rewards):
            entry["reward"] = float(turn_rewards[turn])
        messages.append(entry)
        ids.append(token_ids)
        logprobs.append(
            message["generation_logprobs"] if generated else torch.zeros(len(token_ids))
        )
        versions.append(message.get("generation_policy_versions", torch.zeros(len(token_ids))))
        mask.append(torch.full((len(token_ids),), int(generated), dtype=torch.int8))
    tokens = {
        "input_ids": torch.cat(ids).tolist() if ids else [],
        "generation_logprobs": torch.cat(logprobs).float().tolist() if logprobs else [],
        "generation_policy_versions": torch.cat(versions).int().tolist() if versions else [],
        "loss_mask": torch.cat(mask).tolist() if mask else [],
        "message_token_counts": [m["num_tokens"] for m in messages],
    }
    return messages, tokens


def _version(final: BatchedDataDict[Any], key: str, i: int) -> int:
    """Sample ``i``'s ``min_policy_version`` or ``max_policy_version`` (-1: no generated
    token; also for a batch from before versions were recorded)."""
    return int(final[key][i]) if key in final else -1


class _Images:
    """The images of one sample's messages, collected in message order."""

    def __init__(self, encoded: dict[int, bytes]) -> None:
        self.encoded = encoded  # id(image) -> PNG, for images the batch holds
        self.pngs: list[bytes] = []
        self.messages: list[int] = []
        self.grid: list[list[int]] | None = []

    def stored_parts(
        self, parts: list[Any], j: int, message: Mapping[str, Any], where: str
    ) -> list[Any]:
        """Message ``j``'s content ``parts``, JSON-safe, each image collected as PNG bytes
        and named by its file."""
        stored = []
        for k, part in enumerate(parts):
            if isinstance(part, Mapping) and part.get("type") == "image":
                image = part.get("image")
                png = self.encoded.get(id(image)) or png_bytes(image, f"{where}, content part {k}")
                self.encoded[id(image)] = png
                self.pngs.append(png)
                self.messages.append(j)
                name = image_file_name(png)
                part = {key: name if key == "image" else jsonable(v) for key, v in part.items()}
            stored.append(jsonable(part))
        self._add_grid(message.get("image_grid_thw"), self.messages.count(j))
        return stored

    def _add_grid(self, value: Any, count: int) -> None:
        """Append a message's ``image_grid_thw`` rows ([images, 3]); the sample's grid
        becomes None when a message with images has no row per image."""
        if self.grid is None or count == 0:
            return
        rows = value.as_tensor() if isinstance(value, PackedTensor) else value
        rows = torch.as_tensor(rows).reshape(-1, 3).tolist() if rows is not None else []
        self.grid = self.grid + rows if len(rows) == count else None

    def columns(self) -> dict[str, Any]:
        if not self.pngs:
            return {}
        return {"images": self.pngs, "image_messages": self.messages, "image_grid_thw": self.grid}


def _own(final: BatchedDataDict[Any], i: int, components: list[str]) -> list[str]:
    """The components sample ``i``'s environment returned (all of them for a batch that
    does not say, e.g. one from an older engine)."""
    names = final.get("reward_components")
    return components if names is None else [c for c in components if c in names[i]]
