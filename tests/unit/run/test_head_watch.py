"""The head watch of ``envloop run``: a GCS that stops answering ends the process with a
message naming what happened, the samples kept and the command that resumes; one that
answers lets the run go on. The watch runs in a process of its own (it ends its process)
against a TCP listener standing in for the GCS."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from envloop.run.head_watch import EXIT_STATUS, HeadWatch, give_up_after_s
from envloop.run.journal import RunJournal

SCRIPT = textwrap.dedent(
    """
    import socket, sys, time
    from envloop.run.head_watch import HeadWatch
    from envloop.run.journal import RunJournal

    gcs = socket.create_server(("127.0.0.1", 0))
    port = gcs.getsockname()[1]
    journal = RunJournal.start(sys.argv[1], {"policy": {}}, "abc", total=3)
    journal.add({"sample": 0, "task": "t"}, {"sample": 2, "task": "t"})
    with HeadWatch(f"127.0.0.1:{port}", journal, lambda: "envloop run r.yaml --resume", 1.0):
        while not HeadWatch(f"127.0.0.1:{port}", journal, lambda: None).answers():
            time.sleep(0.1)
        print("answered", flush=True)
        if sys.argv[2] == "lose":
            gcs.close()
        time.sleep(60 if sys.argv[2] == "lose" else 3)  # lost: the watch ends it first
    print("went on", flush=True)
    """
)


def watched(tmp_path, what):
    return subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "run"), what],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_a_lost_gcs_ends_the_process_with_the_resume_command(tmp_path):
    done = watched(tmp_path, "lose")
    assert done.returncode == EXIT_STATUS, done.stderr
    assert done.stdout == "answered\n"
    lines = done.stderr.strip().splitlines()
    assert lines[0].startswith("envloop run: lost the Ray head node: its GCS at 127.0.0.1:")
    assert lines[1].startswith(
        f"envloop run: 2 of 3 samples finished, kept in {tmp_path / 'run'} (resumable;"
    )
    assert lines[2].endswith("then resume with: envloop run r.yaml --resume")
    assert "Traceback" not in done.stderr


def test_a_gcs_that_answers_lets_the_run_go_on(tmp_path):
    done = watched(tmp_path, "keep")
    assert (done.returncode, done.stdout) == (0, "answered\nwent on\n"), done.stderr


def test_the_watch_gives_up_ten_seconds_before_ray():
    assert give_up_after_s({}) == 50.0
    assert give_up_after_s({"RAY_gcs_rpc_server_reconnect_timeout_s": "25"}) == 15.0
    assert give_up_after_s({"RAY_gcs_rpc_server_reconnect_timeout_s": "5"}) == 1.0
    assert give_up_after_s({"RAY_gcs_rpc_server_reconnect_timeout_s": "soon"}) == 50.0


def test_without_a_gcs_address_nothing_is_watched(tmp_path):
    journal = RunJournal.start(tmp_path, {"policy": {}}, "abc", total=1)
    with HeadWatch(None, journal, lambda: None) as watch:
        assert not watch._thread.is_alive()
    journal.close()
