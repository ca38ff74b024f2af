"""Asynchronous RL against a synchronous loop, side by side in one run.

A simulated RL job: ``steps`` training steps, each on ``prompts_per_step`` prompts x
``group_size`` generations of the long-tail multi-turn workload of ``async_rollouts.py``
(1 to ``turns`` turns per sample, heavy-tailed response lengths and sandbox latencies, a
batched decoder with continuous batching, a Ray-actor sandbox). Training a step takes a
fixed time (``--train-ratio`` x the sync loop's mean generation time per step, measured in
the same run), spent off the generator's thread as a trainer on its own device would; every
step ends with ``update_weights``.

- ``sync``: per step, ``run_multi_turn_rollout`` on the step's prompts, train, update.
- ``async``: one ``ExperienceStream`` (``max_staleness=1``, two steps' samples in flight,
  one step's groups buffered) over all the prompts; the consumer trains on every
  ``prompts_per_step`` groups and then updates, while the stream keeps generating.

    .venv/bin/python benchmarks/async_rl.py [--quick] [--repeats N]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _workloads import load_avg, start_ray
from async_rollouts import (
    LongTailWorkload,
    SandboxEnv,
    SimulatedPolicy,
    envloop_version,
    long_tail_batch,
    spread,
)

from envloop.environments.interfaces import actor_class
from envloop.experience.rollouts import ExperienceStream, run_multi_turn_rollout
from envloop.models.generation.policy_versions import next_policy_version
from tests.fixtures.tiny_models import build_tiny_tokenizer


class VersionedPolicy(SimulatedPolicy):
    """The simulated decoder with weight updates: an update moves the version (it costs
    nothing here) and every row's tokens carry the version its request was submitted
    under (an in-flight update would only make tokens newer)."""

    def __init__(self, workload: LongTailWorkload, tokenizer: Any) -> None:
        super().__init__(workload, tokenizer)
        self._policy_version = 0

    def update_weights(self, weights: Any, *, version: int | None = None) -> int:
        self._policy_version = next_policy_version(self._policy_version, version)
        return self._policy_version

    def generate(self, data, greedy=False):
        version = self._policy_version
        return _with_versions(super().generate(data, greedy), version)

    async def generate_async(self, data, greedy=False):
        version = self._policy_version
        async for j, output in super().generate_async(data, greedy):
            yield j, _with_versions(output, version)


def _with_versions(output: Any, version: int) -> Any:
    generated = output["logprobs"] != 0
    output["policy_versions"] = generated.to(torch.int32) * version
    return output


def sync_run(args, workload, tokenizer, env, train_s: float) -> dict:
    """Generate a step's batch, train, update; repeat."""
    policy = VersionedPolicy(workload, tokenizer)
    batch = long_tail_batch(tokenizer, args.steps * args.prompts_per_step)
    max_seq_len = _max_seq_len(workload, batch)
    start, generation = time.perf_counter(), []
    for step in range(args.steps):
        rows = list(range(step * args.prompts_per_step, (step + 1) * args.prompts_per_step))
        step_batch = batch.select_indices(rows).repeat_interleave(args.group_size)
        began = time.perf_counter()
        run_multi_turn_rollout(policy, step_batch, tokenizer, {"sandbox": env}, max_seq_len)
        generation.append(time.perf_counter() - began)
        time.sleep(train_s)  # the trainer's device; the generator waits for its weights
        policy.update_weights(None)
    wall = time.perf_counter() - start
    policy.shutdown()
    return {"wall": wall, "generation per step": statistics.mean(generation), "staleness": 0.0}


