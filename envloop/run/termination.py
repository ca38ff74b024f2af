"""How ``envloop run`` stops on a signal: SIGTERM, like Ctrl-C (SIGINT), raises an exception
in the main thread, so the run unwinds as any error does (its files are closed, the Ray
session it started is shut down) and the command prints one line and exits 143 (130 for
Ctrl-C), instead of Ray's own SIGTERM handler ending the process with exit status 15 and a
stack dump.

``ray.init`` installs that handler every time it runs, so the run takes SIGTERM back right
after starting or joining Ray (:func:`reclaim_sigterm`).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

__all__ = ["RunTerminated", "reclaim_sigterm", "sigterm_stops_the_run"]

_active = False  # inside sigterm_stops_the_run, on the main thread


class RunTerminated(KeyboardInterrupt):
    """SIGTERM reached the run (a ``KeyboardInterrupt``, so no ``except Exception`` on the
    way out swallows it)."""


def _raise_terminated(signum: int, frame: FrameType | None) -> None:
    raise RunTerminated(f"stopped by {signal.Signals(signum).name}")


@contextmanager
def sigterm_stops_the_run() -> Iterator[None]:
    """Within the block, SIGTERM raises :class:`RunTerminated` in the main thread; the
    previous handler returns after it (off the main thread, nothing changes)."""
    global _active
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, _raise_terminated)
    _active = True
    try:
        yield
    finally:
        _active = False
        signal.signal(signal.SIGTERM, previous)


def reclaim_sigterm() -> None:
    """Inside :func:`sigterm_stops_the_run`: take SIGTERM back from ``ray.init``."""
    if _active and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _raise_terminated)
