"""Run untrusted Python in a separate, locked-down process: the ``code`` environment's executor.

:func:`run_cells` starts ``sandbox_child.py`` as a script (``python -S -s -B -P``) with
an empty environment (only ``PATH``, ``LANG``, ``PYTHONHASHSEED``), sends it the cells and
tests on stdin, and reads at most ``max_output_bytes`` of output until the child exits or a
wall-clock deadline passes; then it kills the child's whole process group and its children.
Once the child has exited, output is read only until the pipes are empty (what it wrote is
in them), at most ``_DRAIN_LIMIT_S``: a process it left holding them open does not hold the
run up, and the run reports what the cells and tests did, not a time limit (such processes
are counted in ``RunResult.leftover_processes``). Before running any untrusted code the child
applies these layers, strongest first (each run reports the ones in force in
``RunResult.protections``), then reports that it is ready; the wall-clock limit counts from
there, so a slow start on a busy machine is not charged to the code (the start itself has
its own limit, ``_START_LIMIT_S``):

* ``netns``, ``chroot`` (parent is root, kernel allows ``unshare``): a private network
  namespace (only a downed loopback: no network at all) and a private mount namespace whose
  root is a fresh size-capped tmpfs holding only ``/work`` (the working directory, noexec),
  read-only binds of the Python standard library and the system library directories, and
  ``/dev/null`` and ``/dev/urandom``. The host's files, ``/etc`` and ``/proc`` do not exist
  in there. Everything vanishes when the last sandbox process exits.
* ``pidns`` (with ``netns``): a private PID namespace. The child forks its init (PID 1: it
  runs no code, only reaps), which forks the runner of the code. When the runner ends, init
  kills and reaps every other process in the namespace and exits; and when init dies for any
  reason (the parent's kill at a limit included), the kernel kills everything in the
  namespace, and completes init's exit only then. So no process of a run outlives it (nor
  holds a slot of the sandbox user's ``RLIMIT_NPROC`` or its tmpfs), even one that left the
  process group with ``os.setsid()`` and closed its output: when :func:`run_cells` returns,
  they are gone. No ``/proc`` is mounted in there.
* ``uid=N`` (parent is root): the code runs as ``sandbox_user`` (default ``nobody``) with no
  supplementary groups, so it holds no capabilities (it cannot leave the chroot, mount, or
  change its limits) and ``RLIMIT_NPROC`` applies. The limit counts every process and thread
  of that user, so sandboxes running at once share it.
* ``no_new_privs``: no program it might exec can gain privileges (setuid binaries).
* ``rlimits``: CPU seconds (``RLIMIT_CPU``), address space (``RLIMIT_AS``, so big allocations
  raise ``MemoryError``), file size, open files, processes, no core dumps.
* ``audit_hook`` (``sys.addaudithook``): refuses sockets, ctypes, signalling other processes,
  and (with ``max_processes == 1``) fork/exec/subprocess; reading files outside the working
  directory and the standard library, and writing outside the working directory.

The state of a run: cells run in order in one namespace; only the last cell's output is
returned (earlier cells are replays). ``random`` is seeded with 0 and string hashing with
``PYTHONHASHSEED=0`` so replays draw the same values. Tests (statements, usually ``assert``)
run after the cells; each passes when it raises nothing.

Threat model, honestly:

* Contained: runaway loops, CPU burn, memory and disk bombs, fork bombs, output floods,
  reading the host's files or the parent's environment, network access, signalling other
  processes, leftover processes (``pidns``: every process of the run is killed when its main
  process ends or at a limit).
* Without root only ``rlimits`` and the audit hook remain; the code then runs as the
  parent's user and can read whatever that user can if it gets past the hook.
  ``RLIMIT_NPROC`` then counts all that user's processes, so forking simply fails. As root
  without ``unshare`` (a container without ``CAP_SYS_ADMIN``), ``uid=N`` and ``no_new_privs``
  hold too. Either way there is no ``pidns``: the parent kills the process group and the
  sandbox process's children, but with ``max_processes > 1`` a grandchild that calls
  ``os.setsid()`` survives the run until it ends by itself (as the sandbox user, holding a
  slot of its ``RLIMIT_NPROC``); it no longer holds the run up.
* Not contained: kernel exploits (the sandbox shares the host kernel and has the full
  syscall surface, no seccomp), CPython memory-corruption bugs (crafted bytecode can reach
  raw syscalls, skipping the audit hook; the kernel layers still hold), side channels
  (timing, ``/work`` on tmpfs costs host RAM beyond ``memory_mb``), and denial of service
  against other sandboxes of the same uid (shared ``RLIMIT_NPROC``).
* The audit hook is a mitigation, not a boundary: it makes honest mistakes fail fast with a
  clear message, and code in the same interpreter can defeat it. ``gc.get_objects()`` finds
  the hook's function, and its closure's cells (and ``gc.get_referrers`` the lists of allowed
  directories) can be rewritten, e.g. to allow sockets or any path; ``os.open(path,
  dir_fd=fd)`` is checked as if ``path`` were relative to the working directory, not to
  ``fd``, so a descriptor of an allowed directory plus ``../`` reaches any file; symlinks can
  race the path checks. (Tried under root: the sockets found no network, the ``dir_fd`` read
  got a system library the path checks refuse but nothing outside the chroot, a write to
  ``/usr/lib`` hit the read-only mount.) The kernel layers (namespaces, chroot, uid,
  rlimits, the PID namespace) are the boundary. The hook also means test results come from the
  same interpreter as the model's code: a model that attacks its grader (forging status
  lines, patching builtins, objects whose ``__eq__`` is always true) can fake passing
  tests. Rewards here measure honest solutions.
* For hostile code at scale use a real isolation boundary: a container runtime with
  seccomp, gVisor, or Firecracker microVMs.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from envloop.config.validation import config_problems, declared_defaults
from envloop.environments.code.config import SandboxLimitsConfig, sandbox_user_problems

if TYPE_CHECKING:  # the sandbox must not load subprocess: it would bypass the fork block
    import subprocess

_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_child.py")
_COMMAND = [sys.executable, "-S", "-s", "-B", "-P", _CHILD]
_ENV = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"}
_STATUS_BYTES = 1 << 16  # room for status lines on stderr, beyond max_output_bytes
_READY = b'{"protections"'  # the child's status line once isolated, about to run the code
_START_LIMIT_S = 120.0  # wall-clock limit of the start-up (interpreter, isolation), not the code
_EXIT_GRACE_S = 5.0  # after its pipes close, how long an exiting process may take to be reapable
_DRAIN_LIMIT_S = 1.0  # once the sandbox process has exited, the longest the pipes are read


_LIMITS = declared_defaults(SandboxLimitsConfig)


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one sandbox run: :class:`SandboxLimitsConfig`'s fields (declared
    there, with their defaults and bounds; see the module docstring for what enforces each).
    """

    timeout_s: float = _LIMITS["timeout_s"]
    cpu_time_s: int = _LIMITS["cpu_time_s"]
    memory_mb: int = _LIMITS["memory_mb"]
    max_output_bytes: int = _LIMITS["max_output_bytes"]
    max_processes: int = _LIMITS["max_processes"]
    disk_mb: int = _LIMITS["disk_mb"]
    max_open_files: int = _LIMITS["max_open_files"]
    sandbox_user: str = _LIMITS["sandbox_user"]

    def problems(self) -> list[str]:
        """One line per bad limit, naming the field and the fix.

        >>> for problem in SandboxLimits(timeout_s=0, memory_mb=8).problems():
        ...     print(problem)
        timeout_s: must be > 0, got 0
        memory_mb: must be >= 64, got 8
        """
        problems = config_problems(SandboxLimitsConfig, asdict(self))
        return problems + sandbox_user_problems(self.sandbox_user)


