"""``envloop run`` stopped by SIGTERM or Ctrl-C (SIGINT) mid-run: one line on stderr, exit
status 143 or 130, no traceback (the run joins the suite's Ray session)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def start_run(folder, policy_dir, ray_address):
    """``envloop run`` in a process of its own, on enough prompts to be still running
    when its run directory appears."""
    rows = [{"prompt": f"What is {a} + {a}?", "ground_truth": str(2 * a)} for a in range(400)]
    (folder / "prompts.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    config = {
        "policy": {"model_name": str(policy_dir), "max_new_tokens": 32},
        "data": {"path": str(folder / "prompts.jsonl")},
        "envs": {"math": {"name": "math", "config": {"num_workers": 1}}},
        "rollout": {"max_seq_len": 256, "max_turns": 1, "batch_size": 8},
        "output": {"dir": str(folder / "run")},
    }
    (folder / "run.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "RAY_ADDRESS": ray_address, "RAY_AUTH_MODE": "disabled"}
    command = [sys.executable, "-m", "envloop.cli.main", "run", str(folder / "run.yaml"), "-q"]
    return subprocess.Popen(
        command, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def wait_for(path, process, limit_s=300):
    """Until ``path`` exists (the run has started rolling out), or the process ended."""
    deadline = time.monotonic() + limit_s
    while not path.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)


@pytest.mark.parametrize(
    ("sent", "status", "line"),
    [
        (signal.SIGTERM, 143, "envloop run: stopped by SIGTERM"),
        (signal.SIGINT, 130, "envloop run: interrupted (Ctrl-C)"),
    ],
)
def test_a_signal_mid_run_ends_it_with_one_line(
    ray_session, tmp_path, tiny_policy_dir, sent, status, line
):
    address = ray_session.get_runtime_context().gcs_address
    process = start_run(tmp_path, tiny_policy_dir, address)
    try:
        wait_for(tmp_path / "run" / "config.yaml", process)
        assert process.poll() is None, process.communicate()
        process.send_signal(sent)
        _, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == status, stderr
    assert line in stderr.splitlines()
    assert "Traceback" not in stderr
