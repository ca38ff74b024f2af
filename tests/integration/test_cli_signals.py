"""``envloop run`` stopped by SIGTERM or Ctrl-C (SIGINT) mid-run: it stops admitting work,
lets the batch in flight finish, writes the rollout files of what finished, prints the
command that resumes and exits 143 / 130, with no traceback; a second Ctrl-C stops it at
once, still resumable. In ``rollout.mode: async`` a signal stops the batch's stream from
admitting samples: the samples started finish, the others are left to ``--resume``. The runs
hold samples on a gate file (:mod:`tests.fixtures.gated_envs`) so each signal lands at a
known point; they join the suite's Ray session."""

from __future__ import annotations

import json
import signal
import time

import pytest

from envloop.run.outputs import read_rollouts
from tests.fixtures.resumable_runs import (
    ledger,
    run_here,
    start_run,
    text_run_config,
    wait_for_samples,
)

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def started(folder, policy_dir, ray_session):
    """A sync run of 12 samples in batches of 4 whose second batch waits on the gate, in
    its own process (stderr to ``folder/stderr``), once the first batch is recorded."""
    config = text_run_config(folder, policy_dir, "sync", 4, hold={4, 5})
    (folder / "gate").touch()
    address = ray_session.get_runtime_context().gcs_address
    process = start_run(config, address, "-q", stderr=folder / "stderr")
    wait_for_samples(folder / "run", 4, process)
    assert process.poll() is None, (process.communicate(), (folder / "stderr").read_text())
    return config, process


def wait_for_line(path, text, process, limit_s=120):
    """Until the file at ``path`` holds ``text`` or the process ended (bounded)."""
    deadline = time.monotonic() + limit_s
    while text not in path.read_text() and process.poll() is None:
        assert time.monotonic() < deadline, f"{text!r} not written in {limit_s} s"
        time.sleep(0.05)


@pytest.mark.parametrize(
    ("sent", "status", "line"),
    [
        (signal.SIGTERM, 143, "envloop run: stopped by SIGTERM: 8 of 12 samples finished"),
        (signal.SIGINT, 130, "envloop run: interrupted (Ctrl-C): 8 of 12 samples finished"),
    ],
    ids=["SIGTERM", "SIGINT"],
)
def test_a_signal_finishes_the_batch_in_flight_and_prints_the_resume_command(
    ray_session, tmp_path, untied_policy_dir, sent, status, line
):
    config, process = started(tmp_path, untied_policy_dir, ray_session)
    try:
        process.send_signal(sent)
        (tmp_path / "gate").unlink()  # the batch in flight may end now; no batch starts
        process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    stderr = (tmp_path / "stderr").read_text()
    assert process.returncode == status, stderr
    lines = stderr.splitlines()
    assert any(x.startswith(line) for x in lines), stderr
    assert f"envloop run: resume with: envloop run {config} --quiet --resume" in lines
    assert "Traceback" not in stderr
    assert sorted(ledger(tmp_path / "run")) == list(range(8))
    written = [
        json.loads(x) for x in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()
    ]
    assert [r["sample"] for r in written] == list(range(8))  # what finished, in sample order


def test_a_second_ctrl_c_stops_at_once_and_the_run_resumes(
    ray_session, tmp_path, untied_policy_dir
):
    config, process = started(tmp_path, untied_policy_dir, ray_session)
    try:
        process.send_signal(signal.SIGINT)
        wait_for_line(tmp_path / "stderr", "finishing the samples in flight", process)
        process.send_signal(signal.SIGINT)  # the held batch never ends: only this stops it
        process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    stderr = (tmp_path / "stderr").read_text()
    assert process.returncode == 130, stderr
    assert "envloop run: interrupted (Ctrl-C) again: stopped at once" in stderr.splitlines()
    assert f"envloop run: resume with: envloop run {config} --quiet --resume" in stderr
    assert sorted(ledger(tmp_path / "run")) == [0, 1, 2, 3]
    (tmp_path / "gate").unlink()
    status, out, err = run_here(config, "--quiet", "--resume")
    assert status == 0, out + err
    assert [r["sample"] for r in read_rollouts(tmp_path / "run")] == list(range(12))


def test_a_signal_stops_an_async_batch_admitting_samples_and_the_rest_resume(
    ray_session, tmp_path, untied_policy_dir
):
    # One async batch of 12, four samples at a time; 1-4 wait on the gate. Sample 0 ends
    # first and 4 takes its place, so when 0 is recorded, 1-4 are in flight and 5-11 wait.
    config = text_run_config(tmp_path, untied_policy_dir, "async", 12, hold={1, 2, 3, 4})
    (tmp_path / "gate").touch()
    address = ray_session.get_runtime_context().gcs_address
    limit = "rollout.max_concurrent_samples=4"
    process = start_run(config, address, limit, "-q", stderr=tmp_path / "stderr")
    try:
        wait_for_samples(tmp_path / "run", 1, process)
        process.send_signal(signal.SIGTERM)
        wait_for_line(tmp_path / "stderr", "finishing the samples in flight", process)
        (tmp_path / "gate").unlink()  # the samples in flight may end now
        process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
    stderr = (tmp_path / "stderr").read_text()
    assert process.returncode == 143, stderr
    lines = stderr.splitlines()
    assert any(x.startswith("envloop run: stopped by SIGTERM: 5 of 12 samples") for x in lines)
    assert f"envloop run: resume with: envloop run {config} {limit} --quiet --resume" in lines
    assert "Traceback" not in stderr
    assert sorted(ledger(tmp_path / "run")) == [0, 1, 2, 3, 4]  # 5-11 never started
    assert [r["sample"] for r in read_rollouts(tmp_path / "run")] == [0, 1, 2, 3, 4]
    first = {r["sample"]: r for r in read_rollouts(tmp_path / "run")}

    status, out, err = run_here(config, limit, "--quiet", "--resume")
    assert status == 0, out + err
    assert "resuming" in out and "5 of 12 samples finished earlier (kept), 7 to roll out" in out
    rows = read_rollouts(tmp_path / "run")
    assert [r["sample"] for r in rows] == list(range(12))  # none missing, none twice
    assert all(r["num_turns"] == 2 and r["error"] is None for r in rows)
    assert [rows[i] for i in first] == list(first.values())  # the kept rows, unchanged
