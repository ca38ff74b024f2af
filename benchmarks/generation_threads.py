"""CPU generation throughput by torch thread count (``HfGenerationConfig.cpu_threads``), side
by side in one run, on an otherwise idle machine and with CPU-bound neighbours.

Workload: the bundled tiny policy, 32 arithmetic prompts decoded together (one micro-batch),
64 new tokens each, greedy; one warm-up call, then ``--calls`` timed calls. Each setting runs
in its own process (the thread count is process-wide), settings alternate ``--rounds`` times,
and the table shows the median tokens/s of each. ``--burners N`` first starts N busy loops
(``python -c "while True: pass"``), as Ray environment actors and verifier processes would
keep the cores busy during a rollout.

    .venv/bin/python benchmarks/generation_threads.py [--burners 0] [--rounds 3] [--calls 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {"1": 1, "torch default": None}


def measure(cpu_threads: int | None, calls: int) -> list[float]:
    """Tokens/s of ``calls`` generate() calls in this process."""
    import torch

    from envloop.demo import resolve_model
    from envloop.distributed.batched_data_dict import BatchedDataDict
    from envloop.models.generation.hf_generation import HfGeneration, HfGenerationConfig

    config = HfGenerationConfig(
        model_name=resolve_model("bundled:policy"),
        max_new_tokens=64,
        micro_batch_size=32,
        cpu_threads=cpu_threads,
    )
    policy = HfGeneration(config)
    prompts = [policy.tokenizer(f"What is {i} + {i + 3}?").input_ids for i in range(32)]
    width = max(len(p) for p in prompts)
    batch = BatchedDataDict(
        input_ids=torch.tensor([p + [policy.pad_id] * (width - len(p)) for p in prompts]),
        input_lengths=torch.tensor([len(p) for p in prompts]),
    )
    policy.generate(batch, greedy=True)  # warm-up
    rates = []
    for _ in range(calls):
        start = time.perf_counter()
        out = policy.generate(batch, greedy=True)
        rates.append(int(out["generation_lengths"].sum()) / (time.perf_counter() - start))
    return rates


def run_setting(name: str, calls: int) -> list[float]:
    """``measure`` for one setting, in a fresh process."""
    command = [sys.executable, __file__, "--child", name, "--calls", str(calls)]
    out = subprocess.run(command, capture_output=True, text=True, check=True, cwd=ROOT)
    return [float(x) for x in out.stdout.split()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--burners", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--child", choices=list(SETTINGS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(" ".join(f"{r:.1f}" for r in measure(SETTINGS[args.child], args.calls)))
        return
    burners = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.burners)
    ]
    try:
        load_before = os.getloadavg()[0]
        rates: dict[str, list[float]] = {name: [] for name in SETTINGS}
        for _ in range(args.rounds):
            for name in SETTINGS:
                rates[name] += run_setting(name, args.calls)
        load_after = os.getloadavg()[0]
    finally:
        for burner in burners:
            burner.kill()
    print(
        f"\nGeneration tokens/s by cpu_threads ({os.cpu_count()} cores, {args.burners} burners, "
        f"load average {load_before:.1f} -> {load_after:.1f}; median of "
        f"{args.rounds} x {args.calls} calls; higher is better)\n"
    )
    print("| cpu_threads | median | min | max |")
    print("|---|---:|---:|---:|")
    for name, values in rates.items():
        median, low, high = statistics.median(values), min(values), max(values)
        print(f"| {name} | {median:.0f} | {low:.0f} | {high:.0f} |")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
