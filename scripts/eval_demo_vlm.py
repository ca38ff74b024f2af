"""Held-out accuracy of the bundled demo VLM policy on the shapes tasks, against baselines.

    .venv/bin/python scripts/eval_demo_vlm.py [--rows 400] [--model DIR] [--seed 0]

The policy (``envloop/demo/assets/vlm_policy`` unless ``--model``) runs in ``HfGeneration``
through ``run_multi_turn_rollout`` against the ``vlm`` environment with each task's
:data:`~envloop.demo.shapes.REWARD_FUNCTIONS`, as in the demo: one turn, prompts from
``get_formatted_message_log`` (the image, then the prompt text), greedy and sampled at
temperature 0.7, on held-out rows of :mod:`envloop.demo.shapes`:

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

from envloop.demo import ASSETS, shapes
from envloop.environments.vlm_environment import VLMEnvironment
from envloop.experience.rollouts import run_multi_turn_rollout
from envloop.models.generation.hf_generation import HfGeneration

MAX_NEW_TOKENS = 24
MAX_SEQ_LEN = 256
MID, HALF = shapes.IMAGE_SIZE // 2, sum(shapes.SIDE_RANGE) // 4
BASELINES = {
    "whole image": [0, 0, shapes.IMAGE_SIZE, shapes.IMAGE_SIZE],
    "centre box": [MID - HALF, MID - HALF, MID + HALF, MID + HALF],
}
Result = tuple[str, str, dict[str, float]]
"""(task, how the answers were made, {"reward": mean reward, "accuracy": share correct})."""


def vlm_env(task: str) -> VLMEnvironment:
    return VLMEnvironment({"reward_functions": shapes.REWARD_FUNCTIONS[task]})


def rollout_scores(
    policy: HfGeneration, task: str, rows: list[shapes.VisualRow], greedy: bool
) -> dict[str, float]:
    """Mean reward and share correct of one-turn rollouts of ``rows`` in the task's env."""
    processor = policy.processor
    batch = shapes.rollout_batch(task, rows, processor)
    env = vlm_env(task)
    try:
        final, _ = run_multi_turn_rollout(
            policy, batch, processor, {task: env}, MAX_SEQ_LEN, max_rollout_turns=1, greedy=greedy
        )
    finally:
        env.shutdown()
    correct = [float(md["correct"]) for md in final["extra_env_info"]]
    return {
        "reward": final["total_reward"].float().mean().item(),
        "accuracy": sum(correct) / len(correct),
    }


def evaluate(
    folder: Path, rows_per_task: int, temperatures: list[float | None], seed: int = 0
) -> list[Result]:
    """Scores of the policy saved in ``folder`` on ``rows_per_task`` held-out rows of each
    task, greedy (temperature None) or sampled."""
    rows = {task: shapes.visual_rows(task, rows_per_task, True) for task in shapes.TASK_ROWS}
    results = []
    for temperature in temperatures:
        policy = HfGeneration(
            {
                "model_name": str(folder),
                "max_new_tokens": MAX_NEW_TOKENS,
                "temperature": temperature or 1.0,
                "seed": seed,
                "micro_batch_size": 64,
            }
        )
        name = "greedy" if temperature is None else f"T={temperature}"
        for task, task_rows in rows.items():
            scores = rollout_scores(policy, task, task_rows, greedy=temperature is None)
            results.append((task, name, scores))
        policy.shutdown()
    return sorted(results, key=lambda result: list(shapes.TASK_ROWS).index(result[0]))


def baseline_results(rows_per_task: int) -> list[Result]:
    """Chance on counting (uniform answers 1..4) and the fixed boxes on grounding."""
    chance = {"reward": 1 / shapes.MAX_SHAPES, "accuracy": 1 / shapes.MAX_SHAPES}
    results: list[Result] = [(shapes.COUNT_TASK, "chance", chance)]
    rows = shapes.visual_rows(shapes.LOCATE_TASK, rows_per_task, held_out=True)
    env = vlm_env(shapes.LOCATE_TASK)
    try:
        for name, box in BASELINES.items():
            logs = [[{"role": "assistant", "content": shapes.answer_text(box)}]] * len(rows)
            ret = env.step(logs, [{"ground_truth": row.ground_truth} for row in rows])
            accuracy = sum(md["correct"] for md in ret.metadata) / len(rows)
            scores = {"reward": ret.rewards.mean().item(), "accuracy": accuracy}
            results.append((shapes.LOCATE_TASK, name, scores))
    finally:
        env.shutdown()
    return results


def table(results: list[Result]) -> str:
    lines = ["| task | answers | mean reward | accuracy |", "|---|---|---|---|"]
    for task, name, s in results:
        lines.append(f"| {task} | {name} | {s['reward']:.3f} | {s['accuracy']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=400, help="held-out rows per task")
    parser.add_argument("--model", type=Path, default=ASSETS / "vlm_policy")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    started = time.monotonic()
    results = evaluate(args.model, args.rows, [None, 0.7], args.seed)
    print(table(baseline_results(args.rows) + results))
    print(f"\n{args.rows} held-out rows per task, {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