def sandbox_limits(options: Mapping[str, Any]) -> SandboxLimits:
    """The sandbox limits among a ``code`` config's options."""
    return SandboxLimits(**{k: v for k, v in options.items() if k in _LIMITS})


@dataclass(frozen=True)
class RunResult:
    """What one run produced.

    Attributes:
        output: the last cell's stdout and stderr, then the repr of its final expression's
            value when that is not None (as in a notebook); at most ``max_output_bytes``.
        error: the last cell's exception as the traceback's last line(s), else None.
        stopped: why the run was stopped before it finished (time, CPU or output limit, a
            crash), else None.
        cells_finished: cells that ran to their end (an exception counts as an end).
        tests_passed: tests that raised nothing.
        protections: the isolation layers that were in force (see the module docstring).
        leftover_processes: processes the code started that were still running when the
            sandbox's main process ended; they did not hold the run up. Under ``pidns`` all
            were killed then, and this counts them; without it, this is 1 when one of them
            kept the output open (the others are not seen), else 0, and those that left the
            process group were not killed (see the threat model).
    """

    output: str
    error: str | None
    stopped: str | None
    cells_finished: int
    tests_passed: int
    protections: tuple[str, ...]
    leftover_processes: int = 0

    def report(self) -> str:
        """The text shown to the model: output, then the error and stop reason lines."""
        lines = [self.output.rstrip("\n")] if self.output else []
        lines += [text for text in (self.error, self.stopped) if text]
        return "".join(line + "\n" for line in lines)


