"""Environment actors on a real three-node Ray cluster (head, node_a, node_b on this machine):
where each lands, ``envloop run`` pointed at the cluster with ``ray.address``, a rollout that
loses a worker node mid-step, and a run that loses the head node (then resumed).

Each test drives the cluster from a driver process of its own (``init_ray(address=...)``
through ``RAY_ADDRESS``, or ``envloop run`` with ``ray.address``), so the suite's local Ray
session is untouched. The tests share one cluster and run in file order: the worker-node
test leaves the head and one worker, and the head-node test, last, leaves none.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import yaml

from envloop.run.head_watch import EXIT_STATUS
from envloop.run.journal import RunJournal
from envloop.run.outputs import read_rollouts
from tests.fixtures.ray_cluster import (
    RayCluster,
    driver_output,
    driver_result,
    ray_cluster,
    start_driver,
    start_envloop_run,
    wait_for_files,
)
from tests.fixtures.resumable_runs import ledger, run_here, text_run_config, wait_for_samples

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
# Until Ray's view holds every node's resource: an actor asked of a node the view lacks
# goes to another node (spread is soft).
import time
deadline = time.monotonic() + 60
while not set(("node_head", "node_a", "node_b")).issubset(ray.available_resources()):
    if time.monotonic() > deadline:
        break
    time.sleep(0.5)
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
    # each asked of the next node in turn, each there (num_cpus=0: spread's one byte of
    # memory keeps the request from being empty, which Ray would hand to a random raylet)
    assert landed["spread"] == ["node_a", "node_b", "node_head"]
    assert landed["pinned"] == ["node_b", "node_b"]


def node_run_config(folder: Path, policy_dir: Path, placements: dict[str, str]) -> Path:
    """An ``envloop run`` config of two prompts per task, each task's environment a
    :class:`~tests.fixtures.node_envs.NodeEchoEnv` placed as ``placements[task]`` says (it
    answers ``stepped on <node>``); returns its path."""
    rows = [{"prompt": f"Say {i}.", "task": task} for task in placements for i in range(2)]
    (folder / "prompts.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    config = {
        "policy": {"model_name": str(policy_dir), "max_new_tokens": 4},
        "data": {"path": str(folder / "prompts.jsonl")},
        "envs": {task: {"name": "tests.fixtures.node_envs:NodeEchoEnv", "placement": placement}
                 for task, placement in placements.items()},
        "rollout": {"max_seq_len": 128, "max_turns": 1, "greedy": True},
        "output": {"dir": str(folder / "run")},
    }  # fmt: skip
    (folder / "run.yaml").write_text(yaml.safe_dump(config))
    return folder / "run.yaml"


def test_envloop_run_on_the_cluster_places_each_task_as_configured(
    ray_cluster: RayCluster, tmp_path: Path, untied_policy_dir: Path
):
    placements = {"on_a": "resource:node_a", "on_b": "resource:node_b"}
    config = node_run_config(tmp_path, untied_policy_dir, placements)
    process = start_envloop_run(ray_cluster, config, "-q", stderr=tmp_path / "stderr")
    try:
        out, _ = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, out + (tmp_path / "stderr").read_text()
    assert "Connecting to existing Ray cluster" in (tmp_path / "stderr").read_text()
    rows = read_rollouts(tmp_path / "run")
    replies = [
        (row["task"], [m["content"] for m in row["messages"] if m["content"].startswith("stepped")])
        for row in rows
    ]
    assert replies == [
        ("on_a", ["stepped on node_a"]),
        ("on_a", ["stepped on node_a"]),
        ("on_b", ["stepped on node_b"]),
        ("on_b", ["stepped on node_b"]),
    ]
    assert [row["total_reward"] for row in rows] == [1.0] * 4


def test_a_worker_node_killed_mid_step_loses_no_sample(ray_cluster: RayCluster, tmp_path: Path):
    driver = start_driver(ray_cluster, _ROLLOUT.format(hold_dir=str(tmp_path)))
    try:
        wait_for_files(driver, tmp_path, ["placed.json"])
        placement = json.loads((tmp_path / "placed.json").read_text())
        placed = placement["placed"]
        assert placement["driver"] == "node_head"
        assert sorted(placed.values()) == ["node_a", "node_b", "node_head"]  # one per node
        lost = "node_b"
        wait_for_files(driver, tmp_path, [f"started-{node}" for node in placed.values()])
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


def test_the_head_node_lost_ends_the_run_resumably(
    ray_cluster: RayCluster, tmp_path: Path, untied_policy_dir: Path, ray_session
):
    # Async, 12 samples, the environment on a worker node still alive; 5 and 6 wait on the
    # gate. Once the other ten are recorded, the head is killed: the run must say so and
    # stop, resumable, before Ray's own limit (25 s here: the run gives up after 15).
    config = text_run_config(tmp_path, untied_policy_dir, "async", 12, hold={5, 6})
    raw = yaml.safe_load(config.read_text())
    alive = [n for n in ("node_a", "node_b") if ray_cluster.nodes[n].process.poll() is None]
    raw["envs"]["talk"]["placement"] = f"resource:{alive[0]}"
    config.write_text(yaml.safe_dump(raw))
    (tmp_path / "gate").touch()
    env = {"RAY_gcs_rpc_server_reconnect_timeout_s": "25"}
    process = start_envloop_run(ray_cluster, config, "-q", stderr=tmp_path / "stderr", env=env)
    try:
        wait_for_samples(tmp_path / "run", 10, process)
        assert process.poll() is None, (tmp_path / "stderr").read_text()
        ray_cluster.nodes["node_head"].kill()  # the GCS and the head's raylet, by pid
        process.communicate(timeout=180)
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
            process.communicate()
        for node in ray_cluster.nodes.values():  # the rest of a cluster without its head
            node.kill()
    stderr = (tmp_path / "stderr").read_text()
    assert process.returncode == EXIT_STATUS, stderr
    lines = stderr.splitlines()
    assert any(x.startswith("envloop run: lost the Ray head node: its GCS at ") for x in lines)
    kept = f"envloop run: 10 of 12 samples finished, kept in {tmp_path / 'run'} (resumable;"
    assert any(x.startswith(kept) for x in lines), stderr
    command = f"envloop run {config} ray.address={ray_cluster.address} --quiet --resume"
    assert lines[-1].endswith(f"then resume with: {command}"), stderr
    assert "Traceback" not in stderr
    assert sorted(ledger(tmp_path / "run")) == sorted(set(range(12)) - {5, 6})
    recorded = {r["sample"]: r["messages"] for r in RunJournal.read(tmp_path / "run").records()}

    (tmp_path / "gate").unlink()  # on the suite's local session, the environment placed there
    status, out, err = run_here(config, "envs.talk.placement=default", "--quiet", "--resume")
    assert status == 0, out + err
    rows = read_rollouts(tmp_path / "run")
    assert [row["sample"] for row in rows] == list(range(12))  # none missing, none twice
    assert all(row["num_turns"] == 2 and row["error"] is None for row in rows)
    assert {i: rows[i]["messages"] for i in recorded} == recorded  # kept as they were
