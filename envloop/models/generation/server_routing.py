"""Which server a request goes to: the one with the fewest requests outstanding, except that
every turn of one sample goes to the server its first turn went to, while that server
answers (its prefix cache holds the sample's earlier turns).

A server that refuses a connection, times out or answers 5xx is set aside for a while and
tried again afterwards, so a server that restarts mid-run is used again once it is back.
The set-aside doubles with each consecutive failure up to a minute, counting only failures
of requests that end after it has passed: when a server dies with a thousand requests open,
they all fail within moments and count as one failure (the server is set aside for
``base_set_aside_s``), so a server restarted a second later is used again about a second
later, not a minute. Only servers that have joined
(answered their probe request, :mod:`server_fleet`) get requests. Pure bookkeeping, no I/O:
one event loop owns a :class:`ServerRouter`.
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
    failures: int = 0  # consecutive, each ending after the previous set-aside
    down_until: float = 0.0
    media: Any = None
    joined: bool = True  # answered its probe: requests may go to it
    answered: int = 0  # requests it answered

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
        self._joined = list(self.servers)
        self.base_set_aside_s = base_set_aside_s
        self.clock = clock
        self._sticky: OrderedDict[Hashable, ServerSlot] = OrderedDict()

    @property
    def joined(self) -> list[ServerSlot]:
        """The servers requests may go to, in the order of ``urls``."""
        return list(self._joined)

    def leave(self, server: ServerSlot) -> None:
        """Take ``server`` out of the routing until it joins (again): :meth:`join`."""
        server.joined = False
        self._joined = [s for s in self.servers if s.joined]

    def join(self, server: ServerSlot) -> None:
        """Let requests go to ``server`` (it answered its probe), starting afresh: no
        failures, not set aside."""
        server.joined, server.failures, server.down_until = True, 0, 0.0
        self._joined = [s for s in self.servers if s.joined]

    def acquire(self, key: Hashable | None = None) -> ServerSlot:
        """The server for a request of sample ``key`` (None: no sample affinity), counted
        as outstanding until :meth:`release`."""
        now = self.clock()
        server = self._sticky.get(key) if key is not None else None
        if server is None or not server.healthy(now) or not server.joined:
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
            server.answered += 1
            server.failures, server.down_until = 0, 0.0
            return
        now = self.clock()
        if server.down_until > now:  # sent before it was set aside: fails with the others
            return
        server.failures += 1
        doublings = min(server.failures - 1, MAX_DOUBLINGS)
        wait = min(self.base_set_aside_s * 2.0**doublings, MAX_SET_ASIDE_S)
        server.down_until = now + wait

    def _least_outstanding(self, now: float) -> ServerSlot:
        if not self._joined:
            raise RuntimeError("no server has joined the routing (none answered its probe)")
        healthy = [s for s in self._joined if s.healthy(now)]
        if healthy:
            return min(healthy, key=lambda s: s.outstanding)
        return min(self._joined, key=lambda s: s.down_until)  # the one back soonest
