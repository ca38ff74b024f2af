"""The code sandbox against hostile code: each attack is contained, reported, and the host
process is unaffected. Real processes throughout; short limits keep the file fast."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pwd
import re
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from envloop.environments.code import sandbox as code_sandbox
from envloop.environments.code.sandbox import RunResult, SandboxLimits, run_cells

# A generous wall-clock limit: on a loaded machine a run that must finish never meets it.
# Tests that expect a limit provoke it deterministically: sleeping code for the wall clock
# (it uses no CPU), a CPU limit far above the wall-clock one, a wall clock far above the CPU one.
LIMITS = SandboxLimits(timeout_s=60.0, cpu_time_s=5, memory_mb=256, max_output_bytes=1000)
IS_ROOT = os.geteuid() == 0
HOST_LIMITS = (resource.RLIMIT_AS, resource.RLIMIT_CPU, resource.RLIMIT_NPROC)


def _can_unshare() -> bool:
    """Whether the kernel lets this process make the sandbox's namespaces (tried in a child)."""
    flags = 0x00020000 | 0x40000000 | 0x20000000  # CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID
    probe = f"import ctypes, sys; sys.exit(ctypes.CDLL(None).unshare({flags}))"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


NEEDS_PIDNS = pytest.mark.skipif(
    not (IS_ROOT and _can_unshare()),
    reason="the PID namespace and the sandbox user need root that may unshare (CAP_SYS_ADMIN)",
)


def process_groups_left(groups: set[int]) -> list[int]:
    """Live (not zombie) processes in the given process groups, forks included."""
    pids = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                state, _, pgrp = f.read().rsplit(")", 1)[1].split()[:3]
        except OSError:
            continue
        if int(pgrp) in groups and state != "Z":
            pids.append(int(entry))
    return pids


@pytest.fixture
def host(monkeypatch):
    """Checks after the test that no process of its sandboxes is left (other test runs on the
    machine have their own), the host's own limits are untouched, and it can still start a
    process."""
    limits = [resource.getrlimit(kind) for kind in HOST_LIMITS]
    groups: set[int] = set()
    end = code_sandbox._end

    def recording_end(proc, cut):
        groups.add(proc.pid)  # the sandbox's process group id
        return end(proc, cut)

    monkeypatch.setattr(code_sandbox, "_end", recording_end)
    yield
    deadline = time.monotonic() + 60  # SIGKILLed processes take a moment to exit when loaded
    while process_groups_left(groups) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process_groups_left(groups) == []
    assert [resource.getrlimit(kind) for kind in HOST_LIMITS] == limits
    probe = subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True, text=True)
    assert probe.stdout == "42\n"


@pytest.fixture
def private_user():
    """A user made for this test alone (removed afterwards): per-user limits such as
    RLIMIT_NPROC then count only this test's processes. Its uid is one no process runs as
    (useradd would reuse the uid of a user just deleted by a concurrent test run, whose
    processes may still be exiting)."""
    name = f"envloop-t{os.getpid()}"
    busy = _uids_in_use()
    start = 3_000_000 + os.getpid() % 100_000 * 10  # far from useradd's own range
    uid = next(u for u in range(start, start + 1_000_000) if u not in busy)
    subprocess.run(
        ["useradd", "--uid", str(uid), "--no-create-home", "--no-user-group", "--gid", "65534",
         "--shell", "/usr/sbin/nologin", name],
        check=True,
        capture_output=True,
    )  # fmt: skip
    try:
        yield name
    finally:
        for pid in processes_of(uid):  # left by a failing test: the user is this test's alone
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while processes_of(uid) and time.monotonic() < deadline:
            time.sleep(0.05)
        subprocess.run(["userdel", name], check=True, capture_output=True)


def processes_of(uid: int) -> set[int]:
    """The processes (zombies included) whose real, effective or saved uid is ``uid``."""
    pids = set()
    for status in Path("/proc").glob("[0-9]*/status"):
        with contextlib.suppress(OSError, StopIteration):
            uids = next(line for line in status.read_text().splitlines() if line.startswith("Uid:"))
            if uid in map(int, uids.split()[1:4]):
                pids.add(int(status.parent.name))
    return pids


