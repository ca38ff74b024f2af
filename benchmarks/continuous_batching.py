"""Continuous batching against static micro-batches on responses of mixed length, and the
host time of stop-string detection per decode step, side by side in one run.

Generation: HfGeneration on a Qwen3-architecture model built from a config (random weights,
greedy; the tied head repeats the last token, so no row ends early and every row generates
exactly its budget). Budgets are heavy-tailed: most rows want 16-64 tokens, one in ten
256-384. *Static* is the previous behaviour: the batch is cut into micro-batches, each
decoded until its longest row ends (finished rows leave the batch, but nothing takes their
place). *Continuous* submits the whole batch to the same decode loop, which admits a
waiting row whenever one finishes, up to the same micro-batch size.

Stop strings: host time per decode step to decide which of 256 rows hit a stop string,
for the previous detection (every row re-decodes its last 44 tokens, one ``batch_decode``)
and for ``StopWatcher`` (each new token looked at once).

    .venv/bin/python benchmarks/continuous_batching.py [--requests 256] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from transformers import Qwen3Config, Qwen3ForCausalLM

from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.models.generation.hf_generation import HfGeneration
from envloop.models.generation.stop_strings import StopWatcher, TokenBytes
from envloop.models.tiny import TRAINING_CORPUS, build_tiny_tokenizer


def save_model(folder: Path, hidden: int, layers: int) -> None:
    tokenizer = build_tiny_tokenizer()
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=4 * hidden,
        num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
        head_dim=hidden // 8, max_position_embeddings=1024, tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def budgets(count: int, seed: int = 0) -> list[int]:
    """Heavy-tailed response lengths: 90% in [16, 64], 10% in [256, 384]."""
    rng = random.Random(seed)
    return [
        rng.randint(256, 384) if rng.random() < 0.1 else rng.randint(16, 64) for _ in range(count)
    ]


def make_batch(tokenizer, count: int, lengths: list[int]) -> BatchedDataDict:
    prompts = [
        tokenizer(TRAINING_CORPUS[i % len(TRAINING_CORPUS)]).input_ids[:24] for i in range(count)
    ]
    width = max(len(p) for p in prompts)
    return BatchedDataDict(
        input_ids=torch.tensor([p + [tokenizer.pad_token_id] * (width - len(p)) for p in prompts]),
        input_lengths=torch.tensor([len(p) for p in prompts]),
        max_new_tokens=torch.tensor(lengths),
    )


def run_static(policy: HfGeneration, batch: BatchedDataDict, micro: int) -> int:
    tokens = 0
    for start in range(0, batch.size, micro):
        out = policy.generate(batch.slice(start, start + micro), greedy=True)
        tokens += int(out["generation_lengths"].sum())
    return tokens


def run_continuous(policy: HfGeneration, batch: BatchedDataDict, micro: int) -> int:
    return int(policy.generate(batch, greedy=True)["generation_lengths"].sum())


def generation_section(args: argparse.Namespace) -> list[str]:
    lengths = budgets(args.requests)
    with tempfile.TemporaryDirectory() as folder:
        save_model(Path(folder), args.hidden, args.layers)
        policy = HfGeneration(
            {"model_name": folder, "max_new_tokens": 512, "micro_batch_size": args.micro_batch}
        )
        batch = make_batch(policy.tokenizer, args.requests, lengths)
        run_continuous(policy, batch.slice(0, 8), args.micro_batch)  # warm-up
        results: dict[str, list[tuple[float, int, int]]] = {"static": [], "continuous": []}
        for _ in range(args.repeats):
            for name, run in (("static", run_static), ("continuous", run_continuous)):
                steps_before = policy.decode_stats()[0]["decode_steps"]
                start = time.perf_counter()
                tokens = run(policy, batch, args.micro_batch)
                elapsed = time.perf_counter() - start
                steps = policy.decode_stats()[0]["decode_steps"] - steps_before
                results[name].append((elapsed, tokens, steps))
    lines = [
        f"Generation: {args.requests} requests, budgets 90% in [16, 64] and 10% in [256, 384] "
        f"({sum(lengths)} tokens), micro-batch {args.micro_batch}, Qwen3 architecture "
        f"hidden {args.hidden} x {args.layers} layers, float32 CPU, greedy; median (min-max) "
        f"of {args.repeats}, the two interleaved.",
        "",
        "| batching | wall s | decode steps | tokens/s | rows per step |",
        "|---|---|---|---|---|",
    ]
    for name, runs in results.items():
        walls = [r[0] for r in runs]
        tokens, steps = runs[0][1], runs[0][2]
        rates = [tokens / w for w in walls]
        lines.append(
            f"| {name} | {spread(walls, '.2f')} | {steps} | {spread(rates, ',.0f')} "
            f"| {tokens / steps:.1f} |"
        )
    speedups = [s[0] / c[0] for s, c in zip(results["static"], results["continuous"])]
    lines += ["", f"Continuous / static tokens/s, per repetition: {spread(speedups, '.2f')}x"]
    return lines


def spread(values: list[float], fmt: str) -> str:
    """``median (min-max)`` of ``values``, each formatted with ``fmt``."""
    low, mid, high = min(values), statistics.median(values), max(values)
    return f"{mid:{fmt}} ({low:{fmt}}-{high:{fmt}})"


def previous_stop_check(
    tokenizer, generated: list[list[int]], stops: list[list[str]]
) -> list[bool]:
    """The detection this project used before: decode each row's last 44 tokens."""
    window = 4 * max(len(s) for s in stops[0]) + 8
    texts = tokenizer.batch_decode(
        [ids[-window:] for ids in generated],
        skip_special_tokens=False,
        clean_up_tokenization_spaces=False,
    )
    return [any(s in text for s in row_stops) for text, row_stops in zip(texts, stops)]


