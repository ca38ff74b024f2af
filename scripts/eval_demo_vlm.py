"""Held-out accuracy of the bundled demo VLM policy on the shapes tasks, against baselines.

    .venv/bin/python scripts/eval_demo_vlm.py [--rows 200] [--model DIR] [--seed 0]

The policy (``envloop/demo/assets/vlm_policy`` unless ``--model``) answers held-out rows of
:mod:`envloop.demo.shapes` by plain ``model.generate`` (no teacher forcing), greedily and
sampled at temperature 0.7, from the same prompt tokens the rollout engine builds
(``get_formatted_message_log(..., add_generation_prompt=True)``). The replies are scored by
the ``vlm`` environment with each task's :data:`~envloop.demo.shapes.REWARD_FUNCTIONS`:

- ``count_shapes``: exact-answer accuracy, against chance (1/4: the answers 1..4 are
  equally likely);
- ``locate_shape``: mean ``bbox_giou`` reward and the share of boxes with IoU >= 0.5,
  against fixed answers: the whole image, and a box of the mean shape size at the centre.

Prints a markdown table.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import torch

from envloop.data.llm_message_utils import get_formatted_message_log
from envloop.demo import ASSETS, shapes
from envloop.environments.reward_model.batching import pad_sequences
from envloop.environments.vlm_environment import VLMEnvironment

MAX_NEW_TOKENS = 24
MID, HALF = shapes.IMAGE_SIZE // 2, sum(shapes.SIDE_RANGE) // 4
BASELINES = {
    "whole image": [0, 0, shapes.IMAGE_SIZE, shapes.IMAGE_SIZE],
    "centre box": [MID - HALF, MID - HALF, MID + HALF, MID + HALF],
}


def prompt_inputs(rows: list[shapes.VisualRow], processor: Any) -> dict[str, torch.Tensor]:
    """Left-padded prompt ``input_ids`` / ``attention_mask`` [B, L] and the vision inputs
    (``pixel_values`` [patches, 1176], ``image_grid_thw`` [B, 3]) of ``rows``."""
    logs = [
        get_formatted_message_log(shapes.row_messages(row), processor, add_generation_prompt=True)
        for row in rows
    ]
    tokenizer = processor.tokenizer
    ids, mask = pad_sequences(
        [log[0]["token_ids"].tolist() for log in logs], tokenizer.pad_token_id, side="left"
    )
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "pixel_values": torch.cat([log[0]["pixel_values"].as_tensor() for log in logs]),
        "image_grid_thw": torch.cat([log[0]["image_grid_thw"].as_tensor() for log in logs]),
    }


@torch.no_grad()
def generate_replies(
    model: Any,
    processor: Any,
    rows: list[shapes.VisualRow],
    temperature: float | None,
    seed: int = 0,
    batch_size: int = 50,
) -> list[str]:
    """Each row's reply (greedy when ``temperature`` is None), decoded up to EOS."""
    tokenizer, replies = processor.tokenizer, []
    torch.manual_seed(seed)
    for start in range(0, len(rows), batch_size):
        inputs = prompt_inputs(rows[start : start + batch_size], processor)
        sampling = {"do_sample": False}
        if temperature is not None:
            sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        out = model.generate(
            **inputs,
            max_new_tokens=MAX_NEW_TOKENS,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            **sampling,
        )
        new = out[:, inputs["input_ids"].shape[1] :]
        replies += tokenizer.batch_decode(new, skip_special_tokens=True)
    return replies


def scores(task: str, replies: list[str], truths: list[Any]) -> dict[str, float]:
    """Mean reward and accuracy of ``replies`` in the task's ``vlm`` environment."""
    env = VLMEnvironment({"reward_functions": shapes.REWARD_FUNCTIONS[task]})
    try:
        logs = [[{"role": "assistant", "content": reply}] for reply in replies]
        ret = env.step(logs, [{"ground_truth": truth} for truth in truths])
    finally:
        env.shutdown()
    correct = [float(md["correct"]) for md in ret.metadata]
    return {"reward": float(ret.rewards.mean()), "accuracy": sum(correct) / len(correct)}


def evaluate(
    model: Any, processor: Any, rows_per_task: int, temperatures: list[float | None], seed: int = 0
) -> list[tuple[str, str, dict[str, float]]]:
    """(task, decoding, scores) for each task and temperature on held-out rows."""
    results = []
    for task in (shapes.COUNT_TASK, shapes.LOCATE_TASK):
        rows = shapes.visual_rows(task, rows_per_task, held_out=True)
        truths = [row.ground_truth for row in rows]
        for temperature in temperatures:
            replies = generate_replies(model, processor, rows, temperature, seed)
            name = "greedy" if temperature is None else f"T={temperature}"
            results.append((task, name, scores(task, replies, truths)))
    return results


def baseline_results(rows_per_task: int) -> list[tuple[str, str, dict[str, float]]]:
    """Chance on counting (uniform answers 1..4) and the fixed boxes on grounding."""
    chance = {"reward": 1 / shapes.MAX_SHAPES, "accuracy": 1 / shapes.MAX_SHAPES}
    results = [(shapes.COUNT_TASK, "chance", chance)]
    rows = shapes.visual_rows(shapes.LOCATE_TASK, rows_per_task, held_out=True)
    truths = [row.ground_truth for row in rows]
    for name, box in BASELINES.items():
        replies = [shapes.answer_text(box)] * len(rows)
        results.append((shapes.LOCATE_TASK, name, scores(shapes.LOCATE_TASK, replies, truths)))
    return results


def table(results: list[tuple[str, str, dict[str, float]]]) -> str:
    lines = ["| task | answers | mean reward | accuracy |", "|---|---|---|---|"]
    for task, name, s in results:
        lines.append(f"| {task} | {name} | {s['reward']:.3f} | {s['accuracy']:.3f} |")
    return "\n".join(lines)


def load_policy(folder: Path) -> tuple[Any, Any]:
    """The processor and model saved in ``folder``, the model in eval mode."""
    from transformers import AutoModelForImageTextToText

    from envloop.models.processors import load_processor

    processor = load_processor(str(folder))
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32)
    return processor, model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=200, help="held-out rows per task")
    parser.add_argument("--model", type=Path, default=ASSETS / "vlm_policy")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(2)
    started = time.monotonic()
    processor, model = load_policy(args.model)
    results = evaluate(model, processor, args.rows, [None, 0.7], args.seed)
    print(table(baseline_results(args.rows) + results))
    print(f"\n{args.rows} held-out rows per task, {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
