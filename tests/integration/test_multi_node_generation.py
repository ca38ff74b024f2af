"""``HfGeneration`` worker actors on a real three-node Ray cluster (head, node_a, node_b on
this machine): where each lands (``worker_placement: spread`` and ``resource:<name>``), and
a rollout that loses the node of one of them in the middle of its generation.

The test drives the cluster from a driver process of its own (``init_ray(address=...)``
through ``RAY_ADDRESS``), so the suite's local Ray session is untouched.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.fixtures.ray_cluster import (
    RayCluster,
    driver_output,
    driver_result,
    ray_cluster,
    start_driver,
    wait_for_files,
)

pytestmark = [pytest.mark.ray, pytest.mark.slow]
__all__ = ["ray_cluster"]

_ROLLOUT = """
import json
import os
import time
from pathlib import Path

import ray
import torch
from transformers import AutoModelForCausalLM

from envloop.distributed.ray_utils import init_ray
from envloop.experience.rollouts import run_multi_turn_rollout
from envloop.models.generation.hf_generation import HfGeneration
from tests.fixtures.batches import make_batch
from tests.fixtures.envs import EchoEnv
from tests.fixtures.generation import PROMPTS

hold_dir, model_dir = {hold_dir!r}, {model_dir!r}
init_ray(log_to_driver=False)
names = {{
    node["NodeID"]: next(k for k in node["Resources"] if k.startswith("node_"))
    for node in ray.nodes() if node["Alive"]
}}


def hold(worker):
    # Run in a worker actor: after each decode step, until hold_dir/release exists, write
    # hold_dir/started-<node> and wait (its rows mid-generation).
    def on_step(tokens):
        from tests.fixtures.node_envs import node_resource

        release, deadline = Path(hold_dir, "release"), time.monotonic() + 180
        if not release.exists():
            Path(hold_dir, "started-" + node_resource()).touch()
        while not release.exists() and time.monotonic() < deadline:
            time.sleep(0.2)

    worker.on_decode_step = on_step


gen = HfGeneration({{
    "model_name": model_dir, "num_workers": 2, "worker_placement": "spread",
    "max_new_tokens": 12, "micro_batch_size": 4, "cpu_threads": 1,
}})
placed = [names[node] for node in gen.worker_nodes()]
pinned = HfGeneration({{
    "model_name": model_dir, "num_workers": 2, "worker_placement": "resource:node_head",
    "worker_num_cpus": 0, "cpu_threads": 1,
}})
pinned_to = [names[node] for node in pinned.worker_nodes()]
pinned.shutdown()
model = AutoModelForCausalLM.from_pretrained(model_dir)
generator = torch.Generator().manual_seed(2)
with torch.no_grad():
    for tensor in model.parameters():
        tensor.add_(torch.randn(tensor.shape, generator=generator) * 0.05)
version = gen.update_weights(model.state_dict())
samples = [{{"task": "echo", "prompt": prompt}} for prompt in PROMPTS[:4]]


def rollout():
    batch = make_batch(gen.tokenizer, samples)
    final, metrics = run_multi_turn_rollout(
        gen, batch, gen.tokenizer, {{"echo": EchoEnv()}}, 256, max_rollout_turns=1, greedy=True
    )
    rows = []
    for log in final["message_log"]:
        reply = next(m for m in log if m["role"] == "assistant")
        rows.append({{
            "tokens": reply["token_ids"].tolist(),
            "versions": reply["generation_policy_versions"].tolist(),
        }})
    return rows, metrics


undisturbed, _ = rollout()
ray.get([w.__ray_call__.remote(hold) for w in gen.engine.workers])
Path(hold_dir, "placed.json").write_text(json.dumps(placed))
rows, metrics = rollout()
served = ray.get([w.__ray_call__.remote(lambda e: e.policy_version) for w in gen.engine.workers])
print("RESULT " + json.dumps({{
    "version": version, "placed": placed, "pinned": pinned_to, "undisturbed": undisturbed,
    "rows": rows, "metrics": metrics, "after": [names.get(node) for node in gen.worker_nodes()],
    "served": served, "retries": gen.generation_retries,
}}))
gen.shutdown()
"""


def test_a_node_lost_mid_generation_regenerates_its_workers_rows(
    ray_cluster: RayCluster, untied_policy_dir: Path, tmp_path: Path
):
    script = _ROLLOUT.format(hold_dir=str(tmp_path), model_dir=str(untied_policy_dir))
    driver = start_driver(ray_cluster, script)
    try:
        wait_for_files(driver, tmp_path, ["placed.json"])
        placed = json.loads((tmp_path / "placed.json").read_text())
        lost = next(node for node in ("node_b", "node_a") if node in placed)
        wait_for_files(driver, tmp_path, [f"started-{node}" for node in placed])
        ray_cluster.nodes[lost].kill()  # its worker holds rows mid-generation
        (tmp_path / "release").touch()
        out = driver_output(driver, timeout_s=600)
    finally:
        if driver.poll() is None:
            driver.kill()
    result = driver_result(out)
    rank = placed.index(lost)
    # Spread, one CPU per worker and per node: the workers on two nodes, the replacement of
    # the lost one on the third, serving the weights of the update (version 1).
    assert len(set(placed)) == 2
    assert result["pinned"] == ["node_head", "node_head"]  # resource:node_head
    assert result["after"][1 - rank] == placed[1 - rank]
    assert result["after"][rank] not in (lost, placed[1 - rank])
    assert result["served"] == [1, 1] and result["version"] == 1
    # Every sample once, in input order, each equal to the undisturbed greedy run's (the
    # lost worker's shard of rows 2 * rank and 2 * rank + 1, too), all of version 1.
    assert result["rows"] == result["undisturbed"]
    assert all(row["versions"] == [1] * len(row["tokens"]) for row in result["rows"])
    assert all(len(row["tokens"]) > 1 for row in result["rows"])
    assert result["metrics"]["generation_error_rate"] == 0.0
    assert result["metrics"]["total_generation_retries"] == 2 == result["retries"]