def run_cells(
    cells: Sequence[str], tests: Sequence[str] = (), limits: SandboxLimits | None = None
) -> RunResult:
    """Run ``cells`` in order in one fresh sandbox, then ``tests``; see the module docstring.

    >>> r = run_cells(["x = 2", "print(x + 1)\\nx * 10"], ["assert x == 2", "assert x == 3"])
    >>> r.output, r.error, r.stopped, r.cells_finished, r.tests_passed
    ('3\\n20\\n', None, None, 2, 1)
    """
    limits = limits or SandboxLimits()
    if limits.problems():
        raise ValueError("Invalid SandboxLimits: " + "; ".join(limits.problems()))
    import subprocess

    uid, gid = _sandbox_ids(limits.sandbox_user)
    workdir = tempfile.mkdtemp(prefix="envloop-code-")
    request: dict[str, Any] = {"cells": list(cells), "tests": list(tests)}
    request.update(limits=asdict(limits), workdir=workdir, uid=uid, gid=gid)
    try:
        proc = subprocess.Popen(
            _COMMAND, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=_ENV, cwd=workdir, start_new_session=True,
        )  # fmt: skip
        cut = "error"  # what stopped the reading, when an exception ends it early
        try:
            _send(proc, json.dumps(request).encode())
            out, status, cut = _read_output(proc, limits)
        finally:
            ending = _end(proc, cut)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return _result(out, status, cut, ending, request)


class _Ending(NamedTuple):
    """How the sandbox process ended: facts for the stop reason, not timing guesses."""

    returncode: int  # as Popen's: negative for a signal
    cpu_s: float  # user + system CPU seconds it used (its rusage)
    killed_by_parent: bool  # still running when run_cells killed its process group


def _sandbox_ids(user: str) -> tuple[int | None, int | None]:
    """The uid and gid to run as: the sandbox user's when we are root, else None (no change)."""
    if os.geteuid() != 0:
        return None, None
    import pwd

    entry = pwd.getpwnam(user)
    return entry.pw_uid, entry.pw_gid


def _send(proc: subprocess.Popen[bytes], request: bytes) -> None:
    assert proc.stdin is not None
    try:
        proc.stdin.write(request)
        proc.stdin.close()
    except BrokenPipeError:
        pass  # the child died during start-up; _result reports how


