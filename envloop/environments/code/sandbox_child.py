"""The sandbox process of :mod:`envloop.environments.code.sandbox` (run as a script).

It reads one JSON request on stdin (working directory, uid/gid, limits, cells, tests),
isolates itself with every layer the kernel allows (see ``code_sandbox``'s docstring for
the threat model), runs the cells, reports one JSON status line per event on stderr, and
exits without running the code's ``atexit`` handlers. It imports nothing from envloop:
it runs with ``-S`` (no site-packages) inside a private root.

With a PID namespace (``pidns``) the run is three processes, none of which outlives the
one before it::

    sandbox process (outside the namespace, root): waits for init, then ends as the runner did
    └── init (PID 1, root, runs no code): reaps orphans; once the runner has ended it
        │   SIGKILLs and reaps every other process of the namespace, reports how many
        │   were left ({"leftover_processes": n}), hands the runner's wait status to its
        │   parent and exits; the kernel would kill what remained when it exits anyway
        └── runner (PID 2, the sandbox user): the remaining layers, then the cells and tests

so the sandbox process's exit code, signal (a CPU limit's ``SIGXCPU``) and CPU time (its
``rusage`` includes the processes it reaped) are the runner's, as without the namespace,
where the sandbox process is the runner itself.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import json
import os
import random
import resource
import signal
import sys
import traceback
from collections.abc import Callable
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, NoReturn

if TYPE_CHECKING:  # the sandbox must not load subprocess: it would bypass the fork block
    pass


_CLONE_NEWNS, _CLONE_NEWNET, _CLONE_NEWPID = 0x00020000, 0x40000000, 0x20000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_SET_NO_NEW_PRIVS = 1, 4, 38
_SYSTEM_LIBS = ("/lib", "/lib64", "/usr/lib", "/usr/lib64")  # shared libraries of C modules
_DEVICES = ("/dev/null", "/dev/urandom")

_ALWAYS_BLOCKED = ("socket.", "ctypes.", "os.kill", "signal.pthread_kill", "sqlite3.load_ext")
_PROCESS_EVENTS = ("os.fork", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "subprocess.")
_READ_EVENTS = {"os.listdir", "os.scandir", "os.listxattr", "os.getxattr"}
_WRITE_EVENTS = {
    "os.chmod", "os.chown", "os.link", "os.mkdir", "os.remove", "os.rename", "os.rmdir",
    "os.symlink", "os.truncate", "os.utime", "os.setxattr", "os.removexattr", "sqlite3.connect",
}  # fmt: skip
_UNSAFE_MODULES = ("ctypes", "_ctypes", "subprocess", "_posixsubprocess")
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC


def _child_main() -> None:
    request = json.loads(sys.stdin.buffer.read())
    limits = SimpleNamespace(**request["limits"])
    protections = _isolate(request["workdir"], request["uid"], request["gid"], limits)
    report = _Reporter()  # in the runner: with a PID namespace, a process forked above
    report(protections=protections)
    quiet = open(os.devnull, "w")  # noqa: SIM115 - replayed cells and tests print here
    namespace: dict[str, Any] = {"__name__": "__main__", "__builtins__": builtins}
    shown = open(1, "w", encoding="utf-8", errors="backslashreplace", buffering=1, closefd=False)  # noqa: SIM115
    random.seed(0)
    cells, tests = request["cells"], request["tests"]
    for i, cell in enumerate(cells):
        out = shown if i == len(cells) - 1 else quiet
        sys.stdout = sys.stderr = out
        error = _run_source(cell, namespace, f"<cell {i + 1}>", report.pid)
        out.flush()
        report(cell=i, error=error)
    sys.stdout = sys.stderr = quiet
    for i, test in enumerate(tests):
        passed = _run_source(test, namespace, f"<test {i + 1}>", report.pid) is None
        report(test=i, passed=passed)
    report(done=True)
    os._exit(0)  # skip the code's atexit handlers


class _Reporter:
    """Writes one JSON status line per event to stderr, from the sandbox's main process only."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self._write, self._dumps = os.write, json.dumps  # kept from before the code runs

    def __call__(self, **event: Any) -> None:
        if os.getpid() == self.pid:
            self._write(2, (self._dumps(event) + "\n").encode())