def zombie_children() -> list[int]:
    """This process's children that have exited but were not reaped."""
    zombies = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            state, ppid = stat.read_text().rsplit(")", 1)[1].split()[:2]
            if state == "Z" and int(ppid) == os.getpid():
                zombies.append(int(stat.parent.name))
    return zombies


def _uids_in_use() -> set[int]:
    """The uids of the users here and of every running process."""
    uids = {int(line.split(":")[2]) for line in Path("/etc/passwd").read_text().splitlines()}
    for status in Path("/proc").glob("[0-9]*/status"):
        with contextlib.suppress(OSError):
            real = next(line for line in status.read_text().splitlines() if line.startswith("Uid:"))
            uids.update(int(u) for u in real.split()[1:])
    return uids


def run(code: str, **limits) -> RunResult:
    return run_cells([code], (), dataclasses.replace(LIMITS, **limits))


def test_cells_share_one_namespace_and_only_the_last_cell_is_shown(host):
    result = run_cells(["x = 2\nprint('replayed')", "print(x + 1)\nx * 10"], (), LIMITS)
    assert (result.output, result.error, result.stopped) == ("3\n20\n", None, None)
    assert result.cells_finished == 2
    assert result.report() == "3\n20\n"


def test_tests_count_the_statements_that_raise_nothing(host):
    tests = ["assert f(2) == 4", "assert f(3) == 9", "assert f(0) == 1", "assert g(1)"]
    result = run_cells(["def f(n):\n    return n * n"], tests, LIMITS)
    assert result.tests_passed == 2


def test_errors_are_the_last_lines_of_the_traceback(host):
    result = run("print('before')\n1 / 0")
    assert (result.output, result.error) == ("before\n", "ZeroDivisionError: division by zero")
    assert result.report() == "before\nZeroDivisionError: division by zero\n"
    syntax = run("x = = 1").error
    assert syntax == 'File "<cell 1>", line 1\n    x = = 1\n        ^\nSyntaxError: invalid syntax'


def test_infinite_loop_is_stopped_at_the_wall_clock_limit(host):
    # CPU time cannot outrun wall time, so a 60 s CPU limit cannot come before the 1 s one
    result = run("print('start')\nwhile True:\n    pass", timeout_s=1.0, cpu_time_s=60)
    assert result.output == "start\n"
    assert result.stopped == "Stopped: the code ran longer than the 1 s time limit."
    assert result.cells_finished == 0


def test_cpu_burn_is_killed_at_the_cpu_limit(host):
    # the wall-clock limit is far away: on a loaded machine 1 s of CPU can take 20 s
    result = run("while True:\n    pass", cpu_time_s=1, timeout_s=3600.0)
    assert result.stopped == "Stopped: the code used more than 1 s of CPU time."


def test_code_ignoring_sigxcpu_is_killed_at_the_hard_cpu_limit_and_told_so(host):
    # SIGKILL at the hard limit, which the parent did not send: the CPU limit, by its rusage
    code = "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass"
    result = run(code, cpu_time_s=1, timeout_s=3600.0)
    assert result.stopped == "Stopped: the code used more than 1 s of CPU time."


def test_the_stop_reason_comes_from_how_the_process_ended():
    limits = dataclasses.replace(LIMITS, cpu_time_s=1, timeout_s=2.0)
    cpu = "Stopped: the code used more than 1 s of CPU time."
    wall = "Stopped: the code ran longer than the 2 s time limit."

    def reason(cut, returncode, cpu_s, killed_by_parent, done=False):
        ending = code_sandbox._Ending(returncode, cpu_s, killed_by_parent)
        return code_sandbox._stop_reason(cut, ending, done, limits, [])

    # a loaded machine: the rlimit's SIGKILL came before the parent noticed its deadline
    assert reason("timeout", -9, 2.01, killed_by_parent=False) == cpu
    assert reason("", -9, 2.01, killed_by_parent=False) == cpu
    assert reason("timeout", -24, 1.0, killed_by_parent=False) == cpu
    assert reason("timeout", -9, 1.5, killed_by_parent=True) == wall  # it was still running
    assert reason("", -9, 0.2, killed_by_parent=False) == (
        "Stopped: the sandbox process ended early (signal SIGKILL)."
    )  # someone else's SIGKILL (the OOM killer, say) is not called a CPU limit
    assert reason("", 0, 0.2, killed_by_parent=False, done=True) is None


