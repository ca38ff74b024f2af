"""Environment actors on a real three-node Ray cluster (head, node_a, node_b on this machine):
where each lands, and a rollout that loses a worker node mid-step.

Each test drives the cluster from a driver process of its own (``init_ray(address=...)``
through ``RAY_ADDRESS``), so the suite's local Ray session is untouched.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.fixtures.ray_cluster import (
    RayCluster,
    driver_output,
    driver_result,
    ray_cluster,
    start_driver,
)

pytestmark = [pytest.mark.ray, pytest.mark.slow]
__all__ = ["ray_cluster"]

_SETUP = """
import json
import ray
from envloop.distributed.ray_utils import init_ray
from envloop.environments.registry import create_env, register_env
from tests.fixtures.node_envs import node_resource

init_ray(log_to_driver=False)
register_env("node_echo", "tests.fixtures.node_envs:NodeEchoEnv", overwrite=True)
"""

_PLACEMENTS = (
    _SETUP
    + """
spread = [create_env("node_echo", placement="spread", num_cpus=0) for _ in range(3)]
pinned = [create_env("node_echo", placement="resource:node_b", num_cpus=0) for _ in range(2)]
print("RESULT " + json.dumps({
    "driver": node_resource(),
    "spread": sorted(ray.get([a.node.remote() for a in spread])),
    "pinned": ray.get([a.node.remote() for a in pinned]),
}))
"""
)

_ROLLOUT = (
    _SETUP
    + """
from envloop.experience.rollouts import run_multi_turn_rollout
from envloop.models.generation.scripted_generation import ScriptedGeneration
from tests.fixtures.batches import make_batch
from tests.fixtures.tiny_models import build_tiny_tokenizer

hold_dir = {hold_dir!r}
tasks = ["t0", "t1", "t2"]
envs = {{t: create_env("node_echo", hold_dir, placement="spread", num_cpus=0) for t in tasks}}
placed = {{t: ray.get(a.node.remote()) for t, a in envs.items()}}
with open(hold_dir + "/placed.json", "w") as f:
    json.dump({{"driver": node_resource(), "placed": placed}}, f)
tokenizer = build_tiny_tokenizer()
samples = [{{"task": t, "prompt": f"sample {{i}} of {{t}}"}} for t in tasks for i in range(2)]
policy = ScriptedGeneration(tokenizer, lambda prompt: "done")
final, metrics = run_multi_turn_rollout(
    policy, make_batch(tokenizer, samples), tokenizer, envs, 256
)
rows = [
    {{"prompt": log[0]["content"], "reply": log[-1]["content"], "reward": float(r)}}
    for log, r in zip(final["message_log"], final["total_reward"])
]
print("RESULT " + json.dumps({{"rows": rows, "metrics": metrics}}))
"""
)


def test_env_actors_spread_over_nodes_or_pinned_to_one(ray_cluster: RayCluster):
    out = driver_output(start_driver(ray_cluster, _PLACEMENTS))
    landed = driver_result(out)
    # each asked of the next node in turn; Ray may still place one elsewhere (best effort)
    assert len(set(landed["spread"])) >= 2
    assert landed["pinned"] == ["node_b", "node_b"]


def test_a_worker_node_killed_mid_step_loses_no_sample(ray_cluster: RayCluster, tmp_path: Path):
    driver = start_driver(ray_cluster, _ROLLOUT.format(hold_dir=str(tmp_path)))
    try:
        _wait_for(driver, tmp_path, ["placed.json"])
        placement = json.loads((tmp_path / "placed.json").read_text())
        placed = placement["placed"]
        assert placement["driver"] == "node_head"
        lost = next(node for node in ("node_b", "node_a") if node in placed.values())
        _wait_for(driver, tmp_path, [f"started-{node}" for node in placed.values()])
        ray_cluster.nodes[lost].kill()  # its step is running: mid-rollout
        (tmp_path / "release").touch()
        out = driver_output(driver)
    finally:
        if driver.poll() is None:
            driver.kill()
    result = driver_result(out)
    lost_tasks = [task for task, node in placed.items() if node == lost]
    alive = {f"stepped on {node}" for node in ray_cluster.nodes if node != lost}
    assert [row["prompt"] for row in result["rows"]] == [
        f"sample {i} of t{t}" for t in range(3) for i in range(2)
    ]  # every sample once, in input order
    for row in result["rows"]:
        task = row["prompt"].rsplit(" ", 1)[1]
        if task in lost_tasks:  # stepped again, by the actor restarted on a surviving node
            assert row["reply"] in alive
        else:
            assert row["reply"] == f"stepped on {placed[task]}"
        assert row["reward"] == 1.0
    assert result["metrics"]["env_error_rate"] == 0.0
    assert result["metrics"]["total_env_step_retries"] == len(lost_tasks)  # one call each


def _wait_for(driver, folder: Path, names: list[str], timeout_s: float = 240.0) -> None:
    """Wait until ``names`` exist in ``folder``; raises with the driver's output if it ends
    first, or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not all((folder / n).exists() for n in names):
        if driver.poll() is not None:
            driver_output(driver)  # raises with its output when it failed
            raise AssertionError(f"the driver ended before {names} appeared in {folder}")
        if time.monotonic() > deadline:
            missing = [n for n in names if not (folder / n).exists()]
            raise AssertionError(f"{missing} did not appear in {folder} within {timeout_s} s")
        time.sleep(0.2)
