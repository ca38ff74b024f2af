"""A thread pool whose threads never keep the interpreter alive.

``concurrent.futures.ThreadPoolExecutor`` joins its workers when the interpreter exits, so
one environment step stuck forever (a hang the step timeout gave up on) would keep a finished
program from ever exiting. :class:`DaemonThreadPool` runs calls on daemon threads instead: an
abandoned call dies with the process.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

T = TypeVar("T")

_STOP = None


class DaemonThreadPool(Executor):
    """An ``Executor`` of at most ``max_workers`` daemon threads (None: one per call in
    flight), started as calls arrive; idle threads wait for more work.

    >>> pool = DaemonThreadPool(2, "demo")
    >>> pool.submit(sum, [1, 2, 3]).result()
    6
    >>> pool.shutdown()
    """

    def __init__(self, max_workers: int | None = None, name: str = "envloop") -> None:
        if max_workers is not None and max_workers < 1:
            raise ValueError(f"DaemonThreadPool: max_workers must be None or >= 1: {max_workers}")
        self.max_workers, self.name = max_workers, name
        self._work: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple, dict] | None]
        self._work = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._idle = 0
        self._closed = False

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        """Run ``fn(*args, **kwargs)`` on a pool thread; its future."""
        future: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self.name}: cannot submit after shutdown")
            self._work.put((future, fn, args, kwargs))
            if self._idle > 0:
                self._idle -= 1
            elif self.max_workers is None or len(self._threads) < self.max_workers:
                thread = threading.Thread(
                    target=self._serve, name=f"{self.name}-{len(self._threads)}", daemon=True
                )
                self._threads.append(thread)
                thread.start()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Take no more calls; ``cancel_futures``: drop the calls not started yet. Threads
        finish the call they run (``wait``: join them, which waits for that call)."""
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        if cancel_futures:
            while True:
                try:
                    item = self._work.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[0].cancel()
        for _ in threads:
            self._work.put(_STOP)
        if wait:
            for thread in threads:
                if thread is not threading.current_thread():
                    thread.join()

    def _serve(self) -> None:
        while True:
            item = self._work.get()
            if item is _STOP:
                return
            future, fn, args, kwargs = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as exc:  # the caller sees it through the future
                    future.set_exception(exc)
            del item, future, fn, args, kwargs
            with self._lock:
                self._idle += 1
