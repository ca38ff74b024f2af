"""Memory per sample of a GRPO batch's image inputs: repeats that copy the prompt's image
(the published default), repeats that share it with each sample's images concatenated into
one tensor, and envloop's rollout path (shared repeats, flattening that references each
image once), side by side in one run.

Workload: ``--prompts`` prompts with one image each, repeated ``--generations`` times
(``BatchedDataDict.repeat_interleave``, as the dataset builds a rollout batch); each
generation then has ``--turns`` more user turns, each with an image of its own (an
environment's observation). The image inputs are the tiny Qwen2.5-VL processor's
(``envloop.models.tiny_vlm``: at most 64 patches of 1,176 float32 values, 294 KiB, per
image; a real processor's images are larger, the ratios the same). Each configuration is
flattened into the training batch (``batched_message_log_to_flat_message``):

- copied: ``repeat_interleave(generations)`` (the default, as published: each generation's
  log holds its own copy of the prompt's image tensors) and each sample's images as one
  tensor, as NeMo-RL's plain flattening makes it;
- concatenated: ``repeat_interleave(generations, share_immutable_media=True)`` (the
  generations share the prompt's tensors) and each sample's images as one tensor (a
  sample with one image keeps that tensor), so a prompt's image is copied into every
  generation's row once the sample has a second image message;
- referenced: the same shared repeats and envloop's flattening; rows reference the
  messages' tensors, and the tensors a prompt's generations share are stored once (what
  ``build_rollout_batch`` and the training batch do).

Reported per sample: the bytes the batch's vision columns hold (distinct tensor storages)
and the bytes of the batch pickled (what a Ray worker is sent), and the time to flatten
(fastest of 5).

    .venv/bin/python benchmarks/vlm_media_sharing.py [--prompts 4] [--generations 8]
        [--turns 0 1 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ray import cloudpickle

from envloop.data.llm_message_utils import (
    batched_message_log_to_flat_message,
    get_formatted_message_log,
)
from envloop.data.multimodal_utils import PackedTensor
from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.models.tiny_vlm import build_tiny_vlm_processor


def image(seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (112, 112, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def user(seed: int, text: str) -> dict:
    parts = [{"type": "image", "image": image(seed)}, {"type": "text", "text": text}]
    return {"role": "user", "content": parts}


def rollout_logs(
    processor, prompts: int, generations: int, turns: int, share: bool
) -> list[list[dict]]:
    """Prompt logs repeated per generation (sharing their media if ``share``), each
    generation then given ``turns`` replies and image turns of its own (formatted once per
    distinct image, as a rollout does)."""
    prompt_logs = [
        get_formatted_message_log([user(p, f"Describe image {p}.")], processor)
        for p in range(prompts)
    ]
    batch = BatchedDataDict({"message_log": prompt_logs})
    logs = batch.repeat_interleave(generations, share_immutable_media=share)["message_log"]
    for row, log in enumerate(logs):
        conversation = [user(row // generations, f"Describe image {row // generations}.")]
        for t in range(turns):
            conversation += [
                {"role": "assistant", "content": f"reply {t}"},
                user(10_000 + row * turns + t, f"And observation {t}?"),
            ]
        log.extend(get_formatted_message_log(conversation, processor)[1:])
    return logs


def vision_bytes(batch: BatchedDataDict) -> int:
    """Bytes of the distinct tensor storages held by the batch's PackedTensor columns."""
    storages = {}
    for value in batch.values():
        if isinstance(value, PackedTensor):
            for t in value.tensors:
                if t is not None:
                    storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def concatenated(flat: BatchedDataDict) -> BatchedDataDict:
    """``flat`` with each PackedTensor column's rows materialised, one tensor per row."""
    out = BatchedDataDict(flat)
    for key, value in flat.items():
        if isinstance(value, PackedTensor):
            out[key] = PackedTensor(list(value), value.dim_to_pack)
    return out


def measure(logs: list[list[dict]], concatenate: bool, repeats: int = 5) -> dict[str, Any]:
    """Per-sample bytes, and the fastest of ``repeats`` flattenings."""
    seconds = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        flat, _ = batched_message_log_to_flat_message(logs)
        if concatenate:
            flat = concatenated(flat)
        seconds = min(seconds, time.perf_counter() - start)
    n = len(logs)
    return {
        "held": vision_bytes(flat) / n,
        "pickled": len(cloudpickle.dumps(flat)) / n,
        "ms": seconds * 1000,
        "pixels": flat.get_multimodal_dict(as_tensors=True)["pixel_values"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--turns", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    processor = build_tiny_vlm_processor()
    print(
        f"{args.prompts} prompts x {args.generations} generations; KB per sample "
        "(vision columns held / batch pickled), flatten time"
    )
    header = (
        f"{'turns':>5} | {'copied':>24} | {'concatenated':>24} | {'referenced':>24} | "
        f"{'held saved':>10}"
    )
    print(header + "\n" + "-" * len(header))
    for turns in args.turns:
        copied_logs = rollout_logs(processor, args.prompts, args.generations, turns, False)
        shared_logs = rollout_logs(processor, args.prompts, args.generations, turns, True)
        copied = measure(copied_logs, True)
        joined, referenced = measure(shared_logs, True), measure(shared_logs, False)
        for other in (joined, referenced):  # the model sees the same input
            assert (copied["pixels"] == other["pixels"]).all()
        cells = [
            f"{m['held'] / 1024:7.0f} / {m['pickled'] / 1024:6.0f} KB {m['ms']:5.1f} ms"
            for m in (copied, joined, referenced)
        ]
        saved = 1 - referenced["held"] / copied["held"]
        print(f"{turns:>5} | {cells[0]:>24} | {cells[1]:>24} | {cells[2]:>24} | {saved:>9.0%}")


if __name__ == "__main__":
    main()
