"""A judge-heavy multi-turn workload: the sync engine against the async engine, whose judge
calls overlap generation.

Workload: ``--prompts`` held-out arithmetic questions x ``--generations`` replies from the
bundled policy (sampled at T=1), judged by the ``judge`` environment (``bundled:judge``,
``reference_equivalence`` with the reference) in a Ray actor; a reply judged wrong is told
its score and answers again, up to ``--attempts`` answers. The sync engine generates a turn
for every sample, then waits for every judgement, then generates the next turn; the async
engine judges each sample as soon as its reply is done (the judge's decode loop batching the
concurrent calls) while the others still generate. Both runs use fresh policies and judges
with the same seeds, interleaved ``--repeats`` times; the table gives each engine's wall
time (best and median), judge calls and mean reward, and the async/sync ratio.

    .venv/bin/python benchmarks/judge_overlap.py [--prompts 16] [--generations 2] [--attempts 3]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from envloop.data.llm_message_utils import get_formatted_message_log
from envloop.demo import tasks
from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.distributed.ray_utils import init_ray
from envloop.environments.registry import create_env
from envloop.experience.rollouts import run_async_multi_turn_rollout, run_multi_turn_rollout
from envloop.models.generation.hf_generation import HfGeneration

JUDGE = {"backend": "hf", "model_name": "bundled:judge", "max_new_tokens": 64}


def input_batch(tokenizer: Any, prompts: int, generations: int, seed: int) -> BatchedDataDict:
    questions = random.Random(seed).sample(tasks.math_items(held_out=True), prompts)
    logs, infos = [], []
    for q in questions:
        for _ in range(generations):
            messages = [{"role": "user", "content": q.question}]
            logs.append(get_formatted_message_log(messages, tokenizer, add_generation_prompt=True))
            infos.append({"ground_truth": q.ground_truth})
    n = len(logs)
    return BatchedDataDict(
        message_log=logs,
        length=[sum(len(m["token_ids"]) for m in log) for log in logs],
        extra_env_info=infos,
        loss_multiplier=[1.0] * n,
        idx=[i // generations for i in range(n)],
        task_name=["judge"] * n,
    )


def one_run(engine: str, args: argparse.Namespace) -> dict[str, float]:
    policy = HfGeneration({"model_name": "bundled:policy", "max_new_tokens": 48, "seed": 0})
    env = create_env("judge", {"judge": JUDGE, "max_attempts": args.attempts, "num_cpus": 0})
    batch = input_batch(policy.tokenizer, args.prompts, args.generations, args.seed)
    run = run_multi_turn_rollout if engine == "sync" else run_async_multi_turn_rollout
    import ray

    ray.get(env.__ray_ready__.remote())
    started = time.perf_counter()
    final, _ = run(
        policy, batch, policy.tokenizer, {"judge": env}, 512, max_rollout_turns=args.attempts,
        observation_format="chat_template",
    )  # fmt: skip
    wall = time.perf_counter() - started
    _, metrics = ray.get(env.global_post_process_and_metrics.remote(final))
    policy.shutdown()
    ray.kill(env)
    return {
        "wall_s": wall,
        "judge_calls": metrics["judge_env/judge_calls"],
        "mean_reward": float(final["total_reward"].mean()),
        "turns": float(final["num_turns"].float().mean()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--generations", type=int, default=2)
    parser.add_argument("--attempts", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    init_ray(num_cpus=2)
    results: dict[str, list[dict[str, float]]] = {"sync": [], "async": []}
    for _ in range(args.repeats):
        for engine in ("sync", "async"):
            results[engine].append(one_run(engine, args))
            print(f"{engine}: {results[engine][-1]}", flush=True)
    print("\n| engine | best wall s | median wall s | judge calls | mean turns | mean reward |")
    print("|---|---|---|---|---|---|")
    for engine, runs in results.items():
        walls = [r["wall_s"] for r in runs]
        last = runs[-1]
        cells = [f"{min(walls):.1f}", f"{statistics.median(walls):.1f}"]
        cells += [
            f"{last['judge_calls']:.0f}",
            f"{last['turns']:.2f}",
            f"{last['mean_reward']:.3f}",
        ]
        print(f"| {engine} | " + " | ".join(cells) + " |")
    best = {e: min(r["wall_s"] for r in runs) for e, runs in results.items()}
    print(f"\nasync / sync wall time (best of {args.repeats}): {best['async'] / best['sync']:.2f}")


if __name__ == "__main__":
    main()
