"""The sandbox process of :mod:`envloop.environments.code.sandbox` (run as a script).

It reads one JSON request on stdin (working directory, uid/gid, limits, cells, tests),
isolates itself with every layer the kernel allows (see ``code_sandbox``'s docstring for
the threat model), runs the cells, reports one JSON status line per event on stderr, and
exits without running the code's ``atexit`` handlers. It imports nothing from envloop:
it runs with ``-S`` (no site-packages) inside a private root.
"""

from __future__ import annotations

import ast
import builtins
import json
import os
import random
import resource
import signal
import sys
import traceback
from collections.abc import Callable
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the sandbox must not load subprocess: it would bypass the fork block
    pass


_CLONE_NEWNS, _CLONE_NEWNET = 0x00020000, 0x40000000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_NOEXEC = 1, 2, 4, 8
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 32, 4096, 16384, 1 << 18
_PR_SET_NO_NEW_PRIVS = 38
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
    report = _Reporter()
    quiet = open(os.devnull, "w")  # noqa: SIM115 - replayed cells and tests print here
    limits = SimpleNamespace(**request["limits"])
    report(protections=_isolate(request["workdir"], request["uid"], request["gid"], limits))
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
    if uid is not None and _try(call, "unshare", _CLONE_NEWNS | _CLONE_NEWNET):
        workdir = _private_root(call, workdir, uid, gid, limits.disk_mb)
        applied += ["netns", "chroot"]
    elif uid is not None:
        os.chown(workdir, uid, gid or 0)
    os.chdir(workdir)
    os.environ.update(HOME=workdir, TMPDIR=workdir)
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