def _read_output(proc: subprocess.Popen[bytes], limits: SandboxLimits) -> tuple[bytes, bytes, str]:
    """Stdout and stderr until both close, a deadline passes or stdout passes
    ``max_output_bytes``; once the sandbox process has exited, only until the pipes are
    empty (all it wrote is in them). The third value is why reading stopped early ("start":
    not ready within ``_START_LIMIT_S``; "timeout": ``timeout_s`` passed since it was ready;
    "output"; "held": it had exited, but processes it left held the pipes open), or ""."""
    assert proc.stdout is not None and proc.stderr is not None
    out, err = proc.stdout.fileno(), proc.stderr.fileno()
    caps = {out: limits.max_output_bytes, err: _STATUS_BYTES}
    data = {out: bytearray(), err: bytearray()}
    ready, exited, deadline = False, False, time.monotonic() + _START_LIMIT_S
    with selectors.DefaultSelector() as selector:
        for fd in data:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            left = deadline - time.monotonic()
            events = selector.select(min(left, 0.1)) if left > 0 else []
            if not events and (exited or left <= 0):
                cut = "held" if exited else "timeout" if ready else "start"
                return bytes(data[out]), bytes(data[err]), cut
            for key, _ in events:
                chunk = os.read(key.fd, 1 << 16)
                data[key.fd].extend(chunk)
                if not chunk:
                    selector.unregister(key.fd)
                elif len(data[key.fd]) > caps[key.fd]:
                    return bytes(data[out]), bytes(data[err]), "output"
            if not ready and _has_line_starting(data[err], _READY):
                ready, deadline = True, time.monotonic() + limits.timeout_s
            if not exited and not _running(proc):
                exited, deadline = True, min(deadline, time.monotonic() + _DRAIN_LIMIT_S)
                _kill_group(proc)  # children it left behind would hold the pipes open
    return bytes(data[out]), bytes(data[err]), ""


def _has_line_starting(data: bytearray, prefix: bytes) -> bool:
    """Whether a complete line of ``data`` starts with ``prefix``.

    >>> _has_line_starting(bytearray(b'warning\\n{"protections": []}\\n'), b'{"protections"')
    True
    >>> _has_line_starting(bytearray(b'{"protections": ['), b'{"protections"')
    False
    """
    return any(line.startswith(prefix) for line in data.split(b"\n")[:-1])


def _running(proc: subprocess.Popen[bytes]) -> bool:
    """Whether the sandbox process has not exited yet (it is not reaped: see :func:`_end`)."""
    return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None


def _running_after(proc: subprocess.Popen[bytes], grace_s: float) -> bool:
    """Whether the sandbox process is still running ``grace_s`` from now (checked often)."""
    deadline = time.monotonic() + grace_s
    while _running(proc):
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.005)
    return False


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the child's process group (one ``kill`` reaches forks in flight too)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def _end(proc: subprocess.Popen[bytes], cut: str) -> _Ending:
    """Kill the process group and the sandbox process's children, reap it, wait for them to
    be gone, and say how it ended.

    When reading ended because the pipes closed (no ``cut``), the process is normally
    exiting: the kernel closes a dying process's files before it becomes reapable, so it is
    given :data:`_EXIT_GRACE_S` to get there before it counts as killed by the parent (code
    that closes its pipes and runs on is still killed, and counted so). Its children are
    killed by pidfd too, as they may have left the group: under ``pidns`` its only child is
    the namespace's init, whose exit the kernel completes only once every other process of
    the namespace is gone, so nothing of the run is left when this returns."""
    running = _running(proc) if cut else _running_after(proc, _EXIT_GRACE_S)
    children = _children(proc) if running else []
    _kill_group(proc)
    for child in children:
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(child, signal.SIGKILL)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    _wait_for_exits(children, _EXIT_GRACE_S)
    return _Ending(proc.returncode, usage.ru_utime + usage.ru_stime, running)


def _children(proc: subprocess.Popen[bytes]) -> list[int]:
    """Pidfds of the running sandbox process's children ([] where /proc does not list them)."""
    try:
        with open(f"/proc/{proc.pid}/task/{proc.pid}/children") as f:
            pids = [int(pid) for pid in f.read().split()]
    except (OSError, ValueError):
        return []
    pidfds = []
    for pid in pids:
        with contextlib.suppress(OSError):
            pidfd = os.pidfd_open(pid)
            if _parent(pid) == proc.pid:  # still its child: not a process that reused the pid
                pidfds.append(pidfd)
            else:
                os.close(pidfd)
    return pidfds


