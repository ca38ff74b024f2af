"""Which server a request goes to: the one with the fewest requests outstanding, except that
every turn of one sample goes to the server its first turn went to, while that server
answers (its prefix cache holds the sample's earlier turns).

A server that refuses a connection, times out or answers 5xx is set aside for a while
(doubling with each consecutive failure, up to a minute) and tried again afterwards, so a
server that restarts mid-run is used again once it is back. Pure bookkeeping, no I/O: one
event loop owns a :class:`ServerRouter`.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

MAX_STICKY_SAMPLES = 1 << 16
"""Samples whose server is remembered (the least recently used are forgotten first)."""
MAX_SET_ASIDE_S = 60.0
MAX_DOUBLINGS = 64
"""Consecutive failures past which the set-aside stops doubling (it is at the cap long
before; ``2.0 ** n`` itself would overflow a float past n = 1023)."""


@dataclass(eq=False)
class ServerSlot:
    """One server and what the router knows of it (``media``: what it said about image
    input at start-up, None when not asked)."""

    url: str
    outstanding: int = 0
    failures: int = 0  # consecutive
    down_until: float = 0.0
    media: Any = None

    def healthy(self, now: float) -> bool:
        return self.down_until <= now


class ServerRouter:
    """Least-outstanding routing with per-sample stickiness over ``urls``.

    >>> router = ServerRouter(["http://a", "http://b"])
    >>> first = router.acquire("sample-0"); second = router.acquire("sample-1")
    >>> first.url, second.url, router.acquire("sample-0").url
    ('http://a', 'http://b', 'http://a')
    """

    def __init__(
        self, urls: Sequence[str], base_set_aside_s: float = 0.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        self.servers = [ServerSlot(url.rstrip("/")) for url in urls]
        self.base_set_aside_s = base_set_aside_s
        self.clock = clock
        self._sticky: OrderedDict[Hashable, ServerSlot] = OrderedDict()

    def acquire(self, key: Hashable | None = None) -> ServerSlot:
        """The server for a request of sample ``key`` (None: no sample affinity), counted
        as outstanding until :meth:`release`."""
        now = self.clock()
        server = self._sticky.get(key) if key is not None else None
        if server is None or not server.healthy(now):
            server = self._least_outstanding(now)
        if key is not None:
            self._sticky[key] = server
            self._sticky.move_to_end(key)
            if len(self._sticky) > MAX_STICKY_SAMPLES:
                self._sticky.popitem(last=False)
        server.outstanding += 1
        return server

    def release(self, server: ServerSlot, *, ok: bool) -> None:
        """A request to ``server`` ended: answered (``ok``), or failed to reach it."""
        server.outstanding -= 1
        if ok:
            server.failures, server.down_until = 0, 0.0
            return
        server.failures += 1
        doublings = min(server.failures - 1, MAX_DOUBLINGS)
        wait = min(self.base_set_aside_s * 2.0**doublings, MAX_SET_ASIDE_S)
        server.down_until = self.clock() + wait

    def _least_outstanding(self, now: float) -> ServerSlot:
        healthy = [s for s in self.servers if s.healthy(now)]
        if healthy:
            return min(healthy, key=lambda s: s.outstanding)
        return min(self.servers, key=lambda s: s.down_until)  # the one back soonest
