"""Finished rollout batches whose message logs hold images, built by hand as the engine
builds them: prompts tokenized by the tiny VLM's processor, assistant turns with token ids
and logprobs, and observations (some with an image) tokenized by the processor."""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import torch
from PIL import Image

from envloop.data.llm_message_utils import get_formatted_message_log
from envloop.data.multimodal_messages import tokenize_with_processor
from envloop.distributed.batched_data_dict import BatchedDataDict

QUESTION = "How many squares?"


def shapes_image(height: int, width: int, color: tuple[int, int, int], seed: int) -> Image.Image:
    """A noisy background (so a lossy copy would show) with a square of ``color``."""
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    pixels[4:20, 6:22] = color
    return Image.fromarray(pixels)


RED = shapes_image(56, 84, (255, 0, 0), seed=1)  # 4 x 6 patches of 14 px
BLUE = shapes_image(70, 42, (0, 0, 255), seed=2)
GREEN = shapes_image(28, 28, (0, 255, 0), seed=3)
LOOK_AGAIN = [{"type": "text", "text": "Wrong. Look again:"}, {"type": "image", "image": BLUE}]


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def image_prompt(image: Any, text: str = QUESTION) -> list[dict[str, Any]]:
    parts = [{"type": "image", "image": image}, {"type": "text", "text": text}]
    return [{"role": "system", "content": "Count carefully."}, {"role": "user", "content": parts}]


def assistant(processor: Any, text: str, logprob: float) -> dict[str, Any]:
    """A generated turn: its text, its tokens (ending with ``<|im_end|>``) and logprobs."""
    ids = processor.tokenizer(text + "<|im_end|>", add_special_tokens=False)["input_ids"]
    return {
        "role": "assistant",
        "content": text,
        "token_ids": torch.tensor(ids, dtype=torch.long),
        "generation_logprobs": torch.full((len(ids),), logprob, dtype=torch.float32),
    }


def observation(processor: Any, content: Any) -> dict[str, Any]:
    """An environment message rendered with the chat template plus the next assistant
    prefix, tokenized by the processor (image placeholders expanded, vision inputs kept)."""
    message = {"role": "environment", "content": content}
    text = "\n" + processor.apply_chat_template([message], add_generation_prompt=True)
    [ids], [vision] = tokenize_with_processor(processor, [text], [content])
    return {**message, "token_ids": torch.tensor(ids, dtype=torch.long), **vision}


def finished_sample(
    processor: Any, prompt: list[dict[str, Any]], turns: list[tuple[str, Any, float]]
) -> dict[str, Any]:
    """One sample's columns; ``turns``: ``(response, observation content or None, reward)``."""
    log = get_formatted_message_log(prompt, processor, add_generation_prompt=True)
    for k, (response, seen, _) in enumerate(turns):
        log.append(assistant(processor, response, -0.25 * (k + 1)))
        if seen is not None:
            log.append(observation(processor, seen))
    rewards = [float(r) for _, _, r in turns]
    return {
        "message_log": log, "prompt_messages": prompt, "turn_rewards": rewards,
        "total_reward": sum(rewards), "num_turns": len(turns),
        "terminated": turns[-1][1] is None, "truncated": False,
    }  # fmt: skip


def image_batch(processor: Any) -> BatchedDataDict[Any]:
    """Three finished samples: a two-turn episode with RED in the prompt and BLUE in the
    first observation; RED again (given as PNG bytes) answered in one turn; a text-only one."""
    samples = [
        finished_sample(processor, image_prompt(RED), [
            ("two", LOOK_AGAIN, 0.0),
            ("three", None, 1.0),
        ]),
        finished_sample(processor, image_prompt(png(RED)), [("three", "Correct.", 1.0)]),
        finished_sample(processor, [{"role": "user", "content": "Say hi."}], [("hi", "bye", 0.5)]),
    ]  # fmt: skip
    return rollout_batch(samples, tasks=["count", "count", "echo"])


def rollout_batch(samples: list[dict[str, Any]], tasks: list[str]) -> BatchedDataDict[Any]:
    """A final batch with the columns ``sample_records`` reads."""
    n = len(samples)
    columns: dict[str, Any] = {key: [s[key] for s in samples] for key in samples[0]}
    for key in ("total_reward", "num_turns", "terminated", "truncated"):
        columns[key] = torch.tensor(columns[key])
    return BatchedDataDict(
        **columns,
        idx=list(range(n)), task_name=tasks, generation=[0] * n,
        env_error=[None] * n, generation_error=[None] * n, loss_multiplier=[1.0] * n,
        ground_truth=["3"] * n, extra_env_info=[{"ground_truth": "3"}] * n,
        initial_extra_env_info=[{"ground_truth": "3"}] * n,
    )  # fmt: skip