def _parent(pid: int) -> int | None:
    """The parent's pid of process ``pid``, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def _wait_for_exits(pidfds: list[int], limit_s: float) -> None:
    """Wait until the processes of ``pidfds`` have exited, at most ``limit_s``; closes them."""
    deadline = time.monotonic() + limit_s
    with selectors.DefaultSelector() as selector:
        for pidfd in pidfds:
            selector.register(pidfd, selectors.EVENT_READ)
        while selector.get_map() and (left := deadline - time.monotonic()) > 0:
            for key, _ in selector.select(left):
                selector.unregister(key.fd)
    for pidfd in pidfds:
        os.close(pidfd)


def _result(
    out: bytes, status: bytes, cut: str, ending: _Ending, request: dict[str, Any]
) -> RunResult:
    limits = SandboxLimits(**request["limits"])
    n_cells, n_tests = len(request["cells"]), len(request["tests"])
    events = [e for e in map(_json_or_none, status.splitlines()) if isinstance(e, dict)]
    cells = {e["cell"]: e.get("error") for e in events if e.get("cell") in range(n_cells)}
    passed = {e["test"] for e in events if e.get("test") in range(n_tests) and e.get("passed")}
    protections: Any = next((e["protections"] for e in events if "protections" in e), [])
    last_error = cells.get(n_cells - 1)
    done = any(e.get("done") is True for e in events)
    counted = [e["leftover_processes"] for e in events if type(e.get("leftover_processes")) is int]
    stderr_lines = [line for line in status.decode(errors="replace").splitlines() if line]
    return RunResult(
        output=out[: limits.max_output_bytes].decode("utf-8", errors="replace"),
        error=last_error if isinstance(last_error, str) else None,
        stopped=_stop_reason(cut, ending, done, limits, stderr_lines[-1:]),
        cells_finished=len(cells),
        tests_passed=len(passed),
        protections=tuple(map(str, protections)) if isinstance(protections, list) else (),
        leftover_processes=counted[-1] if counted else int(cut == "held"),
    )


def _stop_reason(
    cut: str, ending: _Ending, done: bool, limits: SandboxLimits, tail: list[str]
) -> str | None:
    """Why the run stopped early, from facts: what the parent cut it for, whether the process
    was still running when the parent killed it, its signal and the CPU time it used."""
    if cut == "output":
        return f"Stopped: the output passed the {limits.max_output_bytes}-byte limit."
    if _hit_cpu_limit(ending, limits):
        return f"Stopped: the code used more than {limits.cpu_time_s} s of CPU time."
    if cut == "timeout":
        return f"Stopped: the code ran longer than the {limits.timeout_s:g} s time limit."
    if cut == "start":
        return f"Stopped: the sandbox did not start within {_START_LIMIT_S:g} s."
    if done:
        return None
    returncode = ending.returncode
    how = f"exit code {returncode}"
    if returncode < 0:
        how = (
            f"signal {signal.Signals(-returncode).name}"
            if -returncode in signal.valid_signals()
            else how
        )
    detail = f": {tail[0][:300]}" if tail and not tail[0].startswith("{") else ""
    return f"Stopped: the sandbox process ended early ({how}){detail}."


def _hit_cpu_limit(ending: _Ending, limits: SandboxLimits) -> bool:
    """RLIMIT_CPU ended the process: SIGXCPU at the soft limit, or SIGKILL at the hard limit
    (one second later; also when the code ignored SIGXCPU, or its CPU time passed both limits
    between two checks) that the parent did not send, after using its whole CPU budget.

    >>> limits = SandboxLimits(cpu_time_s=1)
    >>> _hit_cpu_limit(_Ending(-signal.SIGKILL, 2.01, killed_by_parent=False), limits)
    True
    >>> _hit_cpu_limit(_Ending(-signal.SIGKILL, 2.01, killed_by_parent=True), limits)
    False
    >>> _hit_cpu_limit(_Ending(-signal.SIGKILL, 0.2, killed_by_parent=False), limits)
    False
    """
    if ending.returncode == -signal.SIGXCPU:
        return True
    return (
        ending.returncode == -signal.SIGKILL
        and not ending.killed_by_parent
        and ending.cpu_s >= limits.cpu_time_s
    )


def _json_or_none(line: bytes) -> Any:
    try:
        return json.loads(line)
    except ValueError:
        return None
