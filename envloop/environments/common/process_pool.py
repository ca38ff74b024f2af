"""Worker processes with a hard per-item timeout, for checks that may hang or crash.

Libraries such as math-verify time themselves out with ``signal.alarm``, which only works on
a process's main thread; inside a threaded or async Ray actor it raises instead. Here every
item runs on the main thread of a worker process, and the parent enforces its own deadline:
a worker that overruns is killed and replaced, and so is one that crashes. The other items
of the batch go on on the other workers.
"""

from __future__ import annotations

import multiprocessing as mp
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

_READY = "ready"
_STARTUP_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Outcome:
    """One item's result: ``value`` when ``error`` is None, else the reason it has none."""

    value: Any = None
    error: str | None = None


class HardTimeoutPool:
    """``num_workers`` processes that each run ``fn(item)`` one item at a time.

    ``fn`` must be importable (a module-level function): workers start with the ``spawn``
    method, which is safe inside multithreaded processes such as Ray actors. ``warm_up``
    (importable too) runs once in each worker before it takes items, so that one-time costs
    (lazy imports, parser tables, caches) are paid at start-up, never inside an item's time.

    >>> pool = HardTimeoutPool(abs, num_workers=1, timeout_s=10)
    >>> [o.value for o in pool.map([-1, 2])]
    [1, 2]
    >>> pool.close()
    """

    def __init__(
        self,
        fn: Callable[[Any], Any],
        num_workers: int,
        timeout_s: float,
        warm_up: Callable[[], Any] | None = None,
    ) -> None:
        if num_workers < 1 or timeout_s <= 0:
            raise ValueError(
                f"HardTimeoutPool needs num_workers >= 1 and timeout_s > 0, got "
                f"{num_workers} and {timeout_s}."
            )
        self.fn, self.warm_up = fn, warm_up
        self.timeout_s = timeout_s
        self._context = mp.get_context("spawn")
        self._workers = self._start_many(num_workers)
        self.replaced = 0
        """How many workers were killed (timeout) or died (crash) and replaced."""

    def map(self, items: Sequence[Any]) -> list[Outcome]:
        """Run ``fn`` on every item, in parallel across workers; outcomes in item order."""
        outcomes: list[Outcome | None] = [None] * len(items)
        pending = deque(enumerate(items))
        busy: dict[int, tuple[int, float]] = {}  # worker slot -> (item index, deadline)
        while pending or busy:
            for slot in range(len(self._workers)):
                if slot not in busy and pending:
                    index, item = pending.popleft()
                    busy[slot] = (index, self._send(slot, item))
            self._collect(busy, outcomes)
        return [o if o is not None else Outcome(error="lost") for o in outcomes]

    def close(self) -> None:
        """Stop every worker."""
        for worker in getattr(self, "_workers", []):
            worker.stop()
        self._workers = []

    def __del__(self) -> None:
        self.close()

    def _collect(self, busy: dict[int, tuple[int, float]], outcomes: list[Outcome | None]) -> None:
        now = time.monotonic()
        conns: dict[Any, int] = {self._workers[slot].conn: slot for slot in busy}
        timeout = max(0.0, min(deadline for _, deadline in busy.values()) - now)
        for conn in wait(list(conns), timeout=timeout):
            slot = conns[conn]
            index, _ = busy.pop(slot)
            outcomes[index] = self._receive(slot)
        now = time.monotonic()
        for slot, (index, deadline) in list(busy.items()):
            if now >= deadline and self._workers[slot].conn.poll(0):
                busy.pop(slot)  # its answer is here (this process looked late): keep it
                outcomes[index] = self._receive(slot)
            elif now >= deadline:
                busy.pop(slot)
                outcomes[index] = Outcome(error=f"timed out after {self.timeout_s} s")
                self._replace(slot)

    def _send(self, slot: int, item: Any) -> float:
        try:
            self._workers[slot].conn.send(item)
        except (BrokenPipeError, OSError):
            self._replace(slot)
            self._workers[slot].conn.send(item)
        return time.monotonic() + self.timeout_s

    def _receive(self, slot: int) -> Outcome:
        try:
            ok, payload = self._workers[slot].conn.recv()
        except (EOFError, OSError):
            self._workers[slot].process.join(timeout=5)
            exitcode = self._workers[slot].process.exitcode
            self._replace(slot)
            return Outcome(error=f"worker process died (exit code {exitcode})")
        return Outcome(value=payload) if ok else Outcome(error=payload)

    def _replace(self, slot: int) -> None:
        self._workers[slot].stop()
        self._workers[slot] = self._start_many(1)[0]
        self.replaced += 1

    def _start_many(self, n: int) -> list[_Worker]:
        """``n`` new workers, started together; returns once each has imported ``fn``
        (start-up never counts as item time)."""
        started = []
        for _ in range(n):
            parent, child = self._context.Pipe()
            args = (child, self.fn, self.warm_up)
            process = self._context.Process(target=_serve, args=args, daemon=True)
            process.start()
            child.close()
            started.append(_Worker(process, parent))
        for worker in started:
            if not worker.conn.poll(_STARTUP_TIMEOUT_S) or worker.conn.recv() != _READY:
                for w in started:
                    w.stop()
                name = getattr(self.fn, "__qualname__", self.fn)
                raise RuntimeError(
                    f"A worker process for {name!r} did not start within {_STARTUP_TIMEOUT_S} s;"
                    " is the function importable?"
                )
        return started


@dataclass
class _Worker:
    process: Any
    conn: Connection

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


def _serve(conn: Connection, fn: Callable[[Any], Any], warm_up: Callable[[], Any] | None) -> None:
    """A worker's loop, after ``warm_up()``: receive an item, send back ``(True, fn(item))``
    or ``(False, error)``."""
    if warm_up is not None:
        warm_up()
    conn.send(_READY)
    while True:
        try:
            item = conn.recv()
        except (EOFError, OSError, KeyboardInterrupt):
            return
        try:
            reply = (True, fn(item))
        except Exception as exc:
            reply = (False, "".join(traceback.format_exception_only(type(exc), exc)).strip())
        conn.send(reply)
