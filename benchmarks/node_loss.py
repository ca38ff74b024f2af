"""What losing a Ray worker node mid-rollout costs (issue 27): the time from the kill to the
rollout's end, against the same rollout with no node lost.

Each repetition starts a three-node Ray cluster on this machine (``tests/fixtures/ray_cluster.py``:
a head and ``node_a``, ``node_b``, 1 CPU each) and a driver process that places one
environment actor per node (``placement: spread``) and rolls out two samples per actor
(``NodeEchoEnv``: every step waits for a release file, so every node is mid-step). Once all
three steps have started, either ``node_b`` is killed by process id (its raylet and workers)
and the steps are released, or the steps are released with no node lost. Reported: seconds
from that moment to the rollout's result (the driver's clock, read when it prints the
result), the steps sent again (``total_env_step_retries``), and whether every sample came
back once with its reward. Ray marks a node dead after its health checks fail (about 15 s
by default); that wait is most of the recovery.

    .venv/bin/python benchmarks/node_loss.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _workloads import load_avg

from tests.fixtures.ray_cluster import (
    driver_output,
    driver_result,
    start_cluster,
    start_driver,
    wait_for_files,
)

DRIVER = """
import json, time
import ray
from envloop.distributed.ray_utils import init_ray
from envloop.environments.registry import create_env, register_env
from envloop.experience.rollouts import run_multi_turn_rollout
from envloop.models.generation.scripted_generation import ScriptedGeneration
from tests.fixtures.batches import make_batch
from tests.fixtures.tiny_models import build_tiny_tokenizer

init_ray(log_to_driver=False)
register_env("node_echo", "tests.fixtures.node_envs:NodeEchoEnv", overwrite=True)
deadline = time.monotonic() + 60
while not {{"node_head", "node_a", "node_b"}} <= set(ray.available_resources()):
    if time.monotonic() > deadline:
        break
    time.sleep(0.5)
hold_dir = {hold_dir!r}
tasks = ["t0", "t1", "t2"]
envs = {{t: create_env("node_echo", hold_dir, placement="spread", num_cpus=0) for t in tasks}}
placed = {{t: ray.get(a.node.remote()) for t, a in envs.items()}}
tokenizer = build_tiny_tokenizer()
samples = [{{"task": t, "prompt": f"sample {{i}} of {{t}}"}} for t in tasks for i in range(2)]
policy = ScriptedGeneration(tokenizer, lambda prompt: "done")
final, metrics = run_multi_turn_rollout(
    policy, make_batch(tokenizer, samples), tokenizer, envs, 256
)
done = time.time()
prompts = [log[0]["content"] for log in final["message_log"]]
print("RESULT " + json.dumps({{
    "done": done, "placed": placed, "prompts": prompts,
    "rewards": [float(r) for r in final["total_reward"]],
    "retries": metrics["total_env_step_retries"],
}}))
"""
LOST = "node_b"


def one_run(lose_node: bool) -> tuple[float, int, bool]:
    """One rollout on a fresh cluster; returns (seconds from the kill or release to the
    result, steps sent again, every sample back once with reward 1)."""
    cluster = start_cluster()
    try:
        with tempfile.TemporaryDirectory(prefix="node-loss-") as hold_dir:
            driver = start_driver(cluster, DRIVER.format(hold_dir=hold_dir))
            try:
                names = [f"started-{node}" for node in ("node_head", "node_a", "node_b")]
                wait_for_files(driver, Path(hold_dir), names)
                start = time.time()
                if lose_node:
                    cluster.nodes[LOST].kill()
                Path(hold_dir, "release").touch()
                result = driver_result(driver_output(driver))
            finally:
                if driver.poll() is None:
                    driver.kill()
                    driver.wait()
    finally:
        cluster.stop()
    expected = [f"sample {i} of t{t}" for t in range(3) for i in range(2)]
    complete = result["prompts"] == expected and result["rewards"] == [1.0] * 6
    return result["done"] - start, result["retries"], complete


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"`.venv/bin/python benchmarks/node_loss.py --repeats {args.repeats}` "
          f"({os.cpu_count()} cores; load average before: {load_avg()})\n", flush=True)  # fmt: skip
    runs: dict[bool, list[tuple[float, int, bool]]] = {False: [], True: []}
    for _ in range(args.repeats):  # alternating
        for lose_node in (False, True):
            runs[lose_node].append(one_run(lose_node))
            print(f"  {'node lost' if lose_node else 'no loss'}: {runs[lose_node][-1]}",
                  file=sys.stderr, flush=True)  # fmt: skip
    lines = [
        "| run | seconds to the result, median (min-max) | steps sent again | every sample once, reward 1 |",  # noqa: E501
        "|---|---|---|---|",
    ]
    for lose_node, name in ((False, "no node lost"), (True, f"`{LOST}` killed mid-step")):
        seconds = [s for s, _, _ in runs[lose_node]]
        retries = sorted({r for _, r, _ in runs[lose_node]})
        complete = sum(c for _, _, c in runs[lose_node])
        lines.append(
            f"| {name} | {statistics.median(seconds):.1f} ({min(seconds):.1f}-{max(seconds):.1f}) "
            f"| {', '.join(map(str, retries))} | {complete} of {len(seconds)} |"
        )
    print("\n".join(lines) + f"\n\n(load average after: {load_avg()})")


if __name__ == "__main__":
    main()
