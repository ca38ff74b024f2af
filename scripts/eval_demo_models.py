"""Held-out accuracy of the bundled demo models, measured through the real rollout engine.

    .venv/bin/python scripts/eval_demo_models.py [--math 400] [--puzzles 60] [--temperature T]

The policy runs in ``HfGeneration`` (greedy unless ``--temperature`` is given) through
``run_multi_turn_rollout`` against in-process environments, with the demo's settings
(max_seq_len 512, observation format ``chat_template``): ``MathEnvironment`` for first
tries; the same with ``max_attempts`` 3 (another try after each wrong answer); and
``SlidingPuzzleEnv`` on 2x2 and 3x3 episodes (stop string ``</action>`` from the first
turn). The reward model scores held-out right/wrong reply pairs in
``RewardModelEnvironment``. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path
from typing import Any

import torch

from envloop.data.llm_message_utils import get_formatted_message_log
from envloop.demo import ASSETS, tasks
from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.environments.games.sliding_puzzle import STOP_STRINGS, SlidingPuzzleEnv, initial_prompt
from envloop.environments.games.sliding_puzzle_board import is_solved
from envloop.environments.math_environment import MathEnvironment
from envloop.environments.reward_model_environment import RewardModelEnvironment
from envloop.experience.rollouts import run_multi_turn_rollout
from envloop.models.generation.hf_generation import HfGeneration, HfGenerationConfig

MAX_SEQ_LEN = 512
MAX_NEW_TOKENS = 48


def rollout(
    policy: HfGeneration, samples: list[dict[str, Any]], env: Any, max_turns: int, greedy: bool
) -> BatchedDataDict[Any]:
    """``samples`` (``prompt``, ``metadata``, ``stop_strings``) as one task against ``env``."""
    tokenizer = policy.tokenizer
    logs = [
        get_formatted_message_log(
            [{"role": "user", "content": s["prompt"]}], tokenizer, add_generation_prompt=True
        )
        for s in samples
    ]
    batch = BatchedDataDict(
        message_log=logs,
        task_name=["task"] * len(samples),
        extra_env_info=[s["metadata"] for s in samples],
        stop_strings=[s.get("stop_strings") for s in samples],
    )
    final, _ = run_multi_turn_rollout(
        policy,
        batch,
        tokenizer,
        {"task": env},
        MAX_SEQ_LEN,
        max_turns,
        greedy=greedy,
        observation_format="chat_template",
    )
    return final


def math_samples(count: int, seed: int) -> list[dict[str, Any]]:
    items = random.Random(seed).sample(tasks.math_items(held_out=True), count)
    return [{"prompt": i.question, "metadata": {"ground_truth": i.ground_truth}} for i in items]


def puzzle_samples(size: int, count: int) -> list[dict[str, Any]]:
    episodes = [
        tasks.puzzle_episode(tasks.HELD_OUT_SEED + i, size, tasks.PUZZLE_SHUFFLES[i % 3])
        for i in range(count)
    ]
    return [
        {"prompt": initial_prompt(e), "metadata": e, "stop_strings": list(STOP_STRINGS)}
        for e in episodes
    ]


def reward_model_accuracy(folder: Path, count: int, seed: int) -> float:
    """Held-out pairs whose right reply the reward model scores above the wrong one."""
    env = RewardModelEnvironment(
        {"model_name": str(folder), "precision": "float32", "max_model_len": MAX_SEQ_LEN}
    )
    rng = random.Random(seed)
    items = rng.sample(tasks.math_items(held_out=True), count)
    logs = []
    for item in items:
        for reply in (item.response(), tasks.wrong_response(item, rng)):
            logs.append([{"role": "user", "content": item.question},
                         {"role": "assistant", "content": reply}])  # fmt: skip
    scores = env.score([env.encode(log)[0] for log in logs]).view(-1, 2)
    return float((scores[:, 0] > scores[:, 1]).float().mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policy", type=Path, default=ASSETS / "policy")
    parser.add_argument("--reward-model", type=Path, default=ASSETS / "reward_model")
    parser.add_argument("--math", type=int, default=400, help="held-out questions")
    parser.add_argument("--puzzles", type=int, default=60, help="held-out episodes per size")
    parser.add_argument("--temperature", type=float, default=None, help="sample (else greedy)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    started = time.monotonic()
    greedy = args.temperature is None
    policy = HfGeneration(
        HfGenerationConfig(
            model_name=str(args.policy),
            max_new_tokens=MAX_NEW_TOKENS,
            temperature=args.temperature or 1.0,
            micro_batch_size=64,
            seed=args.seed,
        )
    )
    rows: list[tuple[str, str]] = []
    questions = math_samples(args.math, args.seed)
    math_env = MathEnvironment({"num_workers": 1})
    retry_env = MathEnvironment({"num_workers": 1, "max_attempts": 3})
    first = rollout(policy, questions, math_env, 1, greedy)
    rows.append(("math, first try", f"{first['total_reward'].mean().item():.3f}"))
    retried = rollout(policy, questions, retry_env, 3, greedy)
    math_env.shutdown()
    retry_env.shutdown()
    rows.append(("math, up to 3 tries", f"{retried['total_reward'].mean().item():.3f}"))
    for size in (2, 3):
        final = rollout(policy, puzzle_samples(size, args.puzzles), SlidingPuzzleEnv(), 12, greedy)
        solved = [is_solved(md["board"]) for md in final["extra_env_info"]]
        moves = torch.tensor([md["moves_made"] for md in final["extra_env_info"]]).float()
        rows.append((f"sliding puzzle {size}x{size}, solved", f"{sum(solved) / len(solved):.3f}"))
        rows.append((f"sliding puzzle {size}x{size}, mean moves", f"{moves.mean().item():.2f}"))
    if args.reward_model.is_dir():
        accuracy = reward_model_accuracy(args.reward_model, args.math, args.seed)
        rows.append(("reward model, pairwise accuracy", f"{accuracy:.3f}"))
    print(f"| held-out ({'greedy' if greedy else f'T={args.temperature}'}) | value |")
    print("|---|---|")
    for name, value in rows:
        print(f"| {name} | {value} |")
    print(f"\n({time.monotonic() - started:.0f} s)")


if __name__ == "__main__":
    main()
