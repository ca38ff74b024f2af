"""An asyncio event loop running forever on a daemon thread of its own.

Synchronous code (a blocking ``generate``, an environment's ``step`` called from a Ray actor
or a plain thread) hands coroutines to :class:`LoopThread` and waits on their futures, while
the loop keeps the state that must outlive one call: an HTTP session, async clients made in
one step that serve the next. The thread is a daemon, so a coroutine that never finishes
does not keep a finished program from exiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    """An event loop on a daemon thread named ``name``, started at construction.

    ``reentry_error`` is the text of the ``RuntimeError`` that :meth:`submit` raises when
    called from the loop's own thread (its future could never be waited on there).

    >>> runner = LoopThread("demo")
    >>> async def add(a, b):
    ...     return a + b
    >>> runner.run(add(1, 2))
    3
    >>> runner.close(wait=True)
    >>> runner.running
    False
    """

    def __init__(
        self,
        name: str,
        reentry_error: str = "a coroutine was submitted to its loop thread from that "
        "thread, where its result can never be waited on; await it instead",
    ) -> None:
        self.name, self.reentry_error = name, reentry_error
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()

    @property
    def running(self) -> bool:
        """Whether the loop's thread is alive (False once :meth:`close` stopped it)."""
        return self.thread.is_alive()

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Start ``coro`` on the loop (from any other thread); its future."""
        if threading.current_thread() is self.thread:
            coro.close()
            raise RuntimeError(self.reentry_error)
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` on the loop and wait for its result (from any other thread)."""
        return self.submit(coro).result()

    def close(self, wait: bool = False) -> None:
        """Stop the loop; its thread ends (and closes the loop) once the running callbacks
        return. ``wait``: join the thread too (unless called from it). Closing twice is
        harmless."""
        with contextlib.suppress(RuntimeError):  # already closed
            self.loop.call_soon_threadsafe(self.loop.stop)
        if wait and threading.current_thread() is not self.thread:
            self.thread.join()

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            self.loop.close()