def slow_start(monkeypatch, seconds: float) -> None:
    """Make the sandbox take ``seconds`` to start, as on a loaded machine."""
    command = " ".join(code_sandbox._COMMAND)
    monkeypatch.setattr(
        code_sandbox, "_COMMAND", ["/bin/sh", "-c", f"sleep {seconds}; exec {command}"]
    )


def test_a_slow_start_is_not_charged_to_the_codes_time_limit(host, monkeypatch):
    slow_start(monkeypatch, 2)
    result = run("print('quick')", timeout_s=1.0)
    assert (result.output, result.stopped) == ("quick\n", None)


def test_a_sandbox_that_does_not_start_is_stopped_and_told_so(host, monkeypatch):
    slow_start(monkeypatch, 30)
    monkeypatch.setattr(code_sandbox, "_START_LIMIT_S", 0.5)
    result = run("print('never')")
    assert (result.output, result.cells_finished) == ("", 0)
    assert result.stopped == "Stopped: the sandbox did not start within 0.5 s."


def test_sleeping_code_is_stopped_too(host):
    result = run("import time\ntime.sleep(60)", timeout_s=1.0)
    assert result.stopped == "Stopped: the code ran longer than the 1 s time limit."


def test_memory_bomb_raises_memory_error_inside_the_sandbox(host):
    result = run("x = []\nwhile True:\n    x.append(bytearray(10**7))", memory_mb=128)
    assert (result.error, result.stopped) == ("MemoryError", None)
    assert run("x = bytearray(2**40)").error == "MemoryError"


def test_fork_and_subprocess_are_blocked_by_default(host):
    assert run("import os\nos.fork()").error == "PermissionError: sandbox: os.fork is not allowed"
    assert run("import os\nos.system('true')").error == (
        "PermissionError: sandbox: os.system is not allowed"
    )
    assert run("import subprocess").error == (
        "PermissionError: sandbox: import _posixsubprocess is not allowed"
    )


@pytest.mark.skipif(not IS_ROOT, reason="RLIMIT_NPROC of a dedicated user needs root")
def test_fork_bomb_hits_the_process_limit(host, private_user):
    bomb = (
        "import os, time\n"
        "n = 0\n"
        "try:\n"
        "    while True:\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(60)\n"
        "        n += 1\n"
        "except OSError as e:\n"
        "    print(f'fork failed after {n} forks: {type(e).__name__}')\n"
    )
    # RLIMIT_NPROC counts every process of the user: a user of this test's own, as the
    # sandboxes of other test runs on this machine would take some of the 4 otherwise
    result = run(bomb, max_processes=4, sandbox_user=private_user)
    assert result.output == "fork failed after 3 forks: BlockingIOError\n"  # 1 + 3 = 4
    assert result.stopped is None  # the forks it left sleeping were killed with the group


# Code whose forks try to outlive the run, each sleeping far past it: in the process group,
# orphaned, in a session of its own (holding the output pipes open, or not), daemonised.
ESCAPES = {
    "fork": "if os.fork() == 0:\n    time.sleep(600)\n",
    "double fork": (
        "if os.fork() == 0:\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(600)\n"
        "    os._exit(0)\n"
        "os.wait()\n"
    ),
    "setsid": "if os.fork() == 0:\n    os.setsid()\n    time.sleep(600)\n",
    "setsid, closed fds": (
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    os.close(0)\n"
        "    os.close(1)\n"
        "    os.close(2)\n"
        "    time.sleep(600)\n"
    ),
    "daemon": (
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        os.close(0)\n"
        "        os.close(1)\n"
        "        os.close(2)\n"
        "        time.sleep(600)\n"
        "    os._exit(0)\n"
        "os.wait()\n"
    ),
}


