"""Reward-model scoring: length-sorted dynamic batching against fixed-order batches.

Workload: 1,024 conversations whose templated lengths follow a long-tailed (log-normal)
distribution clipped to about 30-1,000 tokens, scored by a Qwen3 sequence classifier built
from a config (default hidden size 128, 2 layers, random weights; ``--hidden-size 256
--layers 4`` is about 4x slower on CPU) and loaded with ``from_pretrained`` through
``RewardModelEnvironment``. Both runs use batches of at most ``--batch-size`` rows;
fixed order pads each batch to its longest member, dynamic batching sorts by length first
(and caps a batch at ``batch_size x max_model_len`` padded tokens). The scores must agree
(max abs diff < 1e-4, asserted); the table reports the best of ``--repeats`` interleaved runs.

    .venv/bin/python benchmarks/reward_model_batching.py [--conversations 1024] [--batch-size 32]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from envloop.environments.reward_model.batching import plan_batches
from envloop.environments.reward_model_environment import RewardModelEnvironment
from envloop.models.tiny import TRAINING_CORPUS
from tests.fixtures.tiny_reward_model import save_tiny_reward_model

WORDS = " ".join(TRAINING_CORPUS).split()  # the tiny tokenizer's own training text


def make_conversations(n: int, max_tokens: int, seed: int) -> list[list[dict[str, str]]]:
    """``n`` conversations, log-normal lengths (median ~120 tokens, clipped to ~30-1,000)."""
    rng = random.Random(seed)
    logs = []
    for i in range(n):
        target = int(min(max(rng.lognormvariate(4.8, 0.9), 20), max_tokens))
        # About 2.5 tokens per word with this tokenizer, plus ~28 tokens of template.
        words = " ".join(rng.choice(WORDS) for _ in range(max(1, int((target - 28) / 2.5))))
        logs.append(
            [
                {"role": "user", "content": f"Question {i}: {words}?"},
                {"role": "assistant", "content": f"<answer>{rng.randint(0, 99)}</answer>"},
            ]
        )
    return logs


def timed_scores(env: RewardModelEnvironment, logs: list) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    rewards = env.step(logs, [None] * len(logs)).rewards
    return time.perf_counter() - start, rewards


def padded_tokens(lengths: list[int], batches: list[list[int]]) -> int:
    return sum(len(b) * max(lengths[i] for i in b) for b in batches)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--conversations", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    folder = Path(tempfile.mkdtemp(prefix="rm_bench_"))
    save_tiny_reward_model(
        folder, hidden_size=args.hidden_size, num_layers=args.layers, max_len=args.max_model_len
    )
    budget = args.batch_size * args.max_model_len
    base = {"model_name": str(folder), "precision": "float32", "batch_size": args.batch_size}
    base["max_model_len"] = args.max_model_len
    envs = {
        "fixed": RewardModelEnvironment(
            {**base, "dynamic_batching": {"enabled": False, "logprob_mb_tokens": budget}}
        ),
        "dynamic": RewardModelEnvironment(
            {**base, "dynamic_batching": {"enabled": True, "logprob_mb_tokens": budget}}
        ),
    }
    logs = make_conversations(args.conversations, args.max_model_len - 30, args.seed)
    lengths = envs["fixed"].preprocess_data(logs)["input_lengths"].tolist()
    plans = {
        "fixed": plan_batches(lengths, args.batch_size),
        "dynamic": plan_batches(lengths, args.batch_size, budget),
    }
    for env in envs.values():  # warm-up
        timed_scores(env, logs[:8])
    best = {name: float("inf") for name in envs}
    scores: dict[str, torch.Tensor] = {}
    for _ in range(args.repeats):
        for name, env in envs.items():
            seconds, scores[name] = timed_scores(env, logs)
            best[name] = min(best[name], seconds)
    diff = (scores["fixed"] - scores["dynamic"]).abs().max().item()
    assert diff < 1e-4, f"dynamic batching changed the scores: max abs diff {diff:.2e}"

    ordered = sorted(lengths)
    print(
        f"{len(logs)} conversations, templated lengths min {ordered[0]}, median "
        f"{ordered[len(ordered) // 2]}, p90 {ordered[int(0.9 * len(ordered))]}, max "
        f"{ordered[-1]} tokens (total {sum(lengths):,}); model hidden {args.hidden_size}, "
        f"{args.layers} layers, "
        f"float32, {torch.get_num_threads()} CPU threads; best of {args.repeats}.\n"
    )
    labels = {
        "fixed": f"fixed order, {args.batch_size} per batch",
        "dynamic": f"length-sorted, <= {args.batch_size} per batch, <= {budget:,} tokens",
    }
    print("| batching | batches | padded tokens | time (s) | conversations/s | speed-up |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in envs:
        print(
            f"| {labels[name]} | {len(plans[name])} | {padded_tokens(lengths, plans[name]):,} "
            f"| {best[name]:.2f} | {len(logs) / best[name]:.1f} "
            f"| {best['fixed'] / best[name]:.2f}x |"
        )
    print(f"\nmax abs score difference, dynamic vs fixed: {diff:.2e}")


if __name__ == "__main__":
    main()