def async_run(args, workload, tokenizer, env, train_s: float) -> dict:
    """One ExperienceStream; the consumer trains on each step's groups, then updates."""
    policy = VersionedPolicy(workload, tokenizer)
    batch = long_tail_batch(tokenizer, args.steps * args.prompts_per_step)
    rows = [{key: batch[key][i] for key in batch} for i in range(batch.size)]
    max_seq_len = _max_seq_len(workload, batch)

    async def consume() -> dict:
        stream = ExperienceStream(
            policy, rows, tokenizer, {"sandbox": env}, max_seq_len,
            group_size=args.group_size, max_staleness=1,
            max_concurrent_samples=2 * args.prompts_per_step * args.group_size,
            max_buffered_groups=args.prompts_per_step,
        )  # fmt: skip
        waiting = []
        async for group in stream:
            waiting.append(group)
            if len(waiting) == args.prompts_per_step:
                waiting.clear()
                await asyncio.sleep(train_s)  # the trainer's device, beside the generator
                policy.update_weights(None)
        return stream.metrics()

    start = time.perf_counter()
    metrics = asyncio.run(consume())
    wall = time.perf_counter() - start
    policy.shutdown()
    return {
        "wall": wall,
        "staleness": metrics["mean_staleness"],
        "regenerated groups": metrics["regenerations"],
        "generation wait s": metrics["generation_wait_s"],
    }


def _max_seq_len(workload: LongTailWorkload, batch: Any) -> int:
    prompt = max(sum(len(m["token_ids"]) for m in log) for log in batch["message_log"])
    return workload.max_seq_len(prompt)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small sanity run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8, help="training steps")
    parser.add_argument("--prompts-per-step", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--turns", type=int, default=6, help="most turns per sample")
    parser.add_argument("--step-ms", type=float, default=2.0, help="ms per decode step")
    parser.add_argument("--cap", type=int, default=128, help="most rows per decode step")
    parser.add_argument(
        "--train-ratio", type=float, default=1.0,
        help="training time per step / the sync loop's generation time per step",
    )  # fmt: skip
    args = parser.parse_args()
    if args.quick:
        args.steps, args.prompts_per_step, args.repeats = 3, 4, 1
    return args


def main() -> None:
    args = parse_args()
    start_ray()
    import ray

    tokenizer = build_tiny_tokenizer()
    prompts = args.steps * args.prompts_per_step
    workload = LongTailWorkload.draw(prompts, args.turns, args.step_ms / 1e3, args.cap)
    env = actor_class(SandboxEnv, num_cpus=0, max_concurrency=4096).remote(
        workload.latencies, workload.turns
    )
    ray.get(env.__ray_ready__.remote())
    load_before = load_avg()
    calibration = sync_run(args, workload, tokenizer, env, train_s=0.0)
    train_s = args.train_ratio * calibration["generation per step"]
    runs: dict[str, list[dict]] = {"sync": [], "async": []}
    for _ in range(args.repeats):
        runs["sync"].append(sync_run(args, workload, tokenizer, env, train_s))
        runs["async"].append(async_run(args, workload, tokenizer, env, train_s))
    ray.kill(env)
    sync_wall = statistics.median(r["wall"] for r in runs["sync"])
    async_wall = statistics.median(r["wall"] for r in runs["async"])
    command = "benchmarks/async_rl.py " + " ".join(sys.argv[1:])
    print(
        f"\n`.venv/bin/python {command.strip()}` ({envloop_version()}; load before "
        f"{load_before}, after {load_avg()})\n\n"
        f"{args.steps} steps x {args.prompts_per_step} prompts x {args.group_size} generations, "
        f"1-{args.turns} turns per sample; decode step {args.step_ms} ms for up to {args.cap} "
        f"rows; training {train_s:.2f} s per step ({args.train_ratio}x the sync loop's "
        f"generation time per step); median (min-max) of {args.repeats}\n\n"
        "| | sync loop | ExperienceStream, max_staleness=1 |\n|---|---:|---:|\n"
        f"| wall s | {spread([r['wall'] for r in runs['sync']])} "
        f"| {spread([r['wall'] for r in runs['async']])} |\n"
        f"| speed-up | 1.00x | {sync_wall / async_wall:.2f}x |\n"
        f"| mean staleness of a group (versions) | 0 "
        f"| {statistics.median(r['staleness'] for r in runs['async']):.2f} |\n"
        f"| regenerated groups | 0 "
        f"| {statistics.median(r['regenerated groups'] for r in runs['async']):.0f} |\n"
        f"| generation held by backpressure, s | - "
        f"| {statistics.median(r['generation wait s'] for r in runs['async']):.2f} |\n"
    )


if __name__ == "__main__":
    main()