def _run_source(source: str, namespace: dict[str, Any], name: str, main_pid: int) -> str | None:
    """Execute ``source``; print its final expression's repr; the error text or None."""
    try:
        tree = ast.parse(source, filename=name)
        last = tree.body[-1] if tree.body else None
        if isinstance(last, ast.Expr):
            tree.body.pop()
        exec(compile(tree, name, "exec"), namespace)
        if isinstance(last, ast.Expr):
            value = eval(compile(ast.Expression(last.value), name, "eval"), namespace)
            if value is not None:
                print(repr(value))
        error = None
    except BaseException as exc:  # the code's own errors, SystemExit included
        error = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    if os.getpid() != main_pid:
        os._exit(0)  # a process the code forked ends with its code
    return error


def _isolate(workdir: str, uid: int | None, gid: int | None, limits: Any) -> list[str]:
    """Apply every layer the kernel allows, in order; the names of those applied."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    def call(name: str, *args: Any) -> None:
        if getattr(libc, name)(*args) != 0:
            raise OSError(ctypes.get_errno(), f"{name}{args}: {os.strerror(ctypes.get_errno())}")

    applied = []
    namespaces = _unshare(call) if uid is not None else []
    if uid is not None and namespaces:
        workdir = _private_root(call, workdir, uid, gid, limits.disk_mb)
        applied += ["netns", "chroot"]
    elif uid is not None:
        os.chown(workdir, uid, gid or 0)
    os.chdir(workdir)
    os.environ.update(HOME=workdir, TMPDIR=workdir)
    if "pidns" in namespaces:
        _fork_init_and_runner(call)  # returns in the runner only
        applied.append("pidns")
    if _try(call, "prctl", _PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0):
        applied.append("no_new_privs")
    _set_rlimits(limits)
    applied.append("rlimits")
    if uid is not None and gid is not None:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
        applied.append(f"uid={uid}")
    for name in [m for m in sys.modules if m in _UNSAFE_MODULES or m.startswith("ctypes.")]:
        del sys.modules[name]  # imported again, they would pass through the audit hook
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # too-large writes raise OSError instead
    sys.addaudithook(_audit_hook(os.getcwd(), limits.max_processes > 1))
    return [*applied, "audit_hook"]


def _unshare(call: Callable[..., None]) -> list[str]:
    """Enter new mount and network namespaces, and a PID namespace when the kernel has them:
    the layers' names (the mount namespace is reported as ``chroot``), or [] when refused."""
    if _try(call, "unshare", _CLONE_NEWNS | _CLONE_NEWNET | _CLONE_NEWPID):
        return ["netns", "pidns"]
    return ["netns"] if _try(call, "unshare", _CLONE_NEWNS | _CLONE_NEWNET) else []