@NEEDS_PIDNS
@pytest.mark.parametrize("max_processes", [1, 8])
@pytest.mark.parametrize("escape", ESCAPES)
def test_no_process_of_a_run_outlives_it(host, private_user, escape, max_processes):
    uid = pwd.getpwnam(private_user).pw_uid
    before = processes_of(uid)
    code = "import os, time\n" + ESCAPES[escape] + "print('main done')"
    result = run(code, max_processes=max_processes, sandbox_user=private_user)
    assert processes_of(uid) - before == set()  # at once: the run ends when they are gone
    assert zombie_children() == []
    if max_processes == 1:  # forking is refused
        assert (result.output, result.error, result.stopped) == (
            "", "PermissionError: sandbox: os.fork is not allowed", None,
        )  # fmt: skip
        assert result.leftover_processes == 0
    else:
        assert (result.output, result.error, result.stopped) == ("main done\n", None, None)
        assert result.leftover_processes == 1


@NEEDS_PIDNS
def test_no_process_outlives_a_run_stopped_at_its_time_limit(host, private_user):
    uid = pwd.getpwnam(private_user).pw_uid
    code = "import os, time\n" + ESCAPES["daemon"] + ESCAPES["setsid"] + "time.sleep(600)"
    result = run(code, timeout_s=1.0, max_processes=8, sandbox_user=private_user)
    assert result.stopped == "Stopped: the code ran longer than the 1 s time limit."
    assert processes_of(uid) == set()  # at once: the kernel empties the namespace first
    assert zombie_children() == []


@NEEDS_PIDNS
def test_a_process_holding_the_output_open_does_not_make_a_finished_run_a_timeout(
    host, private_user
):
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(600)\n6 * 7"
    limits = dataclasses.replace(LIMITS, timeout_s=20.0, max_processes=8, sandbox_user=private_user)
    result = run_cells([code], ["assert 6 * 7 == 42", "assert False"], limits)
    assert (result.output, result.error, result.stopped) == ("42\n", None, None)
    assert (result.cells_finished, result.tests_passed, result.leftover_processes) == (1, 1, 1)


def test_without_a_pid_namespace_output_held_open_after_the_run_ends_is_not_waited_for(
    host, monkeypatch, tmp_path
):
    # A stand-in sandbox process: it forks a process into a session of its own (out of
    # reach of the process group's kill) that holds the output pipes, reports its results
    # and exits. The parent stops reading once the pipes are empty and reports those results.
    pid_file = tmp_path / "leftover.pid"
    script = (
        "import os, sys, time\n"
        "sys.stdin.buffer.read()\n"
        "r, w = os.pipe()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os.setsid()\n"
        "    os.write(w, b'x')\n"
        "    time.sleep(600)\n"
        "    os._exit(0)\n"
        "os.read(r, 1)\n"
        f"open({str(pid_file)!r}, 'w').write(str(pid))\n"
        "os.write(1, b'hi\\n')\n"
        'os.write(2, b\'{"protections": []}\\n{"cell": 0}\\n{"done": true}\\n\')\n'
    )
    monkeypatch.setattr(code_sandbox, "_COMMAND", [sys.executable, "-c", script])
    try:
        result = run("print('hi')")
    finally:
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
    assert (result.output, result.error, result.stopped, result.cells_finished) == (
        "hi\n", None, None, 1,
    )  # fmt: skip
    assert result.leftover_processes == 1  # without the namespace: something held the pipes


def test_reading_etc_passwd_is_blocked(host):
    result = run("print(open('/etc/passwd').read())")
    assert result.output == ""
    assert re.fullmatch(
        r"PermissionError: sandbox: reading '/etc/passwd' is not allowed \(outside .+\)",
        result.error,
    )


