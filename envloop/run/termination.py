"""How ``envloop run`` stops on a signal.

Within :func:`signals_stop_the_run` (the command line's run), SIGINT (Ctrl-C) and SIGTERM:

- while the run starts up (prompts, Ray, environments, policy): raise an exception in the
  main thread (:class:`RunTerminated` for SIGTERM, ``KeyboardInterrupt`` for SIGINT), so
  the run unwinds as any error does;
- once it rolls out (inside :func:`admitting_work`): the first signal stops admitting work:
  no batch starts, and an async batch's stream starts no more samples (the callback of
  :func:`stopping_calls`, ``RolloutStream.stop_admitting``). The work in flight (a sync
  batch; an async batch's started samples) runs to its end, its samples are recorded, the
  rollout files are written from the finished samples, and the run raises
  :class:`RunStopped`; the command prints the command that resumes and exits 128 + the
  signal's number (130 for SIGINT, 143 for SIGTERM);
- a second signal, of either kind, ends the process at once (``os._exit``, status 128 + its
  number) after printing the command that resumes: every finished sample is already on
  disk (:mod:`envloop.run.journal`), so this loses only the samples in flight, as a kill
  does.

Ray's processes block SIGINT, so Ctrl-C on a terminal reaches only the driver. ``ray.init``
installs its own SIGTERM handler every time it runs, so the run takes SIGTERM back right
after starting or joining Ray (:func:`reclaim_sigterm`). Off the main thread nothing
changes.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from types import FrameType
from typing import ClassVar

__all__ = [
    "RunStopped",
    "RunTerminated",
    "admitting_work",
    "reclaim_sigterm",
    "resume_command",
    "signals_stop_the_run",
    "stop_requested",
    "stopping_calls",
]

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class _State:
    active = False  # inside signals_stop_the_run, on the main thread
    draining = False  # inside admitting_work: a first signal stops admitting work
    requested: int | None = None  # the signal that asked the run to stop
    resume_command: str | None = None
    on_stop: ClassVar[list[Callable[[], None]]] = []  # called when a signal asks to stop


class RunTerminated(KeyboardInterrupt):
    """SIGTERM reached the run while it started up (a ``KeyboardInterrupt``, so no
    ``except Exception`` on the way out swallows it)."""


class RunStopped(KeyboardInterrupt):
    """The run stopped on a signal after recording what finished: ``finished`` of
    ``total`` samples are kept in ``run_dir``; ``signum`` is the signal."""

    def __init__(self, signum: int, finished: int, total: int, run_dir: str) -> None:
        super().__init__(_label(signum))
        self.signum, self.finished, self.total, self.run_dir = signum, finished, total, run_dir

    @property
    def exit_status(self) -> int:
        """128 + the signal's number (130 for SIGINT, 143 for SIGTERM)."""
        return 128 + self.signum


def _on_signal(signum: int, frame: FrameType | None) -> None:
    name = signal.Signals(signum).name
    if not _State.draining:
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise RunTerminated(f"stopped by {name}")
    if _State.requested is None:
        _State.requested = signum
        again = "Ctrl-C" if signum == signal.SIGINT else "SIGINT or SIGTERM"
        _say(
            f"\nenvloop run: {_label(signum)}: finishing the samples in flight, then "
            f"stopping ({again} again stops at once; the samples in flight then rerun on "
            "--resume)\n"
        )
        for callback in list(_State.on_stop):
            callback()
        return
    _say(f"\nenvloop run: {_label(signum)} again: stopped at once\n{_resume_line()}")
    os._exit(128 + signum)


def _label(signum: int) -> str:
    return "interrupted (Ctrl-C)" if signum == signal.SIGINT else "stopped by SIGTERM"


def _resume_line() -> str:
    command = _State.resume_command
    return f"envloop run: resume with: {command}\n" if command else ""


def _say(text: str) -> None:
    """Write to stderr from a signal handler (bypassing ``sys.stderr``'s buffer, which the
    interrupted code may be writing)."""
    with suppress(OSError):
        os.write(2, text.encode())


@contextmanager
def signals_stop_the_run(resume_command: str | None = None) -> Iterator[None]:
    """Within the block, SIGINT and SIGTERM stop the run as the module docstring says;
    ``resume_command`` is printed when a second signal ends the process. The previous
    handlers return after it (off the main thread, nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.getsignal(signum) for signum in _SIGNALS}
    for signum in _SIGNALS:
        signal.signal(signum, _on_signal)
    _State.active, _State.requested, _State.resume_command = True, None, resume_command
    try:
        yield
    finally:
        _State.active = _State.draining = False
        _State.requested = _State.resume_command = None
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextmanager
def admitting_work() -> Iterator[None]:
    """Within the block (a run's rollout loop), a first signal only asks the run to stop
    (:func:`stop_requested`); outside it, a signal raises at once."""
    _State.draining = _State.active
    try:
        yield
    finally:
        _State.draining = False


@contextmanager
def stopping_calls(callback: Callable[[], None]) -> Iterator[None]:
    """Within the block, a signal that asks the run to stop also calls ``callback`` (from
    the signal handler, on the main thread: it must only set a flag, as
    ``RolloutStream.stop_admitting`` does); called at once when a stop was asked before."""
    _State.on_stop.append(callback)
    try:
        if _State.requested is not None:
            callback()
        yield
    finally:
        _State.on_stop.remove(callback)


def resume_command() -> str | None:
    """The command line that resumes the run (given to :func:`signals_stop_the_run`), or
    None."""
    return _State.resume_command


def stop_requested() -> int | None:
    """The signal that asked the run to stop, or None."""
    return _State.requested


def reclaim_sigterm() -> None:
    """Inside :func:`signals_stop_the_run`: take SIGTERM back from ``ray.init``."""
    if _State.active and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_signal)
