"""The rollout loop's own overhead per sample-turn, against a straightforward loop of the
same design, side by side in one run.

Workload: 1,024 samples x 4 turns, a policy that costs (almost) nothing (it appends a fixed
response to every prompt), and one Ray-actor environment that answers every turn and ends
the episode after 4. Overhead = rollout wall time minus the policy's own generate() time.

    .venv/bin/python benchmarks/rollout_overhead.py [--samples 1024] [--turns 4] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

from _workloads import PHASES, CountdownEnv, FixedResponsePolicy, make_batch, start_ray

from envloop.data.llm_message_utils import batched_message_log_to_flat_message
from envloop.distributed.batched_data_dict import BatchedDataDict
from envloop.environments.interfaces import actor_class
from envloop.experience.rollouts import run_multi_turn_rollout
from tests.fixtures.tiny_models import build_tiny_tokenizer


def straightforward_rollout(policy, batch, tokenizer, env, max_seq_len, max_turns):
    """The same semantics written the obvious way: re-flatten every log every turn, one
    decode and one tokenize call per sample, one tensor per step per sample."""
    timings = dict.fromkeys(PHASES, 0.0)
    logs = [list(log) for log in batch["message_log"]]
    metadata = list(batch["extra_env_info"])
    stops = list(batch["stop_strings"])
    total = torch.zeros(len(logs))
    done = [False] * len(logs)
    for _ in range(max_turns):
        active = [i for i, d in enumerate(done) if not d]
        if not active:
            break
        t = time.perf_counter()
        flat, lengths = batched_message_log_to_flat_message(
            [logs[i] for i in active], {"token_ids": tokenizer.pad_token_id}
        )
        gen_input = BatchedDataDict(
            input_ids=flat["token_ids"], input_lengths=lengths.long(),
            stop_strings=[stops[i] for i in active],
        )  # fmt: skip
        timings["flatten"] += time.perf_counter() - t
        out = policy.generate(gen_input)
        t = time.perf_counter()
        for j, i in enumerate(active):
            start, n = int(lengths[j]), int(out["generation_lengths"][j])
            ids = out["output_ids"][j, start : start + n]
            text = tokenizer.decode(ids, skip_special_tokens=True)
            logs[i].append(
                {
                    "role": "assistant",
                    "content": text,
                    "token_ids": ids.clone(),
                    "generation_logprobs": out["logprobs"][j, start : start + n].clone(),
                }
            )
        timings["gen_bookkeeping"] += time.perf_counter() - t
        t = time.perf_counter()
        import ray

        env_logs = [[{"role": m["role"], "content": m["content"]} for m in logs[i]] for i in active]
        ret = ray.get(env.step.remote(env_logs, [metadata[i] for i in active]))
        timings["env_step"] += time.perf_counter() - t
        t = time.perf_counter()
        for j, i in enumerate(active):
            total[i] += ret.rewards[j]
            metadata[i] = ret.metadata[j]
            stops[i] = ret.next_stop_strings[j]
            done[i] = bool(ret.terminateds[j])
        timings["rewards_and_status"] += time.perf_counter() - t
        t = time.perf_counter()
        for j, i in enumerate(active):
            obs = ret.observations[j]
            ids = torch.tensor(tokenizer(obs["content"], add_special_tokens=False)["input_ids"])
            length = sum(len(m["token_ids"]) for m in logs[i])
            if length + len(ids) >= max_seq_len:
                ids, done[i] = ids[: max_seq_len - length], True
            logs[i].append({"role": obs["role"], "content": obs["content"], "token_ids": ids})
        timings["obs_tokenization"] += time.perf_counter() - t
    return logs, total, timings


def measure(args, tokenizer, env):
    rows = {}
    sample_turns = args.samples * args.turns
    for name in ("envloop", "straightforward"):
        best = None
        for _ in range(args.repeats):
            policy = FixedResponsePolicy(tokenizer)
            batch = make_batch(tokenizer, args.samples)
            start = time.perf_counter()
            if name == "envloop":
                _, metrics = run_multi_turn_rollout(
                    policy, batch, tokenizer, {"countdown": env}, args.max_seq_len
                )
                phases = {p: metrics[f"timing/{p}_s"] for p in PHASES}
                assert metrics["total_turns"] == sample_turns, metrics["total_turns"]
            else:
                _, total, phases = straightforward_rollout(
                    policy, batch, tokenizer, env, args.max_seq_len, args.turns + 1
                )
                assert float(total.sum()) == sample_turns * 0.25
            overhead = time.perf_counter() - start - policy.seconds
            us = {p: 1e6 * s / sample_turns for p, s in phases.items()}
            us["total overhead"] = 1e6 * overhead / sample_turns
            if best is None or us["total overhead"] < best["total overhead"]:
                best = us
        rows[name] = best
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-seq-len", type=int, default=512)
    args = parser.parse_args()
    import ray

    start_ray()
    tokenizer = build_tiny_tokenizer()
    env = actor_class(CountdownEnv, num_cpus=0).remote(args.turns)
    ray.get(env.__ray_ready__.remote())
    rows = measure(args, tokenizer, env)
    print(
        f"\nRollout loop overhead, µs per sample-turn ({args.samples} samples x {args.turns} "
        f"turns, Ray-actor env, best of {args.repeats}; lower is better)\n"
    )
    print("| phase | envloop | straightforward loop | speed-up |")
    print("|---|---:|---:|---:|")
    for phase in [*PHASES, "total overhead"]:
        ours, theirs = rows["envloop"][phase], rows["straightforward"][phase]
        print(f"| {phase} | {ours:.1f} | {theirs:.1f} | {theirs / max(ours, 1e-9):.1f}x |")
    ray.shutdown()


if __name__ == "__main__":
    main()