def test_files_outside_the_working_directory_are_blocked(host, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("the launch codes")
    for code in [
        f"open({str(secret)!r}).read()",
        "open('../../x', 'w')",
        "import os\nos.listdir('/')",
    ]:
        result = run(code)
        assert result.error.startswith("PermissionError: sandbox: "), result.error
        assert "launch codes" not in result.output
    assert secret.read_text() == "the launch codes"


@pytest.mark.skipif(not IS_ROOT, reason="the private root needs root")
def test_the_host_filesystem_is_not_even_visible_under_chroot(host, tmp_path):
    (tmp_path / "secret.txt").write_text("x")
    code = f"import os\n[os.path.exists(p) for p in ('/etc/passwd', {str(tmp_path)!r}, '/proc')]"
    assert (
        run(code).output == "[False, False, False]\n"
    )  # os.stat is not audited: the kernel says no


def test_the_working_directory_is_fresh_writable_and_removed(host, monkeypatch):
    # Sandboxes make their working directories in tempfile's directory: one of this test's
    # own, so that other test runs' sandboxes on this machine are not counted.
    temp = tempfile.mkdtemp(prefix="envloop-test-")
    os.chmod(temp, 0o755)  # the sandbox user must reach its working directory
    monkeypatch.setattr(tempfile, "tempdir", temp)
    try:
        result = run_cells(["open('a.txt', 'w').write('hi')", "import os\nsorted(os.listdir('.'))"])
        assert result.output == "['a.txt']\n"
        assert run("import os\nos.listdir('.')").output == "[]\n"
        assert run("open('big', 'wb').write(b'x' * 2 * 2**20)", disk_mb=1).error == (
            "OSError: [Errno 27] File too large"
        )
        assert os.listdir(temp) == []
    finally:
        os.rmdir(temp)


def test_sockets_are_blocked(host):
    assert run("import socket\nsocket.socket()").error == (
        "PermissionError: sandbox: socket.__new__ is not allowed"
    )
    assert run("import urllib.request\nurllib.request.urlopen('http://1.1.1.1')").error == (
        "urllib.error.URLError: <urlopen error sandbox: socket.getaddrinfo is not allowed>"
    )


@pytest.mark.skipif(not IS_ROOT, reason="a network namespace needs root")
def test_the_network_namespace_has_only_loopback(host):
    assert run("import socket\nsocket.if_nameindex()").output == "[(1, 'lo')]\n"


def test_the_parents_environment_is_not_visible(host, monkeypatch):
    monkeypatch.setenv("ENVLOOP_SECRET_TOKEN", "hunter2")
    result = run("import os\nprint(sorted(os.environ))\nos.environ.get('ENVLOOP_SECRET_TOKEN')")
    assert result.output == "['HOME', 'LANG', 'PATH', 'PYTHONHASHSEED', 'TMPDIR']\n"
    result = run("import os\nopen(f'/proc/{os.getppid()}/environ').read()")
    assert result.error.startswith("PermissionError: sandbox: reading '/proc/")
    assert os.environ["ENVLOOP_SECRET_TOKEN"] == "hunter2"


def test_huge_output_is_capped_and_stops_the_run(host):
    result = run("while True:\n    print('x' * 99)", max_output_bytes=1000)
    assert result.output == ("x" * 99 + "\n") * 10
    assert result.stopped == "Stopped: the output passed the 1000-byte limit."
    one_line = run("print('y' * 10**6)", max_output_bytes=1000)
    assert (one_line.output, one_line.stopped) == ("y" * 1000, result.stopped)


def test_signals_ctypes_and_early_exits_are_handled(host):
    assert (
        run("import os\nos.kill(1, 9)").error == "PermissionError: sandbox: os.kill is not allowed"
    )
    assert run("import ctypes").error == "PermissionError: sandbox: import ctypes is not allowed"
    assert run("import os\nos._exit(3)").stopped == (
        "Stopped: the sandbox process ended early (exit code 3)."
    )
    assert run("import sys\nsys.exit(2)").error == "SystemExit: 2"


def test_replays_draw_the_same_random_numbers(host):
    first = run("import random\nrandom.random()").output
    assert first == run("import random\nrandom.random()").output == "0.8444218515250481\n"


def test_protections_in_force_on_this_machine(host):
    result = run("import os\nos.getuid()")
    if IS_ROOT:
        assert result.protections == (
            "netns", "chroot", "pidns", "no_new_privs", "rlimits", "uid=65534", "audit_hook",
        )  # fmt: skip
        assert result.output == "65534\n"
    else:
        assert {"rlimits", "audit_hook"} <= set(result.protections)


def test_bad_limits_are_refused_with_every_problem():
    with pytest.raises(ValueError, match="timeout_s: must be > 0.*max_open_files: must be >= 16"):
        run_cells(["1"], (), SandboxLimits(timeout_s=0, max_open_files=3))