def stop_section(args: argparse.Namespace) -> list[str]:
    tokenizer = build_tiny_tokenizer()
    rng = random.Random(0)
    rows, steps = 256, 200
    stops = [["</action>"]] * rows
    streams = [[rng.randrange(3, len(tokenizer)) for _ in range(steps)] for _ in range(rows)]
    timings: dict[str, list[float]] = {"re-decode last 44 tokens": [], "StopWatcher": []}
    for _ in range(args.repeats):
        start = time.perf_counter()
        for t in range(1, steps + 1):
            previous_stop_check(tokenizer, [s[:t] for s in streams], stops)
        timings["re-decode last 44 tokens"].append((time.perf_counter() - start) / steps)
        table = TokenBytes(tokenizer)
        watchers = [StopWatcher(s, table, tokenizer) for s in stops]
        start = time.perf_counter()
        for t in range(steps):
            [w.add(stream[t]) for w, stream in zip(watchers, streams)]
        timings["StopWatcher"].append((time.perf_counter() - start) / steps)
    old, new = ([1e3 * t for t in v] for v in timings.values())
    ratios = [o / n for o, n in zip(old, new)]
    return [
        f"Stop strings: host time per decode step for {rows} rows with stop string "
        f"`</action>` ({steps} steps, median (min-max) of {args.repeats}; the slicing of token "
        "lists for the previous method is included, as the decode loop had to build them too).",
        "",
        "| detection | ms per step |",
        "|---|---|",
        f"| re-decode last 44 tokens (before) | {spread(old, '.2f')} |",
        f"| StopWatcher (now) | {spread(new, '.3f')} |",
        "",
        f"StopWatcher is {spread(ratios, '.0f')}x cheaper, per repetition.",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    command = " ".join(["benchmarks/continuous_batching.py", *sys.argv[1:]])
    print(f"`.venv/bin/python {command}` (load average before: {os.getloadavg()[0]:.2f})\n")
    for line in [*generation_section(args), "", *stop_section(args)]:
        print(line)
    print(f"\n(load average after: {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()