def _fork_init_and_runner(call: Callable[..., None]) -> None:
    """Fork the PID namespace's init, which forks the runner; returns in the runner only.
    This process waits for init and ends as the runner did; init reaps (see the module
    docstring). A pipe carries the runner's wait status from init to this process."""
    status_read, status_write = os.pipe()
    init = os.fork()  # PID 1 of the namespace unshared before
    if init:
        os.close(status_write)
        _end_as_runner(call, init, status_read)
    os.close(status_read)
    call("prctl", _PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # no init without its parent
    runner = os.fork()
    if runner:
        _reap_until_runner_ends(runner, status_write)
    os.close(status_write)


def _end_as_runner(call: Callable[..., None], init: int, status_read: int) -> NoReturn:
    """Wait for init, then exit with the runner's status: its exit code, or its signal."""
    _, init_status = os.waitpid(init, 0)
    reported = os.read(status_read, 32)
    status = int(reported) if reported.isdigit() else init_status  # init died first
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        call("prctl", _PR_SET_DUMPABLE, 0, 0, 0, 0)  # the signal dumps no core here
        with contextlib.suppress(OSError, ValueError):  # SIGKILL has no handler to reset
            signal.signal(number, signal.SIG_DFL)
        os.kill(os.getpid(), number)
        os._exit(128 + number)  # a signal whose default is to be ignored
    os._exit(os.waitstatus_to_exitcode(status))


def _reap_until_runner_ends(runner: int, status_write: int) -> NoReturn:
    """As init: reap every process that ends until the runner does, then kill and reap the
    rest, report how many were still running, hand over the runner's status and exit."""
    while (ended := os.waitpid(-1, 0))[0] != runner:
        pass  # an orphan the runner's processes left: reaped, as init does
    leftovers = _kill_and_reap_the_rest()
    with contextlib.suppress(OSError):  # the parent may have stopped reading
        if leftovers:
            os.write(2, (json.dumps({"leftover_processes": leftovers}) + "\n").encode())
        os.write(status_write, str(ended[1]).encode())
    os._exit(0)


def _kill_and_reap_the_rest() -> int:
    """As init (PID 1): SIGKILL every other process of the namespace and reap them all; how
    many of them were still running (a process killed before it could be reaped)."""
    if os.getpid() != 1:  # kill(-1) would reach the whole host: never outside the namespace
        return 0
    killed = 0
    while True:
        with contextlib.suppress(ProcessLookupError):
            os.kill(-1, signal.SIGKILL)  # every process of the namespace but init
        try:
            _, status = os.waitpid(-1, 0)
        except ChildProcessError:  # no children left: the namespace holds only init
            return killed
        killed += os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL


def _try(call: Callable[..., None], *args: Any) -> bool:
    try:
        call(*args)
    except OSError:
        return False
    return True


def _private_root(
    call: Callable[..., None], mountpoint: str, uid: int, gid: int | None, disk_mb: int
) -> str:
    """Build the private filesystem view at ``mountpoint`` and chroot into it; returns the
    new working directory."""
    call("mount", None, b"/", None, _MS_REC | _MS_PRIVATE, None)  # nothing leaks to the host
    opts = f"size={disk_mb}m,mode=755".encode()
    call(
        "mount", b"tmpfs", mountpoint.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV | _MS_NOEXEC, opts
    )
    read_only = [p for p in [*_python_dirs(), *_SYSTEM_LIBS, *_DEVICES] if os.path.exists(p)]
    for source in read_only:
        target = mountpoint + source
        if os.path.isdir(source):
            os.makedirs(target, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            open(target, "w").close()
        flags = _MS_BIND | _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID
        call("mount", source.encode(), target.encode(), None, _MS_BIND | _MS_REC, None)
        call("mount", None, target.encode(), None, flags, None)
    os.mkdir(mountpoint + "/work", 0o700)
    os.chown(mountpoint + "/work", uid, gid or 0)
    os.chroot(mountpoint)
    return "/work"


def _python_dirs() -> list[str]:
    return [os.path.realpath(p) for p in sys.path if p and os.path.isdir(p)]


def _set_rlimits(limits: Any) -> None:
    mb = 1 << 20
    for kind, value in [
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_AS, limits.memory_mb * mb),
        (resource.RLIMIT_FSIZE, limits.disk_mb * mb),
        (resource.RLIMIT_NOFILE, limits.max_open_files),
        (resource.RLIMIT_NPROC, limits.max_processes),
    ]:
        resource.setrlimit(kind, (value, value))
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_time_s, limits.cpu_time_s + 1))


def _audit_hook(workdir: str, allow_processes: bool) -> Callable[[str, tuple[Any, ...]], None]:
    """A ``sys.addaudithook`` hook enforcing the file, network and process policy."""
    blocked = _ALWAYS_BLOCKED + (() if allow_processes else _PROCESS_EVENTS)
    blocked_imports = {"ctypes", "_ctypes"} | (set() if allow_processes else {"_posixsubprocess"})
    readable = [workdir, *_python_dirs(), *_DEVICES]
    writable = [workdir, os.devnull]

    def check(path: Any, writing: bool) -> None:
        if path is None or isinstance(path, int):
            return  # an already open file descriptor, or the working directory
        real = os.path.realpath(os.fsdecode(path))
        roots = writable if writing else readable
        if not any(real == root or real.startswith(root + os.sep) for root in roots):
            verb = "writing" if writing else "reading"
            raise PermissionError(f"sandbox: {verb} {real!r} is not allowed (outside {workdir})")

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event.startswith(blocked) or (event == "import" and args[0] in blocked_imports):
            what = f"import {args[0]}" if event == "import" else event
            raise PermissionError(f"sandbox: {what} is not allowed")
        if event == "open":
            path, mode, flags = args
            check(path, bool(set(mode or "") & set("wax+")) or bool(flags & _WRITE_FLAGS))
        elif event in _READ_EVENTS:
            check(args[0], writing=False)
        elif event in _WRITE_EVENTS:
            for arg in args:
                if isinstance(arg, (str, bytes, os.PathLike)):
                    check(arg, writing=True)

    return hook


if __name__ == "__main__":
    _child_main()
